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


NAMED_USERS = (  # names shown on user and tool messages only; a system message is refused
    "{%- for m in messages -%}{%- if m.role == 'system' -%}"
    "{{ raise_exception('System role not supported') }}{%- endif -%}"
    "<|im_start|>{{ m.role }}{% if m.name and m.role in ('user', 'tool') %} ({{ m.name }})"
    "{% endif %}\n{{ m.content }}<|im_end|>\n{%- endfor -%}<|im_start|>assistant\n")


def test_named_roles_are_those_whose_names_the_template_shows(tok, tmp_path):
    assert tok.named_roles == frozenset()  # ChatML drops names
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = NAMED_USERS
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    named = Tokenizer(tmp_path)
    assert named.named_roles == {"user", "tool"}
    assert named.apply_chat_template([{"role": "user", "content": "hi", "name": "ada"}]
                                     ).startswith("<|im_start|>user (ada)")


# -- a tiktoken.model vocabulary (Kimi-K2 ships no tokenizer.json) ----------------------------
KIMI_TEXTS = [
    "The expert cache holds 1234567 pairs; don't you'll WE'VE HTTPServer.",
    "def f(x):\n    return x + 1  # ünïcode\n\n\n\t  tabs and   runs",
    "混合专家模型的缓存命中率 and 日本語のテキスト, 한국어 텍스트",
    "emoji 🤖🚀 and punctuation!!! ... ??? \"quoted\" (parens) [brackets]",
    "<|im_end|>special tokens<|im_user|> in text[EOS]",
]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    """Kimi-K2's tokenizer files over a small vocabulary: tiktoken.model ranked from the shipped
    model's byte-level merges (the 256 bytes, then each merge's token in order) and a
    tokenizer_config.json naming some of the 256 special ids after the ranks."""
    import base64
    from pathlib import Path

    from services.engine.model.tokenizer import _byte_to_unicode

    source = Path(__file__).parents[2] / "services/models/strata-stdlib-moe/tokenizer.json"
    to_byte = {ch: b for b, ch in _byte_to_unicode().items()}
    ranks = {bytes([b]): b for b in range(256)}
    for a, b in json.loads(source.read_text())["model"]["merges"]:
        ranks.setdefault(bytes(to_byte[c] for c in a + b), len(ranks))
    path = tmp_path_factory.mktemp("kimi")
    (path / "tiktoken.model").write_text("".join(
        f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    named = {n: "[BOS]", n + 1: "[EOS]", n + 3: "<|im_user|>", n + 4: "<|im_end|>"}
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "[EOS]",
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "added_tokens_decoder": {str(i): {"content": t, "special": True}
                                 for i, t in named.items()}}))
    return path, ranks, named


def test_a_tiktoken_vocabulary_encodes_as_tiktoken_does(kimi_dir):
    """Kimi's tiktoken.model read as byte-level BPE gives tiktoken's own ids (same ranks, same
    split pattern, its specials) for English, code, CJK, emoji and special tokens; decoding
    and token bytes round-trip; EOS is the named special."""
    tiktoken = pytest.importorskip("tiktoken")
    from services.engine.model.tiktoken_vocab import KIMI_PATTERN, RESERVED_SPECIAL

    path, ranks, named = kimi_dir
    tok = Tokenizer(path)
    n = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + RESERVED_SPECIAL)}
    ref = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens=specials)
    assert tok.vocab_size == n + RESERVED_SPECIAL
    for text in KIMI_TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert b"".join(tok.token_bytes(i) for i in ids if i < n) == b"".join(
            ref.decode_single_token_bytes(i) for i in ids if i < n)
    assert tok.eos_token_ids == {n + 1}
    assert tok.token_to_id(f"<|reserved_token_{n + 2}|>") == n + 2  # unnamed: reserved


def test_a_tiktoken_vocabulary_of_another_tokenizer_is_refused_by_name(kimi_dir, tmp_path):
    import shutil

    from services.engine.model.config import CheckpointError

    path, _, _ = kimi_dir
    shutil.copy(path / "tiktoken.model", tmp_path / "tiktoken.model")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "SomeTikTokenizer"}))
    with pytest.raises(CheckpointError, match="SomeTikTokenizer.*is not Kimi's"):
        Tokenizer(tmp_path)
