"""Byte-level BPE trained with the `tokenizers` library, and corpus -> token ids.

The special tokens come first (ids 0, 1, 2 = <|endoftext|>, <|im_start|>, <|im_end|>), then the
256 byte symbols, then merges. No normalizer and a byte-level pre-tokenizer/decoder, so
decode(encode(text)) == text for any string. Training is deterministic given the texts and their
order. Documents are joined with <|endoftext|> in the id stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from services.engine.model.demo import CHATML_TEMPLATE, SPECIAL_TOKENS
from services.training.config import ENDOFTEXT_ID, SPECIAL_IDS

ENCODE_BATCH = 64  # files per encode_batch call (bounded memory, parallel inside tokenizers)


def train_bpe(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for token, want in SPECIAL_IDS.items():
        assert tok.token_to_id(token) == want, (token, tok.token_to_id(token))
    return tok


def encode_corpus(tok: Tokenizer, texts: Iterable[str]) -> np.ndarray:
    """All texts as one id stream [N] (uint16), each document followed by <|endoftext|>."""
    assert tok.get_vocab_size() <= 2**16, "ids must fit uint16"
    parts: list[np.ndarray] = []
    for batch in _batched(iter(texts), ENCODE_BATCH):
        for enc in tok.encode_batch(batch, add_special_tokens=False):
            parts.append(np.asarray([*enc.ids, ENDOFTEXT_ID], dtype=np.uint16))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)



def split_ids(
    split: str, tokenizer_json: Path, root: Path | None = None, max_bytes: int | None = None
) -> np.ndarray:
    """One corpus split's id stream [N] (int64) exactly as training builds it: its files in
    corpus order, encoded by a checkpoint's tokenizer.json, each followed by <|endoftext|>."""
    from services.training.corpus import iter_texts

    tok = Tokenizer.from_file(str(tokenizer_json))
    return encode_corpus(tok, iter_texts(split, root, max_bytes)).astype(np.int64)

def _batched(it: Iterator[str], n: int) -> Iterator[list[str]]:
    while batch := list(islice(it, n)):
        yield batch


def write_tokenizer_files(tok: Tokenizer, path: Path, context_window: int) -> None:
    """tokenizer.json + tokenizer_config.json (ChatML template, eos <|im_end|>)."""
    tok.save(str(Path(path) / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHATML_TEMPLATE,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": context_window,
        "add_prefix_space": False,
    }
    (Path(path) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
