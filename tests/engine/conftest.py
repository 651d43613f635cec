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


def templated_model_dir(path: Path, template: str) -> Path:
    """The shipped default model with another chat template (another tool-call syntax)."""
    import shutil

    from services.models import default_model_dir

    shutil.copytree(default_model_dir(), path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def glm45_model_dir(path: Path) -> Path:
    return templated_model_dir(path, GLM45_TEMPLATE)


# Qwen3-Coder's / Qwen3.5's tool rendering (their published templates' calls, compacted):
# <function=NAME> with one <parameter=K> block per argument, iterated as an object
QWEN3_XML_TEMPLATE = (
    "{%- if tools -%}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\n<tool_call>\n<function=example_function_name>\n"
    "<parameter=example_parameter_1>\nvalue_1\n</parameter>\n</function>\n</tool_call>"
    "<|im_end|>\n{%- endif -%}{%- for message in messages -%}{%- if message.role == 'assistant'"
    " and message.tool_calls -%}<|im_start|>assistant\n{%- for tool_call in message.tool_calls"
    " -%}{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}"
    "{%- endif -%}{{- '<tool_call>\n<function=' + tool_call.name + '>\n' -}}"
    "{%- for args_name, args_value in tool_call.arguments|items -%}"
    "{{- '<parameter=' + args_name + '>\n' -}}{%- set args_value = args_value | tojson | safe "
    "if args_value is mapping or (args_value is sequence and args_value is not string) else "
    "args_value | string -%}{{- args_value -}}{{- '\n</parameter>\n' -}}{%- endfor -%}"
    "{{- '</function>\n</tool_call>' -}}{%- endfor -%}<|im_end|>\n"
    "{%- elif message.role == 'tool' -%}<|im_start|>user\n<tool_response>\n{{ message.content }}"
    "\n</tool_response><|im_end|>\n{%- else -%}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


# MiniMax-M2's tool rendering (its published template's calls, compacted): one
# <minimax:tool_call> block holding an <invoke name=...> per call, arguments iterated
MINIMAX_TEMPLATE = (
    "{%- if tools -%}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\n<|im_end|>\n{%- endif -%}{%- for m in messages -%}"
    "{%- if m.role == 'assistant' and m.tool_calls -%}<|im_start|>assistant\n"
    "<minimax:tool_call>\n{%- for tc in m.tool_calls %}\n<invoke name=\"{{ tc.function.name }}\">"
    "\n{% for k, v in tc.function.arguments.items() %}<parameter name=\"{{ k }}\">"
    "{{ v | tojson if v is not string else v }}</parameter>\n{% endfor %}</invoke>"
    "{%- endfor %}\n</minimax:tool_call><|im_end|>\n{%- elif m.role == 'tool' -%}"
    "<|im_start|>user\n<response>{{ m.content }}</response><|im_end|>\n{%- else -%}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")


def _ds_template(call: str) -> str:
    """DeepSeek's tool rendering (its templates' tools section, calls and outputs), with one
    call's body spelled as the version writes it."""
    return (
        "{%- if tools -%}## Tools\n{% for t in tools %}### {{ t.function.name }}\n"
        "{{ (t.function.parameters or {}) | tojson }}\n{% endfor %}{%- endif -%}"
        "{%- for m in messages -%}{%- if m.role == 'user' -%}<｜User｜>{{ m.content }}"
        "{%- elif m.role == 'assistant' and m.tool_calls -%}<｜Assistant｜><｜tool▁calls▁begin｜>"
        "{%- for tc in m.tool_calls -%}<｜tool▁call▁begin｜>" + call + "<｜tool▁call▁end｜>"
        "{%- endfor -%}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>{%- elif m.role == 'assistant' -%}"
        "<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>{%- elif m.role == 'tool' -%}"
        "<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{%- endif -%}{%- endfor -%}"
        "{%- if add_generation_prompt -%}<｜Assistant｜>{%- endif -%}")


DS_V3_TEMPLATE = _ds_template(  # V3-0324 / R1-0528: the type, the name, a ```json fence
    "{{ tc.type }}<｜tool▁sep｜>{{ tc.function.name }}\n```json\n{{ tc.function.arguments }}"
    "\n```")
DS_V31_TEMPLATE = _ds_template(  # V3.1: the name, then the arguments
    "{{ tc.function.name }}<｜tool▁sep｜>{{ tc.function.arguments }}")


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


def special_tokens_model_dir(path: Path, family: str, specials: tuple[str, ...],
                             template: str, stops: tuple[str, ...]) -> Path:
    """A tiny random checkpoint of `family` whose byte tokenizer also has `specials` as special
    tokens (ids from 259, inside its 300-row vocabulary), with `template` and `stops`."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from tests.engine.test_model_families import make_family_checkpoint

    path, _ = make_family_checkpoint(path, family, seed=6, max_position_embeddings=1024)
    tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.update(chat_template=template, eos_token=stops[0])
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [tok.token_to_id(t) for t in stops]}))
    return path


def harmony_model_dir(path: Path) -> Path:
    """A tiny random gpt-oss checkpoint with harmony's special tokens, template and stops."""
    return special_tokens_model_dir(path, "gpt_oss", HARMONY_SPECIALS, HARMONY_TEMPLATE,
                                    ("<|return|>", "<|call|>"))


KIMI_SPECIALS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
                 "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
                 "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
# Kimi-K2's tool rendering, compacted: tools declared as JSON, a call's id functions.NAME:I
KIMI_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- endif -%}{%- for m in messages -%}{%- if m.role == 'user' -%}<|im_user|>user"
    "<|im_middle|>{{ m.content }}<|im_end|>{%- elif m.role == 'assistant' -%}<|im_assistant|>"
    "assistant<|im_middle|>{{ m.content or '' }}{%- if m.tool_calls -%}"
    "<|tool_calls_section_begin|>{%- for tc in m.tool_calls -%}<|tool_call_begin|>{{ tc.id }}"
    "<|tool_call_argument_begin|>{{ tc.function.arguments }}<|tool_call_end|>{%- endfor -%}"
    "<|tool_calls_section_end|>{%- endif -%}<|im_end|>{%- elif m.role == 'tool' -%}"
    "<|im_system|>tool<|im_middle|>## Return of {{ m.tool_call_id }}\n{{ m.content }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}{%- if add_generation_prompt -%}<|im_assistant|>assistant"
    "<|im_middle|>{%- endif -%}")


def kimi_model_dir(path: Path) -> Path:
    """A tiny random DeepSeek-V3-architecture checkpoint (Kimi-K2's) with Kimi's tool tokens,
    template and stop."""
    return special_tokens_model_dir(path, "deepseek_v3", KIMI_SPECIALS, KIMI_TEMPLATE,
                                    ("<|im_end|>",))
