"""Paged KV cache: one preallocated pool of fixed-size blocks per layer, shared by all sequences.

Shape legend: B blocks in the pool, P positions per block, G KV heads, Hd head dim,
T tokens written in this step, N positions of one sequence.

Which block holds which positions is decided by `services.engine.block_manager` (no tensors);
here a sequence is a list of block ids and a length. Position p of a sequence lives in block
`table[p // P]` at offset `p % P`.

`kv_dtype=int8` stores K and V as int8 with one scale per (block, KV head) — absmax / 127. When new
tokens raise a block's absmax the block's earlier entries are requantized to the new scale, so
every entry of a block shares one scale and reads are a single multiply.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from services.engine.model.config import ModelConfig
    from services.engine.model.step import Span


class KVOwner(Protocol):
    @property
    def holds_kv(self) -> bool:
        """Whether any of the pool's blocks are handed out (or may be at any moment)."""
        ...


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, kv_dtype: str = "auto",
                 shared: bool = False):
        """shared: K and V are one tensor (MLA's latent): write() stores k, and reads give it
        as both."""
        assert kv_dtype in {"auto", "int8"}
        self.num_blocks, self.block_size, self.shared = num_blocks, block_size, shared
        self.owner: KVOwner | None = None  # whose block manager hands out the blocks
        self.quantized = kv_dtype == "int8"
        self.dtype = dtype
        storage = torch.int8 if self.quantized else dtype
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)  # [L, B, P, G, Hd]
        # Zeroed: batched decode attention reads whole blocks and masks the positions a
        # sequence does not have; masked entries must be finite (0 * NaN would be NaN).
        self.k = torch.zeros(shape, dtype=storage, device=device)
        self.v = self.k if shared else torch.zeros(shape, dtype=storage, device=device)
        if self.quantized:
            self.k_scale = torch.zeros(num_layers, num_blocks, num_kv_heads, device=device)
            self.v_scale = (self.k_scale if shared else
                            torch.zeros(num_layers, num_blocks, num_kv_heads, device=device))

    def claim(self, owner: KVOwner | None) -> None:
        """Make `owner` (an engine, a SequenceDriver, a draft model) the one whose block
        manager hands out this pool's blocks, taking it over from an owner that holds none;
        None hands the pool back. Two block managers handing out blocks of one pool at once
        would give the same block to two sequences."""
        held = self.owner
        if owner is not None and held is not None and held is not owner and held.holds_kv:
            raise RuntimeError(f"this KV pool is in use by {held!r}: stop that engine or "
                               "release that driver's sequences first")
        self.owner = owner

    def _tensors(self) -> list[torch.Tensor]:
        """The pool's tensors, each once: K, V (one tensor when shared) and (int8) scales."""
        tensors = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])
        return list({id(t): t for t in tensors}.values())

    @property
    def nbytes(self) -> int:
        """Bytes of the pool on its device: K, V and (int8) their scales."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype, kv_dtype: str = "auto", shared: bool = False) -> int:
        element = 1 if kv_dtype == "int8" else torch.empty((), dtype=dtype).element_size()
        copies = 1 if shared else 2  # K and V, or the one tensor of both
        scales = copies * num_layers * num_kv_heads * 4 if kv_dtype == "int8" else 0
        return copies * num_layers * block_size * num_kv_heads * head_dim * element + scales

    @classmethod
    def for_model(cls, c: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device, kv_dtype: str = "auto") -> PagedKVCache:
        """The pool a model's layers attend over (MLA: its latent, one shared K/V tensor; the
        layers with K/V only: config.kv_layers)."""
        return cls(len(c.kv_layers), num_blocks, block_size, c.kv_heads, c.kv_head_dim, dtype,
                   device, kv_dtype, c.kv_shared)

    @staticmethod
    def model_bytes_per_block(c: ModelConfig, block_size: int, dtype: torch.dtype,
                              kv_dtype: str = "auto") -> int:
        """bytes_per_block of for_model's pool."""
        return PagedKVCache.bytes_per_block(len(c.kv_layers), block_size, c.kv_heads,
                                            c.kv_head_dim, dtype, kv_dtype, c.kv_shared)

    def slots(self, table: Sequence[int], positions: torch.Tensor) -> torch.Tensor:
        """Flat pool indices (block * P + offset) of positions [T] of one sequence."""
        blocks = torch.as_tensor(table, device=positions.device)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def span_slots(self, spans: Sequence[Span]) -> torch.Tensor:
        """Flat pool indices [T] (on the host) of every span's positions, in row order: what
        slots() gives each span, in plain integers (a decode step's spans are one row each,
        and small tensor ops per span cost more than the arithmetic)."""
        P = self.block_size
        return torch.from_numpy(np.array([s.block_table[p // P] * P + p % P for s in spans
                                          for p in range(s.pos_start, s.pos_end)],
                                         dtype=np.int64))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Block dst becomes a copy of block src, in every layer (K, V and int8 scales), for
        each (src, dst): a prompt taking over a cached block's leading positions."""
        for t in self._tensors():  # a block at a time: a strided copy, no index kernels
            for src, dst in pairs:
                t[:, dst].copy_(t[:, src])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, G, Hd] at flat slots [T]."""
        if not self.quantized:
            self.k[layer].view(-1, *k.shape[1:])[slots] = k.to(self.dtype)
            if not self.shared:
                self.v[layer].view(-1, *v.shape[1:])[slots] = v.to(self.dtype)
            return
        self._write_int8(self.k[layer], self.k_scale[layer], slots, k)
        if not self.shared:
            self._write_int8(self.v[layer], self.v_scale[layer], slots, v)

    def read(self, layer: int, table: Sequence[int], num_positions: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [G, N, Hd] of the first N positions of a sequence."""
        num_blocks = -(-num_positions // self.block_size)
        first = table[0]
        if not self.quantized and table[num_blocks - 1] - first == num_blocks - 1 and all(
                b == first + i for i, b in enumerate(table[:num_blocks])):
            # Consecutive blocks (the usual case for a sequence that grew alone): a view, no copy.
            k, v = self.k[layer, first:first + num_blocks], self.v[layer, first:first + num_blocks]
            k = k.flatten(0, 1)[:num_positions].transpose(0, 1)  # [G, N, Hd]
            v = v.flatten(0, 1)[:num_positions].transpose(0, 1)
            return k, v
        ids = torch.as_tensor(table[:num_blocks], device=self.k.device)
        k, v = self.k[layer][ids], self.v[layer][ids]  # [n, P, G, Hd]
        if self.quantized:
            k = k.to(self.dtype) * self.k_scale[layer][ids][:, None, :, None].to(self.dtype)
            v = v.to(self.dtype) * self.v_scale[layer][ids][:, None, :, None].to(self.dtype)
        k = k.flatten(0, 1)[:num_positions].transpose(0, 1)  # [G, N, Hd]
        v = v.flatten(0, 1)[:num_positions].transpose(0, 1)
        return k, v

    def block_ids(self, tables: Sequence[Sequence[int]], lengths: Sequence[int]) -> torch.Tensor:
        """Block ids [B, nb] holding the first lengths[i] positions of each sequence, padded
        with block 0 (for reading several sequences at once; the same for every layer)."""
        P = self.block_size
        nb = max(-(-n // P) for n in lengths)
        rows = []  # plain lists, one array at the end (a tensor copy a row costs ~5 us)
        for table, n in zip(tables, lengths, strict=True):
            used = -(-n // P)
            rows.append([*table[:used], *[0] * (nb - used)])
        ids = torch.from_numpy(np.array(rows, dtype=np.int64).reshape(len(rows), nb))
        return ids if self.k.device.type == "cpu" else ids.to(self.k.device)

    def gather_index(self, tables: Sequence[Sequence[int]], lengths: Sequence[int]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """block_ids and a mask [B, nb * P] of the positions each sequence really has."""
        ids = self.block_ids(tables, lengths)
        mask = (torch.arange(ids.shape[1] * self.block_size)[None, :]
                < torch.as_tensor(lengths)[:, None])
        return ids, mask.to(self.k.device)

    def read_batch(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, G, nb * P, Hd] of the blocks ids [B, nb] (see gather_index)."""
        k, v = self.k[layer][ids], self.v[layer][ids]  # [B, nb, P, G, Hd]
        if self.quantized:
            k = k.to(self.dtype) * self.k_scale[layer][ids][:, :, None, :, None].to(self.dtype)
            v = v.to(self.dtype) * self.v_scale[layer][ids][:, :, None, :, None].to(self.dtype)
        B, nb, P, G, Hd = k.shape
        k = k.reshape(B, nb * P, G, Hd).transpose(1, 2)  # [B, G, N, Hd]
        v = v.reshape(B, nb * P, G, Hd).transpose(1, 2)
        return k, v

    def _write_int8(self, pool: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor,
                    x: torch.Tensor) -> None:
        """pool [B, P, G, Hd] int8, scale [B, G]; x [T, G, Hd] written at slots [T]."""
        P = self.block_size
        blocks = slots // P  # [T]
        absmax = x.float().abs().amax(dim=-1)  # [T, G]
        # A block written at offset 0 starts over (it was handed out for new tokens): its old
        # scale belongs to K/V that is gone.
        scale[blocks[slots % P == 0]] = 0
        new_scale = scale.clone()
        new_scale.scatter_reduce_(0, blocks[:, None].expand_as(absmax), absmax / 127.0,
                                  reduce="amax")  # [B, G]
        grown = torch.unique(blocks[(new_scale[blocks] > scale[blocks]).any(dim=-1)])
        if grown.numel():  # requantize earlier entries of blocks whose scale grew
            old = pool[grown].float() * scale[grown][:, None, :, None]
            s = new_scale[grown].clamp_min(1e-12)[:, None, :, None]
            pool[grown] = torch.clamp(torch.round(old / s), -127, 127).to(torch.int8)
        scale.copy_(new_scale)
        s = scale[blocks].clamp_min(1e-12)[:, :, None]  # [T, G, 1]
        flat = pool.view(-1, *x.shape[1:])
        flat[slots] = torch.clamp(torch.round(x.float() / s), -127, 127).to(torch.int8)
