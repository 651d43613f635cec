"""KV cache blocks: a fixed pool, a free list, and prefix reuse. Plain Python, no tensors.

The runner owns a KV tensor of `num_blocks` blocks of `block_size` token positions; this module
decides which block holds which positions of which sequence. A block whose tokens are all computed
gets a *prefix hash* (a hash of every token from the start of the sequence up to the block's end,
computed as a chain: the block's tokens hashed with the previous block's hash),
so a later prompt that starts with the same tokens reuses it instead of recomputing it. Past the
last equal full block, a prompt also reuses the leading positions of a block that holds the same
tokens up to where the prompt differs (or ends): its fresh block starts as a copy of that block
(`BlockTable.copy_from`, done by the runner before the step computes the rest), so a repeated
prompt, or a conversation's next turn, recomputes only its new tokens, not up to a block of old ones.

Free blocks wait in LRU order; a freed block keeps its hash (and its K/V) until it is handed out
again, so recently finished prompts stay reusable while memory allows.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    prefix_hash: int | None = None
    parent_hash: int | None = None  # the hash of the block before (None: first), with tokens
    # the tokens whose K/V the block holds, when it offers them to partly equal prompts: all
    # its tokens with a prefix hash, or the computed ones of a freed sequence's last block
    tokens: tuple[int, ...] = ()


@dataclass
class BlockTable:
    """The blocks of one sequence, in position order, and how much of its prompt was reused."""

    block_ids: list[int] = field(default_factory=list)
    num_reused_tokens: int = 0
    num_hashed_blocks: int = 0  # leading blocks whose prefix hash is registered
    last_hash: int | None = None  # the prefix hash of block num_hashed_blocks - 1 (the chain)
    # (source block, this table's block): copy the source's K/V into the block before the step
    # that computes the rest of it; num_reused_tokens counts the positions it gives
    copy_from: tuple[int, int] | None = None


# Blocks compared per admission when looking for a partly equal one (one list per parent block
# and first token: more than this many only when many prompts share a prefix and its next token).
_MAX_CANDIDATES = 32


class NoFreeBlocks(RuntimeError):
    pass


def prefix_hashes(token_ids: Sequence[int], block_size: int, prev_hash: int | None = None
                  ) -> list[int]:
    """Hash of each full block of token_ids, chained from the hash of the block before them
    (None: they start at position 0), so equal hashes mean equal tokens from position 0."""
    hashes, prev = [], b"" if prev_hash is None else prev_hash.to_bytes(16, "little")
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = array.array("q", token_ids[start:start + block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        hashes.append(int.from_bytes(prev, "little"))
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_reuse: bool = True,
                 partial_reuse: bool = True):
        """partial_reuse: also start a prompt's first fresh block as a copy of a cached block's
        leading positions (off for int8 K/V: the copy keeps the source's block scale, which the
        positions after it helped set, so it would not hold what computing them gives)."""
        assert num_blocks > 0 and block_size > 0
        self.block_size = block_size
        self.enable_prefix_reuse = enable_prefix_reuse
        self.partial_reuse = enable_prefix_reuse and partial_reuse
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self._by_hash: dict[int, int] = {}
        # blocks with tokens (hashed ones, freed partly filled ones) by (parent's hash, first
        # token): where a partly equal block is found
        self._children: dict[tuple[int | None, int], dict[int, None]] = {}

    # -- figures -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks still holding reusable K/V."""
        return sum(1 for b in self._free if self.blocks[b].prefix_hash is not None)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- allocation ----------------------------------------------------------------------------
    def can_allocate(self, token_ids: Sequence[int], reuse: bool = True) -> bool:
        reused = self._reusable(token_ids) if reuse else []
        fresh = self.blocks_needed(len(token_ids)) - len(reused)
        # Reused blocks that sit in the free list are taken out of it too.
        return fresh + sum(1 for b, _ in reused if b in self._free) <= self.num_free_blocks

    def allocate(self, token_ids: Sequence[int], reuse: bool = True) -> BlockTable:
        """Blocks for a prompt: reused full blocks of an equal prefix, then fresh ones, the
        first of them to start as a copy of a cached block with the next tokens equal (see
        copy_from); `reuse` False: fresh ones only (every position to compute).

        At least the last token is left to compute (its logits start decoding), so a fully cached
        prompt reuses all but its last token."""
        if not self.can_allocate(token_ids, reuse):
            raise NoFreeBlocks(f"{self.blocks_needed(len(token_ids))} blocks needed, "
                               f"{self.num_free_blocks} free")
        table = BlockTable()
        reused = self._reusable(token_ids) if reuse else []
        for block_id, _ in reused:
            table.block_ids.append(self._take_reused(block_id))
        table.num_hashed_blocks = len(table.block_ids)
        table.last_hash = reused[-1][1] if reused else None
        table.num_reused_tokens = table.num_hashed_blocks * self.block_size
        source, equal = self._partly_equal(token_ids, table.num_reused_tokens,
                                           table.last_hash) if reuse else (-1, 0)
        while len(table.block_ids) < self.blocks_needed(len(token_ids)):
            table.block_ids.append(self._take_fresh())
        if equal:
            # taken fresh above (it was free), the source is its own copy: nothing to move
            if table.block_ids[table.num_hashed_blocks] != source:
                table.copy_from = (source, table.block_ids[table.num_hashed_blocks])
            table.num_reused_tokens += equal
        return table

    def may_append(self, table: BlockTable, num_tokens: int) -> bool:
        """Whether the sequence can grow to num_tokens positions (one more block at most)."""
        return self.blocks_needed(num_tokens) - len(table.block_ids) <= self.num_free_blocks

    def append(self, table: BlockTable, num_tokens: int) -> None:
        while len(table.block_ids) < self.blocks_needed(num_tokens):
            if not self._free:
                raise NoFreeBlocks("no free KV block to grow the sequence")
            table.block_ids.append(self._take_fresh())

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens positions (taken for draft positions
        that were rejected). They never hold a prefix hash, so they go to the LRU end of the
        free list, to be handed out before blocks that cached K/V is still reusable from."""
        keep = self.blocks_needed(num_tokens)
        assert keep >= table.num_hashed_blocks
        while len(table.block_ids) > keep:
            block = self.blocks[table.block_ids.pop()]
            assert block.prefix_hash is None and block.ref_count == 1
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)

    def mark_computed(self, table: BlockTable, token_ids: Sequence[int], num_computed: int) -> None:
        """Register prefix hashes of the blocks whose positions are now all computed."""
        if not self.enable_prefix_reuse:
            return
        full = num_computed // self.block_size
        if full <= table.num_hashed_blocks:
            return
        P, done = self.block_size, table.num_hashed_blocks
        hashes = prefix_hashes(token_ids[done * P:full * P], P, table.last_hash)  # new blocks'
        parent = table.last_hash
        for index, h in zip(range(done, full), hashes, strict=True):
            block = self.blocks[table.block_ids[index]]
            if h not in self._by_hash:
                block.prefix_hash, block.parent_hash = h, parent
                block.tokens = tuple(token_ids[index * P:(index + 1) * P])
                self._by_hash[h] = block.block_id
                self._children.setdefault((parent, block.tokens[0]), {})[block.block_id] = None
            parent = h
        table.num_hashed_blocks, table.last_hash = full, hashes[-1]

    def free(self, table: BlockTable, token_ids: Sequence[int] = (), num_computed: int = 0
             ) -> None:
        """Release a sequence's blocks; the last blocks go to the free list's LRU end last, so a
        prompt's later blocks are evicted before its first ones. Given the sequence's tokens
        and how many are computed, its partly filled last block (past its hashed ones) keeps
        offering those tokens' K/V to a partly equal prompt until it is handed out again: the
        next turn of a conversation starts with all of this one."""
        P = self.block_size
        index = num_computed // P
        if (self.partial_reuse and num_computed % P and index == table.num_hashed_blocks
                and index < len(table.block_ids)):
            block = self.blocks[table.block_ids[index]]
            if block.ref_count == 1 and block.prefix_hash is None and not block.tokens:
                block.parent_hash, block.tokens = table.last_hash, tuple(
                    token_ids[index * P:num_computed])
                self._children.setdefault((block.parent_hash, block.tokens[0]),
                                          {})[block.block_id] = None
        for block_id in reversed(table.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self._free[block_id] = None
        table.block_ids.clear()

    # -- internals -----------------------------------------------------------------------------
    def _reusable(self, token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """(block id, prefix hash) of the cached leading blocks of a prompt."""
        if not self.enable_prefix_reuse:
            return []
        # Never reuse the block holding the last token: its logits must be computed.
        hashes = prefix_hashes(token_ids[:len(token_ids) - 1], self.block_size)
        reused = []
        for h in hashes:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            reused.append((block_id, h))
        return reused

    def _partly_equal(self, token_ids: Sequence[int], start: int, parent: int | None
                      ) -> tuple[int, int]:
        """(block, n): a cached block following `parent` whose first n tokens equal
        token_ids[start:], n as large as such blocks give (at most the tokens before the last
        one; the most recently cached blocks are looked at first); n = 0 if none."""
        want = token_ids[start:len(token_ids) - 1]
        if not self.partial_reuse or not want:
            return -1, 0
        best, best_n = -1, 0
        candidates = self._children.get((parent, want[0]), {})
        for block_id in itertools.islice(reversed(candidates), _MAX_CANDIDATES):
            tokens = self.blocks[block_id].tokens
            n = 1
            while n < len(want) and n < len(tokens) and tokens[n] == want[n]:
                n += 1
            if n > best_n:
                best, best_n = block_id, n
        return best, best_n

    def _take_reused(self, block_id: int) -> int:
        """Share a block that holds the wanted K/V (in use by others, or free but cached)."""
        self._free.pop(block_id, None)
        self.blocks[block_id].ref_count += 1
        return block_id

    def _take_fresh(self) -> int:
        """The least recently used free block, for new K/V: its old prefix hash is forgotten."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.prefix_hash is not None:
            del self._by_hash[block.prefix_hash]
        if block.tokens:
            key = (block.parent_hash, block.tokens[0])
            del self._children[key][block_id]
            if not self._children[key]:
                del self._children[key]
        block.prefix_hash, block.parent_hash, block.tokens = None, None, ()
        block.ref_count = 1
        return block_id
