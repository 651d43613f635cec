"""Build a Decoder from a checkpoint: the family's layers, embeddings, final norm and lm_head
(every non-expert weight; the host store loads the routed experts)."""

from __future__ import annotations

import logging
import time

import torch

from services.engine.kernels.backend import TorchBackend
from services.engine.model.blocks import BlockMatrix
from services.engine.model.checkpoint import CheckpointReader
from services.engine.model.config import ModelConfig
from services.engine.model.decoder import Decoder
from services.engine.model.families import family
from services.engine.model.families.base import Tensors, rotary_dim
from services.engine.model.layers.rope import Rope

log = logging.getLogger("strata.engine")


def load_model(reader: CheckpointReader, config: ModelConfig, backend: TorchBackend,
               dtype: torch.dtype = torch.float32) -> Decoder:
    """The non-expert weights of any supported family, on the backend's device, matrices in
    `dtype` (the activations in the backend's activation dtype for it)."""
    t0 = time.perf_counter()
    t = Tensors(reader, dtype, backend.device, backend.activation_dtype(dtype),
                backend.block_matrices, backend.fp8_matrices)
    build = family(config.model_type).build_layer
    layers = [build(t, config, i) for i in range(config.num_layers)]
    moes = [layer.moe for layer in layers if layer.moe is not None]
    for moe, nxt in zip(moes, moes[1:], strict=False):
        moe.next_router = nxt  # next-layer prefetch applies nxt's router to moe's input
    tied = config.tie_word_embeddings or "lm_head.weight" not in t
    embed = (t.matrix if tied else t.embedding)("model.embed_tokens.weight")
    if isinstance(embed, BlockMatrix):
        log.info("embeddings kept as %s as stored (%d rows, dequantized per lookup)",
                 embed.block_types[0], embed.out_features)
    if tied:
        assert isinstance(embed, torch.Tensor)
        lm_head = embed.to(backend.device)  # [V, D]: the embeddings' own rows
    else:  # kept as stored where the backend reads its blocks: the largest matrix of a step
        lm_head = t.linear("lm_head.weight")
        if isinstance(lm_head, BlockMatrix):
            log.info("lm_head kept as %s as stored (%d rows)", lm_head.block_types[0],
                     lm_head.out_features)
    # MLA rotates its rope part, GQA the partial_rotary_factor share of a head
    rope = Rope(config.qk_rope_head_dim or rotary_dim(config) or config.head_dim,
                config.rope_theta, config.context_window, backend.device, config.rope_scaling)
    final_norm = t.get("model.norm.weight") + (1 if config.norm_offset else 0)  # (1 + w)
    model = Decoder(config, embed, layers, final_norm, lm_head, rope, backend, dtype)
    log.info("loaded non-expert weights of %d layers in %.1f s", config.num_layers,
             time.perf_counter() - t0)
    return model
