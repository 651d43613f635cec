"""The byte-level demo tokenizer, special tokens, chat template and eos ids."""

from __future__ import annotations

import json

import pytest

from services.engine.model.demo import write_byte_tokenizer
from services.engine.model.tokenizer import ChatTemplateError, Tokenizer


@pytest.fixture
def tok(tmp_path):
    write_byte_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [258, 256]}))
    return Tokenizer(tmp_path)


def test_bytes_round_trip(tok):
    text = "Hello, wörld! 専門家 🙂\n  tabs\tand spaces"
    ids = tok.encode(text)
    assert ids[:5] == list(b"Hello")
    assert ids == list(text.encode())
    assert tok.decode(ids) == text


def test_special_tokens_in_text_map_to_their_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids == [257, *b"user\nhi", 258]
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("no bos here")[0] == ord("n")


def test_chat_template_and_eos(tok):
    text = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=False
    ).endswith("assistant\n")
    assert tok.eos_token_ids == {256, 258}
    assert tok.vocab_size == 259


def test_template_is_sandboxed_and_errors_are_named(tmp_path):
    write_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ raise_exception('roles must alternate') }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        Tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}])
    cfg["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError):
        Tokenizer(tmp_path).apply_chat_template([])
    cfg.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tmp_path).apply_chat_template([])
