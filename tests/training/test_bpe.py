"""The byte-level BPE tokenizer: special token ids, exact round trips, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from services.training.bpe import encode_corpus, train_bpe
from services.training.config import ENDOFTEXT_ID, IM_END_ID
from services.training.corpus import iter_texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return list(iter_texts("train", max_bytes=60_000))


def test_special_tokens_come_first(texts):
    tok = train_bpe(texts, 320)
    assert tok.get_vocab_size() == 320
    assert tok.token_to_id("<|endoftext|>") == ENDOFTEXT_ID == 0
    assert tok.token_to_id("<|im_start|>") == 1
    assert tok.token_to_id("<|im_end|>") == IM_END_ID == 2


@pytest.mark.parametrize(
    "text",
    [
        "def f(x):\n    return x + 1\n",
        "\t\tmixed  whitespace \r\n\n\n  trailing   ",
        "unicode: café, 日本語, emoji \U0001f600, nul \x00 and \x7f",
        "",
    ],
)
def test_round_trip(texts, text):
    tok = train_bpe(texts, 320)
    assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_round_trips_corpus_text_and_merges_help(texts):
    tok = train_bpe(texts, 400)
    sample = texts[0][:5000]
    ids = tok.encode(sample).ids
    assert tok.decode(ids) == sample
    assert len(ids) < 0.6 * len(sample.encode())  # merges compress code


def test_training_is_deterministic(texts):
    assert train_bpe(texts, 350).to_str() == train_bpe(texts, 350).to_str()


def test_special_tokens_in_text_map_to_their_ids(texts):
    tok = train_bpe(texts, 320)
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == IM_END_ID


def test_encode_corpus_separates_documents(texts):
    tok = train_bpe(texts, 320)
    ids = encode_corpus(tok, ["a = 1\n", "b = 2\n"])
    assert ids.dtype == np.uint16
    assert list(ids).count(ENDOFTEXT_ID) == 2 and ids[-1] == ENDOFTEXT_ID
    first = list(ids[: list(ids).index(ENDOFTEXT_ID)])
    assert tok.decode(first) == "a = 1\n"
