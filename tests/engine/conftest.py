"""Fixtures for the engine's model/cache/runner tests: tiny random qwen3_moe checkpoints written
by transformers (the reference) or by Strata's demo writer, all on the CPU."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from services.engine.model.demo import write_byte_tokenizer, write_demo_checkpoint

TOKENIZER_VOCAB = 259  # 256 bytes + 3 special tokens (the demo byte-level tokenizer)

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


def fixed_bytes(model_dir: Path, **kwargs) -> int:
    """What the budget rule subtracts before the cache for this checkpoint and settings: its
    non-expert weights and KV pool (read off a runner without a cache)."""
    return _fixed_bytes(Path(model_dir), tuple(sorted(kwargs.items())))


@functools.cache
def _fixed_bytes(model_dir: Path, kwargs: tuple) -> int:
    from services.engine.runner import ModelRunner

    size = ModelRunner(model_dir, cache_slots=0, reserved_bytes=0, **dict(kwargs)).cache_size
    return size.weight_bytes + size.kv_bytes


def make_hf_checkpoint(
    path: Path, seed: int = 0, max_shard_size: str | None = None, **overrides
) -> tuple[Path, torch.nn.Module]:
    """save_pretrained() a seeded random Qwen3MoeForCausalLM plus the byte tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**{**TINY, **overrides})
    model = Qwen3MoeForCausalLM(config).eval()
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    write_byte_tokenizer(path, context_window=config.max_position_embeddings)
    return path, model


@pytest.fixture
def hf_checkpoint(tmp_path):
    """Factory: hf_checkpoint(name, **config_overrides) -> (dir, reference model)."""

    def make(name: str = "tiny-moe", **kwargs):
        return make_hf_checkpoint(tmp_path / name, **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A small demo-writer checkpoint shared by cache/runner tests: 3 layers x 8 experts."""
    return write_demo_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "tiny-demo",
        seed=1,
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        vocab_size=320,
    )


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "strata-demo-moe")


@pytest.fixture(scope="session")
def tiny_bf16_dir(tiny_dir, tmp_path_factory) -> Path:
    """tiny_dir's weights stored in bf16 (served in bf16 under --dtype auto)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("ckpt") / "tiny-demo-bf16"
    shutil.copytree(tiny_dir, out)
    weights = {k: v.to(torch.bfloat16) for k, v in load_file(out / "model.safetensors").items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


NO_COMPILER = "no C compiler here ($CC, cc, gcc, clang): the CPU kernels cannot be built"


@pytest.fixture(scope="session")
def cpu():
    """The C kernels (services/engine/kernels), built once. Skipped only where there is no C
    compiler: with one, a build that fails fails the test."""
    from services.engine import kernels

    if kernels.find_compiler() is None:
        pytest.skip(NO_COMPILER)
    return kernels.CpuKernels(kernels.build())


# GLM-4.5's tool rendering (its published chat template's tools section, calls and results;
# the reasoning parts left out): calls as <tool_call>NAME + <arg_key>/<arg_value> lines, the
# history's arguments iterated as an object
GLM45_TEMPLATE = (
    "[gMASK]<sop>{%- if tools -%}<|system|>\n# Tools\n\nYou may call one or more functions to "
    "assist with the user query.\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>\n{% for tool in tools %}{{ tool | tojson("
    "ensure_ascii=False) }}\n{% endfor %}</tools>\n\nFor each function call, output the function "
    "name and arguments within the following XML format:\n<tool_call>{function-name}\n"
    "<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>"
    "{%- endif -%}\n{%- for m in messages %}{%- if m.role == 'user' -%}<|user|>\n"
    "{{ m.content }}{%- elif m.role == 'assistant' -%}\n<|assistant|>\n{{ m.content }}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}{%- if tc.function %}"
    "{%- set tc = tc.function %}{%- endif %}{{ '\\n<tool_call>' + tc.name }}\n"
    "{% set _args = tc.arguments %}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key>\n"
    "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>\n"
    "{% endfor %}</tool_call>{% endfor %}{% endif %}{%- elif m.role == 'tool' -%}"
    "<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>{%- endif -%}"
    "{%- endfor -%}{%- if add_generation_prompt -%}<|assistant|>\n{%- endif -%}")


def glm45_model_dir(path: Path) -> Path:
    """The shipped default model with GLM-4.5's tool-call template in place of its own."""
    import shutil

    from services.models import default_model_dir

    shutil.copytree(default_model_dir(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = GLM45_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


HARMONY_SPECIALS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>",
                    "<|call|>", "<|constrain|>")
# gpt-oss's harmony rendering, compacted (its published template also writes a system message
# with the date and reasoning effort): tools as a developer message's TypeScript namespace,
# history calls as commentary messages to functions.NAME, results as messages from them
HARMONY_TEMPLATE = (
    "{%- if tools -%}<|start|>developer<|message|># Tools\n\n## functions\n\nnamespace "
    "functions {\n{% for t in tools %}type {{ t.function.name }} = (_: {{ (t.function.parameters "
    "or {}) | tojson }}) => any;\n{% endfor %}} // namespace functions<|end|>{%- endif -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}"
    "<|end|>{%- elif m.role == 'assistant' and m.tool_calls -%}{%- for tc in m.tool_calls -%}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ tc.function.name }} <|constrain|>"
    "json<|message|>{{ tc.function.arguments }}<|call|>{%- endfor -%}"
    "{%- elif m.role == 'assistant' -%}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{%- elif m.role == 'tool' -%}<|start|>functions to=assistant"
    "<|channel|>commentary<|message|>{{ m.content }}<|end|>{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}")


def harmony_model_dir(path: Path) -> Path:
    """A tiny random gpt-oss checkpoint whose byte tokenizer has harmony's special tokens
    (ids 259-265, inside its 300-row vocabulary), its chat template and stop tokens."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from tests.engine.test_model_families import make_family_checkpoint

    path, _ = make_family_checkpoint(path, "gpt_oss", seed=6, max_position_embeddings=1024)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in HARMONY_SPECIALS])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(chat_template=HARMONY_TEMPLATE, eos_token="<|return|>")
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    stops = [tok.token_to_id("<|return|>"), tok.token_to_id("<|call|>")]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return path
