"""The engine's weight dtype (`--dtype auto|bf16|fp32`).

auto serves a checkpoint in the dtype it is stored in: bf16 for bf16 weights (and for GGUF
files, whose 16-bit and quantized tensors Strata widens to bf16 at most), fp32 for fp32 ones.
fp16 weights are served as fp32 (exact; bf16 would drop three mantissa bits). fp32 stays for
the reference path: the transformers equivalence tests run with it.

The dtype says what the weights are held in — non-expert matrices, the host store, every
cache slot — so it sets the slot size and the coverage per GiB. What the activations and the
KV cache hold is the backend's choice (kernels/backend.py): fp32 on the CPU kernels, which
widen bf16 weights inside their fp32 products; the weight dtype elsewhere.
"""

from __future__ import annotations

import torch

DTYPES = ("auto", "bf16", "fp32")
_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32}
_STORED = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float32,
           "F64": torch.float32}
_PROBE = "model.embed_tokens.weight"  # every family has it; its dtype is the checkpoint's


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float32: "fp32"}.get(dtype, str(dtype))


def resolve_dtype(setting: str | torch.dtype, reader) -> torch.dtype:
    """The weight dtype for `setting` (a DTYPES name or a torch dtype) and a checkpoint reader
    (model/checkpoint.py or model/gguf_reader.py)."""
    if isinstance(setting, torch.dtype):
        if setting not in _TORCH.values():
            raise ValueError(f"dtype {setting} is not served (choose from {', '.join(DTYPES)})")
        return setting
    if setting not in DTYPES:
        raise ValueError(f"unknown dtype {setting!r} (choose from {', '.join(DTYPES)})")
    if setting != "auto":
        return _TORCH[setting]
    stored = reader.stored_dtype(_PROBE)
    return _STORED.get(stored, torch.bfloat16)  # GGUF quantized types: bf16
