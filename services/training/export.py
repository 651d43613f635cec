"""Write the trained model as a Hugging Face `qwen3_moe` checkpoint directory.

config.json              qwen3_moe config (both num_experts and num_local_experts)
model.safetensors        bf16 (or fp16) weights, per-expert keys
                         model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight
tokenizer.json           byte-level BPE
tokenizer_config.json    ChatML chat template, eos <|im_end|>
generation_config.json   eos [<|im_end|>, <|endoftext|>], greedy
README.md                model card (recipe, held-out loss, routing statistics)
training_summary.json    the same numbers, machine-readable
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from services.training.bpe import write_tokenizer_files
from services.training.card import model_card
from services.training.config import ENDOFTEXT_ID, IM_END_ID, TrainConfig, hf_config
from services.training.moe import MoETransformer

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_state_dict(model: MoETransformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, stacked experts split per expert."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".mlp.experts"):  # stacked [E, ...] -> one key per expert
            for e, w in enumerate(tensor):
                out[f"{prefix}.{e}.{leaf}.weight"] = w
        else:
            out[name] = tensor
    return {k: v.detach().to(dtype).contiguous() for k, v in sorted(out.items())}


def write_checkpoint(
    path: Path,
    model: MoETransformer,
    cfg: TrainConfig,
    tok: Tokenizer,
    summary: dict[str, Any],
) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = hf_config(cfg, model.vocab_size)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    weights = hf_state_dict(model, DTYPES[cfg.dtype])
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(tok, path, context_window=cfg.context)
    generation = {
        "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
        "pad_token_id": ENDOFTEXT_ID,
        "do_sample": False,
    }
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    summary["checkpoint_bytes"] = (path / "model.safetensors").stat().st_size
    (path / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (path / "README.md").write_text(model_card(summary))
    return path
