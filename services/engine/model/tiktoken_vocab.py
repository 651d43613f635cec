"""A tiktoken vocabulary (`tiktoken.model`, Kimi-K2's) as a `tokenizers` byte-level BPE.

Kimi-K2 ships no tokenizer.json: `tiktoken.model` holds one `base64(token bytes) rank` line per
token, and `tokenization_kimi.py` (remote code, never run here) splits text with its own
pattern and appends 256 special tokens after the ranks (`added_tokens_decoder` names some, the
rest are `<|reserved_token_N|>`). Byte-pair encoding by ranks is byte-level BPE whose merges are
in rank order, so the vocabulary converts into the tokenizer every other checkpoint uses here:

    vocab   token bytes in GPT-2's byte-to-unicode alphabet -> rank (ids = ranks)
    merges  each multi-byte token's last merge: its bytes re-merged by the lower ranks
    split   Kimi's pattern (Oniguruma, as tokenizers compiles it, takes its `&&` intersections)

`tests/engine/test_model_tokenizer.py` checks the result token for token against tiktoken's own
Encoding over the same ranks and pattern.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from services.engine.model.config import CheckpointError

log = logging.getLogger("strata.engine")

TIKTOKEN_FILE = "tiktoken.model"
RESERVED_SPECIAL = 256  # special ids after the ranks (tokenization_kimi.py's count)
KIMI_PATTERN = "|".join([  # tokenization_kimi.py's pat_str
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken.model: token bytes -> rank, ranks 0..N-1 (CheckpointError naming the line
    otherwise)."""
    ranks: dict[bytes, int] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise CheckpointError(f"{path}:{number} is not `base64 rank`: {e}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise CheckpointError(f"{path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


def _last_merge(ranks: dict[bytes, int], token: bytes) -> tuple[bytes, bytes]:
    """The two parts `token` is merged from: its bytes merged pair by pair, lowest rank first,
    with ranks below its own (tiktoken's byte-pair encoding), until two parts are left."""
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best:
                best, at = rank, i
        if at < 0:
            raise CheckpointError(f"token {token!r} (rank {limit}) cannot be merged from "
                                  "lower ranks: not a byte-pair vocabulary")
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    return parts[0], parts[1]


def tiktoken_tokenizer(model_dir: Path, config: dict[str, Any]) -> HFTokenizer:
    """The checkpoint's tiktoken.model as a tokenizers BPE (config: tokenizer_config.json).
    Only Kimi's tokenizer class is known (its split pattern lives in its remote code)."""
    remote = json.dumps(config.get("auto_map", {}))
    if "tokenization_kimi" not in remote:
        raise CheckpointError(
            f"{model_dir} has {TIKTOKEN_FILE} but no tokenizer.json, and its tokenizer "
            f"({remote if remote != '{}' else config.get('tokenizer_class')}) is not Kimi's, "
            "whose split pattern Strata knows; convert it to tokenizer.json first")
    t0 = time.perf_counter()
    from services.engine.model.tokenizer import _byte_to_unicode

    ranks = read_ranks(model_dir / TIKTOKEN_FILE)
    alphabet = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(a), text(b)) for token, _ in sorted(ranks.items(), key=lambda kv: kv[1])
              if len(token) > 1 for a, b in [_last_merge(ranks, token)]]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    named = {int(i): t["content"] for i, t in config.get("added_tokens_decoder", {}).items()}
    base = len(ranks)
    tok.add_special_tokens([
        AddedToken(named.get(i, f"<|reserved_token_{i}|>"), special=True, normalized=False)
        for i in range(base, base + RESERVED_SPECIAL)])
    log.info("tokenizer: %s of %d ranks + %d special tokens read as byte-level BPE in %.1f s",
             TIKTOKEN_FILE, base, RESERVED_SPECIAL, time.perf_counter() - t0)
    return tok
