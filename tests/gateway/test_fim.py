"""Fill in the middle: /v1/completions' `suffix`, written with the model's FIM tokens by the
engine, against the same prompt written by hand; refused by name where the vocabulary has
none."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
from tokenizers import AddedToken, Tokenizer

from .conftest import real_engine

FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


@pytest.fixture(scope="module")
def fim_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with Qwen's FIM tokens in its vocabulary (as every Qwen2.5/Qwen3
    tokenizer has them)."""
    path = tmp_path_factory.mktemp("ckpt") / "fim"
    shutil.copytree(tiny_checkpoint, path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in FIM])
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    assert tokenizer.get_vocab_size() <= vocab
    tokenizer.save(str(path / "tokenizer.json"))
    return path


async def test_a_suffix_is_the_prompt_written_with_the_fim_tokens(make_gateway, fim_checkpoint):
    prefix, suffix = "def area(r):\n    return ", "\n\nprint(area(2))\n"
    async with real_engine(fim_checkpoint, "engine-fim") as (address, engine, model):
        base = await make_gateway(engine_addrs=(address,))
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                      max_retries=0) as client:
            kw = {"model": model, "max_tokens": 8, "temperature": 0}
            filled = await client.completions.create(prompt=prefix, suffix=suffix, **kw)
            by_hand = await client.completions.create(
                prompt=f"{FIM[0]}{prefix}{FIM[1]}{suffix}{FIM[2]}", **kw)
            for body, param in (({"prompt": [1, 2], "suffix": "x"}, "suffix"),
                                ({"prompt": "a", "suffix": "x", "echo": True}, "suffix"),
                                ({"prompt": "a", "suffix": 3}, "suffix")):
                with pytest.raises(openai.BadRequestError) as refused:
                    await client.completions.create(**{**kw, **body})
                assert refused.value.body["param"] == param
    assert filled.choices[0].text == by_hand.choices[0].text
    assert filled.usage.prompt_tokens == by_hand.usage.prompt_tokens == len(
        engine.runner.tokenizer.encode(f"{FIM[0]}{prefix}{FIM[1]}{suffix}{FIM[2]}"))


async def test_a_model_without_fim_tokens_refuses_a_suffix(make_gateway, tiny_checkpoint):
    async with real_engine(tiny_checkpoint, "engine-no-fim") as (address, _, model):
        base = await make_gateway(engine_addrs=(address,))
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused",
                                      max_retries=0) as client:
            plain = await client.completions.create(model=model, prompt="a", suffix="",
                                                    max_tokens=2)  # no suffix: none asked for
            with pytest.raises(openai.BadRequestError) as refused:
                await client.completions.create(model=model, prompt="a", suffix="b",
                                                max_tokens=2)
    assert plain.choices[0].text is not None
    assert (refused.value.body["param"], refused.value.body["code"]) == (
        "suffix", "unsupported_parameter")
    assert "fill-in-the-middle" in refused.value.body["message"]
