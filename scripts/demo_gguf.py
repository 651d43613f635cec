"""Write a demo checkpoint as a GGUF file llama.cpp and Strata both load, for side-by-side runs.

    python scripts/demo_gguf.py CHECKPOINT_DIR OUT.gguf [--type Q8_0] [--f32-experts]

Every 2-D tensor but the router takes --type (llama.cpp's choice; 1-D ones stay F32);
--f32-experts stores the expert stacks dequantized instead (the same values, as floats). The
tensors are written by the GGUF writer of tests/engine/test_gguf_import.py (llama.cpp's names,
written there by hand), one at a time: a checkpoint larger than memory streams through (the
largest tensor, an expert stack, is read and converted alone). The byte-level vocabulary is
padded to the embedding's rows, and one merge is added: llama.cpp's gpt2 vocabulary requires
merges.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize, quantize

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from services.engine.model.checkpoint import load_model_config  # noqa: E402
from tests.engine import test_gguf_import as writer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--type", default="Q8_0", help="GGUF type of the 2-D tensors (gguf-py must "
                   "quantize it: Q8_0, Q4_0, ...)")
    p.add_argument("--f32-experts", action="store_true")
    a = p.parse_args()
    qtype = gguf.GGMLQuantizationType[a.type]
    vocab = load_model_config(a.checkpoint).vocab_size
    add_list, add_types = gguf.GGUFWriter.add_token_list, gguf.GGUFWriter.add_token_types

    def token_list(self, tokens):
        n = len(tokens)
        add_list(self, [*tokens, "ĠĠ", *(f"<|pad_{i}|>" for i in range(n + 1, vocab))])

    def token_types(self, types):
        pad = [gguf.TokenType.UNUSED] * (vocab - len(types) - 1)
        add_types(self, [*types, gguf.TokenType.NORMAL, *pad])
        self.add_token_merges(["Ġ Ġ"])

    gguf.GGUFWriter.add_token_list, gguf.GGUFWriter.add_token_types = token_list, token_types
    F32 = gguf.GGMLQuantizationType.F32
    tensors = {}
    for name, (shape, load) in writer.source_loaders(a.checkpoint).items():
        keep = len(shape) == 1 or "ffn_gate_inp" in name  # llama.cpp's choice: F32
        if a.f32_experts and "_exps" in name:
            def load_f32(load=load):  # the stored type's values, widened
                return dequantize(quantize(load(), qtype), qtype)
            tensors[name] = (writer.Lazy(shape, np.dtype(np.float32), load_f32), F32)
        elif keep:
            tensors[name] = (writer.Lazy(shape, np.dtype(np.float32), load), F32)
        else:
            row = quantize(np.zeros((1, shape[-1]), np.float32), qtype)  # one row's bytes
            tensors[name] = (writer.Lazy((*shape[:-1], row.shape[-1]), row.dtype,
                                         lambda load=load: quantize(load(), qtype)), qtype)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    writer.write_gguf(a.checkpoint, a.out, tensors)
    print(f"wrote {a.out} ({a.out.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
