"""Strata's torch forward pass for Qwen3-MoE (`qwen3_moe`) and the families that differ from it
only by flags and tensor names (mixtral, olmoe, qwen2_moe: see model/config.py), or by the
attention and routing of model/deepseek.py (deepseek_v3).

Shape legend: T tokens in this step, N cached positions (KV length), D hidden, H query heads,
G KV heads, Hd head dim, E experts, K routed per token, F expert FFN, V vocab.

    tokens -> embed -> L x [ x += attn(rmsnorm(x)); x += mlp(rmsnorm(x)) ] -> rmsnorm -> lm_head
    attn: q/k/v proj -> RMSNorm on q, k (per head, whole projection or none) -> (clip) -> RoPE
          -> paged KV write -> causal GQA per sequence over its blocks -> o_proj
    mlp:  dense SwiGLU (mlp_only_layers) or sparse MoE: router -> softmax (fp32) -> top-K ->
          (renormalize) -> experts via the ExpertSource (the expert cache) -> weighted sum
          (+ sigmoid(gate) * shared expert, a resident dense SwiGLU, where the family has one)

Only non-expert weights live here (on the device). Expert weights are never in the model: the
MoE block hands each expert's tokens to an `ExpertSource`, which decides where they run.
All linear weights are stored pre-transposed and split into S column blocks ([S, in, out/S],
see services.engine.cache.layout) and applied as one `torch.bmm` (`matmul_split`): at decode a
single-row product then streams its weights on S cores instead of one. q, k and v are one fused
weight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from services.engine import kernels
from services.engine.cache.layout import (
    cpu_kernels_for,
    matmul_split,
    split_columns,
    split_swiglu,
)
from services.engine.model import deepseek
from services.engine.model.checkpoint import CheckpointReader
from services.engine.model.config import ModelConfig
from services.engine.model.paged_kv import PagedKVCache

if TYPE_CHECKING:
    from services.engine.cache.expert_cache import ExpertCache
    from services.engine.model.cuda_graphs import DecodeGraphs
    from services.engine.model.deepseek import MlaWeights

log = logging.getLogger("strata.engine")


class ExpertSource(Protocol):
    """Where routed experts run (services.engine.cache.expert_cache.ExpertCache); per MoE layer
    and step: route() once, predict() when wanted, then apply()."""

    @property
    def wants_predictions(self) -> bool:
        """Whether predict() should be called this step (prefetch on, or routing recorded)."""
        ...

    def route(self, layer: int, top_idx: torch.Tensor, counts: np.ndarray) -> None:
        """This step's routing of `layer` (top_idx [T, K] on the host, counts [E] int64: rows
        routed to each expert)."""
        ...

    def predict(self, layer: int, predicted: torch.Tensor) -> None:
        """Experts [T, K] predicted for `layer` before it runs."""
        ...

    def apply(self, layer: int, x: torch.Tensor, top_idx: torch.Tensor,
              top_w: torch.Tensor) -> torch.Tensor:
        """The routed experts of `layer` on x [T, D] (top_idx [T, K] on the host, top_w [T, K]):
        [T, D], each row the sum of its K experts' outputs times their weights, added in
        ascending expert id whatever the residency (results never depend on the cache)."""
        ...


@dataclass(frozen=True)
class Span:
    """Rows [row_start, row_end) of a step: one sequence's tokens at positions
    [pos_start, pos_start + rows), its K/V in `block_table`'s blocks of the paged cache."""

    row_start: int
    row_end: int
    pos_start: int
    block_table: Sequence[int]

    @property
    def pos_end(self) -> int:
        return self.pos_start + self.row_end - self.row_start


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2:
        fused = cpu_kernels_for(x, weight) or kernels.gpu_ops_for(x)
        if fused is not None:
            return fused.rms_norm(x, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope_tables(
    head_dim: int, theta: float, max_num_tokens: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default RoPE cos/sin tables [N_max, Hd] (fp32, HF's rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    pos = torch.arange(max_num_tokens, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # [N_max, Hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [N_max, Hd]
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., Hd] rotated by cos/sin broadcast to it (HF's rotate-half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query token over all N keys, GQA (query head h reads KV head h // (H/G), as HF's
    repeat_kv): q [1, H, Hd], k/v [G, N, Hd] -> [1, H, Hd]."""
    _, H, Hd = q.shape
    G = k.shape[0]
    scores = torch.bmm(q.view(G, H // G, Hd), k.transpose(1, 2)) * Hd**-0.5  # [G, H/G, N]
    return torch.bmm(torch.softmax(scores, dim=-1), v).view(1, H, Hd)


@dataclass(frozen=True)
class DecodeRows:
    """A step's single-token (decode) rows, whose attention runs as one call per layer: the
    CPU kernel (`lengths` set) or one batched SDPA over gathered blocks (`mask` set)."""

    rows: torch.Tensor  # [B] their rows in the step
    all_rows: bool  # rows == 0..T-1: every row of the step is a decode row
    ids: torch.Tensor  # [B, nb] block ids, padded with block 0
    mask: torch.Tensor | None = None  # [B, 1, 1, nb * P] positions each row has (SDPA)
    lengths: torch.Tensor | None = None  # [B] positions each row has (CPU kernel)
    max_length: int = 0


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    post_attn_norm: torch.Tensor  # [D]
    qkv: torch.Tensor | None  # [S, D, (H+2G)*Hd/S]  q, k, v fused, split by columns (not MLA)
    o: torch.Tensor  # [S, H*Hd, D/S]
    q_norm: torch.Tensor | None  # [Hd] per head, [H*Hd] whole projection, None
    k_norm: torch.Tensor | None  # [Hd], [G*Hd], None
    qkv_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    o_bias: torch.Tensor | None = None
    router_t: torch.Tensor | None = None  # [D, E]   (MoE layers)
    mlp_gate_up: torch.Tensor | None = None  # [2, D, I] (dense layers: gate, up)
    mlp_down: torch.Tensor | None = None  # [S, I, D/S] (dense layers)
    shared_gate_up: torch.Tensor | None = None  # [2, D, Is] (MoE layers with a shared expert)
    shared_down: torch.Tensor | None = None  # [S, Is, D/S]
    shared_gate_t: torch.Tensor | None = None  # [D, 1] (None: an ungated shared expert)
    mla: MlaWeights | None = None  # deepseek_v3 latent attention instead of qkv
    router_bias: torch.Tensor | None = None  # [E] deepseek_v3 score correction


class Qwen3MoeModel:
    def __init__(
        self,
        config: ModelConfig,
        embed: torch.Tensor,
        layers: list[LayerWeights],
        final_norm: torch.Tensor,
        lm_head: torch.Tensor,
        device: torch.device,
    ):
        self.config = config
        self.device = device
        self.embed = embed  # [V, D]
        self.layers = layers
        self.final_norm = final_norm  # [D]
        self.lm_head = lm_head  # [S, D, V/S]
        self.dtype = embed.dtype
        self.rope_cos, self.rope_sin = rope_tables(  # MLA rotates only Dr dims of a head
            config.qk_rope_head_dim or config.head_dim, config.rope_theta, config.context_window,
            device)
        self._fused: bool | None = None  # see _fused_decode
        self._decode_layers: tuple[PagedKVCache, list[kernels.DecodeLayer]] | None = None
        moe = [i for i, w in enumerate(layers) if w.router_t is not None]
        self.next_moe_layer = {i: j for i, j in zip(moe, moe[1:], strict=False)}
        self.last_hidden: torch.Tensor | None = None  # of the last forward
        self.graphs: DecodeGraphs | None = None  # CUDA: decode steps as graph replays

    @torch.no_grad()
    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        spans: Sequence[Span],
        kv: PagedKVCache,
        experts: ExpertSource,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """One step over several sequences: token_ids, positions [T] (spans say which rows are
        whose; on the host or the device) -> fp32 logits [S, V] of logit_rows [S]. Linear
        layers and the MoE run once over all T rows; attention runs per sequence over its
        paged K/V. A pure decode step runs as a CUDA graph replay where one is set up."""
        if (self.graphs is not None and len(logit_rows) == len(token_ids)
                and all(s.row_end - s.row_start == 1 for s in spans)):
            logits = self.graphs.run(token_ids, positions, spans)
            if logits is not None:
                return logits
        token_ids, positions = token_ids.to(self.device), positions.to(self.device)
        logit_rows = logit_rows.to(self.device)
        slots = torch.cat([
            kv.slots(s.block_table, positions[s.row_start:s.row_end]) for s in spans])  # [T]
        decode = self.decode_rows(spans, kv, len(token_ids))
        if (decode is not None and decode.all_rows and decode.lengths is not None
                and self._fused_decode):
            return self._forward_fused(token_ids, positions, slots, decode, kv, experts,
                                       logit_rows)
        others = [s for s in spans if decode is None or s.row_end - s.row_start > 1]
        rope = (positions, self.rope_cos[positions][:, None], self.rope_sin[positions][:, None])
        x = self.embed[token_ids]  # [T, D]
        eps = self.config.rms_norm_eps
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, eps)
            x = x + self.attention(i, layer, h, rope, others, decode, kv, slots)
            h = rms_norm(x, layer.post_attn_norm, eps)
            if layer.router_t is not None:
                x = x + self.moe(i, layer, h, experts)
                if layer.shared_gate_up is not None:
                    x = x + self.shared_expert(layer, h)
            else:
                x = x + split_swiglu(h, layer.mlp_gate_up, layer.mlp_down)
        self.last_hidden = x  # [T, D] before the final norm (an MTP draft head reads it)
        return self.logits(x[logit_rows])  # [S, V]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head: hidden [S, D] -> fp32 logits [S, V]."""
        return matmul_split(rms_norm(x, self.final_norm, self.config.rms_norm_eps),
                            self.lm_head).float()

    @staticmethod
    def shared_expert(w: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        """A MoE layer's shared expert (resident, never a cache pair) on h [T, D] -> [T, D]."""
        shared = split_swiglu(h, w.shared_gate_up, w.shared_down)
        if w.shared_gate_t is not None:
            shared = torch.sigmoid(h @ w.shared_gate_t) * shared
        return shared

    def decode_graph_body(self, token_ids: torch.Tensor, positions: torch.Tensor,
                          decode: DecodeRows, kv: PagedKVCache, experts: ExpertCache,
                          route_top: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step with no host work at all, for capture in a CUDA graph (see
        model/cuda_graphs.py): every input on the device (decode: each row's block ids and
        length), routing on the device, each routed expert read at its address in the expert
        cache's table. Each MoE layer's top-K goes to route_top [Lm, T, K], for the cache's
        lookups after the step. -> (hidden [T, D], fp32 logits [T, V])."""
        c = self.config
        P = kv.block_size
        block = decode.ids.gather(1, (positions // P)[:, None])[:, 0]  # [T] the new token's
        slots = block * P + positions % P  # [T] flat KV slot
        rope = (positions, self.rope_cos[positions][:, None], self.rope_sin[positions][:, None])
        x = self.embed[token_ids]  # [T, D]
        j = 0
        for i, layer in enumerate(self.layers):
            h = rms_norm(x, layer.input_norm, c.rms_norm_eps)
            x = x + self.attention(i, layer, h, rope, [], decode, kv, slots)
            h = rms_norm(x, layer.post_attn_norm, c.rms_norm_eps)
            if layer.router_t is None:
                x = x + split_swiglu(h, layer.mlp_gate_up, layer.mlp_down)
                continue
            top_w, top_idx = self.router(layer, h)
            route_top[j].copy_(top_idx)
            x = x + experts.apply_graphed(i, h, top_idx, top_w)
            if layer.shared_gate_up is not None:
                x = x + self.shared_expert(layer, h)
            j += 1
        return x, self.logits(x)

    @property
    def _fused_decode(self) -> bool:
        """Whether a decode step can run a layer's attention half and router as one CPU
        kernel call (strata_decode_layer): fp32 on the CPU with the kernels, every layer a
        softmax-routed MoE without a shared expert, GQA with per-head or no q/k norm."""
        if self._fused is None:  # what the weights allow; the kernels may be switched later
            c = self.config
            self._fused = (
                not c.grouped_routing and c.clip_qkv is None and c.qk_norm in ("head", "none")
                and all(w.router_t is not None and w.shared_gate_up is None and w.mla is None
                        and w.qkv_bias is None and w.o_bias is None for w in self.layers))
        return self._fused and cpu_kernels_for(self.embed, self.embed) is not None

    def _layer_structs(self, kv: PagedKVCache) -> list[kernels.DecodeLayer]:
        """Each layer's weight pointers for strata_decode_layer (built once per KV cache)."""
        if self._decode_layers is None or self._decode_layers[0] is not kv:
            structs = []
            for i, w in enumerate(self.layers):
                assert w.qkv is not None and w.router_t is not None
                structs.append(kernels.DecodeLayer(
                    w.input_norm.data_ptr(), w.post_attn_norm.data_ptr(), w.qkv.data_ptr(),
                    w.qkv.shape[0], None if w.q_norm is None else w.q_norm.data_ptr(),
                    None if w.k_norm is None else w.k_norm.data_ptr(), w.o.data_ptr(),
                    w.o.shape[0], kv.k[i].data_ptr(), kv.v[i].data_ptr(),
                    w.router_t.data_ptr()))
            self._decode_layers = (kv, structs)
        return self._decode_layers[1]

    def _forward_fused(self, token_ids: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, decode: DecodeRows, kv: PagedKVCache,
                       experts: ExpertSource, logit_rows: torch.Tensor) -> torch.Tensor:
        """forward() for a step of decode rows only: per layer one kernel call (attention half
        and router), the expert cache's route(), and its apply() (one kernel call). Computes
        exactly what the per-op kernel path computes, with the same functions."""
        cpu = kernels.active()
        assert cpu is not None
        c = self.config
        T, D, K, E = len(token_ids), c.hidden_size, c.experts_per_token, c.num_experts
        H, G, Hd = c.num_heads, c.num_kv_heads, c.head_dim
        x = self.embed[token_ids]  # [T, D], updated in place layer by layer
        h = torch.empty(T, D)  # each layer's MoE input
        qkv = torch.empty(T, (H + 2 * G) * Hd)
        attn, o = torch.empty(T, H * Hd), torch.empty(T, D)
        scores = torch.empty(max(T * H * decode.max_length, T * E))
        top_idx, top_w = torch.empty(T, K, dtype=torch.int64), torch.empty(T, K)
        counts = np.empty(E, dtype=np.int64)
        step = kernels.DecodeStep(
            T, D, H, G, Hd, kv.block_size, E, K, c.norm_topk_prob, decode.ids.stride(0),
            decode.max_length, c.rms_norm_eps, Hd**-0.5, self.rope_cos.data_ptr(),
            self.rope_sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
            decode.ids.data_ptr(), decode.lengths.data_ptr(), x.data_ptr(), None, h.data_ptr(),
            qkv.data_ptr(), attn.data_ptr(), o.data_ptr(), scores.data_ptr(),
            top_idx.data_ptr(), top_w.data_ptr(), counts.ctypes.data)
        y = None
        for i, layer in enumerate(self._layer_structs(kv)):
            step.add = None if y is None else y.data_ptr()
            cpu.decode_layer(layer, step)  # x += y; attention; h = norm(x); router(h)
            experts.route(i, top_idx, counts)
            nxt = self.next_moe_layer.get(i)
            if nxt is not None and experts.wants_predictions:
                next_logits = h @ self.layers[nxt].router_t  # [T, E]
                experts.predict(nxt, torch.topk(next_logits, K, dim=-1).indices)
            y = experts.apply(i, h, top_idx, top_w)  # [T, D]
        assert y is not None
        x = x + y
        self.last_hidden = x
        return matmul_split(rms_norm(x[logit_rows], self.final_norm, c.rms_norm_eps),
                            self.lm_head).float()  # [S, V]

    def decode_rows(self, spans: Sequence[Span], kv: PagedKVCache, T: int) -> DecodeRows | None:
        """The single-token spans of a step, for one attention call per layer: any number of
        them with the CPU kernel; two or more with SDPA (a lone one takes the per-span path,
        which reads consecutive KV blocks as views)."""
        decode = [s for s in spans if s.row_end - s.row_start == 1]
        kernel = not kv.quantized and (cpu_kernels_for(self.embed, self.embed) is not None
                                       or kernels.gpu_ops_for(self.embed) is not None)
        if not decode or (len(decode) == 1 and not kernel):
            return None
        tables = [s.block_table for s in decode]
        lengths = [s.pos_end for s in decode]
        rows = torch.tensor([s.row_start for s in decode], device=self.device)
        all_rows = len(decode) == T and all(s.row_start == i for i, s in enumerate(decode))
        if kernel:
            return DecodeRows(rows, all_rows, kv.block_ids(tables, lengths),
                              lengths=torch.tensor(lengths, device=self.device),
                              max_length=max(lengths))
        ids, mask = kv.gather_index(tables, lengths)
        return DecodeRows(rows, all_rows, ids, mask=mask[:, None, None, :])

    def qkv(
        self, w: LayerWeights, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q [T, H, Hd], k, v [T, G, Hd]: fused projection, (bias), q/k norm,
        (clip), RoPE. rope: positions [T], cos, sin [T, 1, Hd]."""
        c = self.config
        T = x.shape[0]
        q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        qkv = matmul_split(x, w.qkv)  # [T, (H+2G)*Hd]
        fused = cpu_kernels_for(qkv, qkv) or kernels.gpu_ops_for(qkv)
        if (fused is not None and w.qkv_bias is None and c.clip_qkv is None
                and c.qk_norm in ("head", "none")):  # per head norm and RoPE in one call
            fused.qk_norm_rope(qkv, c.num_heads, c.num_kv_heads, c.head_dim, w.q_norm, w.k_norm,
                             c.rms_norm_eps, self.rope_cos, self.rope_sin, rope[0])
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)
            return (q.view(T, c.num_heads, c.head_dim), k.view(T, c.num_kv_heads, c.head_dim),
                    v.view(T, c.num_kv_heads, c.head_dim))
        _, cos, sin = rope
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=1)  # [T, H*Hd], [T, G*Hd] x 2
        if w.qkv_bias is not None:
            q, k, v = q + w.qkv_bias[0], k + w.qkv_bias[1], v + w.qkv_bias[2]
        if c.qk_norm == "proj":  # olmoe: one norm over all heads
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        if c.clip_qkv is not None:
            q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
        q = q.view(T, c.num_heads, c.head_dim)  # [T, H, Hd]
        k = k.view(T, c.num_kv_heads, c.head_dim)  # [T, G, Hd]
        v = v.view(T, c.num_kv_heads, c.head_dim)  # [T, G, Hd]
        if c.qk_norm == "head":
            q, k = rms_norm(q, w.q_norm, c.rms_norm_eps), rms_norm(k, w.k_norm, c.rms_norm_eps)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def attention(
        self,
        layer_idx: int,
        w: LayerWeights,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        spans: Sequence[Span],
        decode: DecodeRows | None,
        kv: PagedKVCache,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """Causal GQA: multi-token spans (prefill chunks) one by one; the single-token rows of
        `decode` in one call. rope: positions [T], cos, sin [T, 1, Hd]."""
        c = self.config
        T = x.shape[0]
        if w.mla is None:
            q, k, v = self.qkv(w, x, rope)
        else:
            q, k, v = deepseek.mla_qkv(c, w.mla, x, rope[1], rope[2])
        kv.write(layer_idx, slots, k, v)
        out = q.new_empty(q.shape) if decode is None or not decode.all_rows else None
        for s in spans:
            rows = slice(s.row_start, s.row_end)
            n, t = s.pos_end, s.row_end - s.row_start
            k_all, v_all = kv.read(layer_idx, s.block_table, n)  # [G, N, Hd]
            if t == 1:  # a lone decode token: three small ops instead of SDPA's dispatch
                out[rows] = decode_attention(q[rows], k_all, v_all)
                continue
            mask = None
            if t > 1:  # query i sits at position pos_start + i and sees keys up to it
                q_pos = torch.arange(s.pos_start, n, device=x.device)
                mask = q_pos[:, None] >= torch.arange(n, device=x.device)[None, :]  # [t, N]
            out[rows] = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1), k_all, v_all, attn_mask=mask,
                enable_gqa=c.num_heads != c.num_kv_heads,
            ).transpose(0, 1)  # [t, H, Hd]
        if decode is not None:
            q_rows = q if decode.all_rows else q[decode.rows]  # [B, H, Hd]
            gpu = kernels.gpu_ops_for(q_rows)
            if decode.lengths is not None and gpu is not None:
                res = gpu.decode_attention(q_rows, kv.k[layer_idx], kv.v[layer_idx], decode.ids,
                                           decode.lengths, q_rows.shape[-1] ** -0.5)
            elif decode.lengths is not None:
                cpu = cpu_kernels_for(q_rows, q_rows)
                assert cpu is not None
                res = cpu.decode_attention(q_rows, kv.k[layer_idx], kv.v[layer_idx], decode.ids,
                                           decode.lengths, decode.max_length)
            else:
                k_all, v_all = kv.read_batch(layer_idx, decode.ids)  # [B, G, N, Hd]
                res = F.scaled_dot_product_attention(
                    q_rows[:, :, None], k_all, v_all, attn_mask=decode.mask,
                    enable_gqa=c.num_heads != c.num_kv_heads,
                )[:, :, 0]  # [B, H, Hd]
            if out is None:
                out = res
            else:
                out[decode.rows] = res
        assert out is not None
        out = out[..., : c.v_head_dim or c.head_dim]  # MLA: V was zero-padded to Hd
        out = matmul_split(out.reshape(T, -1), w.o)  # [T, D]
        return out if w.o_bias is None else out + w.o_bias

    def router(self, w: LayerWeights, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routing as torch ops on x's device: x [T, D] -> (top_w [T, K] in x's dtype,
        top_idx [T, K]): softmax (fp32) top-K, renormalized where the family does, or
        deepseek_v3's grouped routing."""
        c = self.config
        if c.grouped_routing:
            top_w, top_idx = deepseek.grouped_topk(c, (x @ w.router_t).float(), w.router_bias)
        else:
            probs = torch.softmax((x @ w.router_t).float(), dim=-1)  # [T, E] fp32
            top_w, top_idx = torch.topk(probs, c.experts_per_token, dim=-1)  # [T, K]
            if c.norm_topk_prob:
                top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_w.to(x.dtype), top_idx

    def moe(
        self, layer_idx: int, w: LayerWeights, x: torch.Tensor, experts: ExpertSource
    ) -> torch.Tensor:
        c = self.config
        K = c.experts_per_token
        cpu = None if c.grouped_routing else cpu_kernels_for(x, w.router_t)
        if cpu is not None:  # one call: logits, softmax, top-K, renormalization, counts
            top_idx, top_w, counts = cpu.router(x.contiguous(), w.router_t, K,
                                                c.norm_topk_prob)
        else:
            top_w, top_idx = self.router(w, x)
            top_idx = top_idx.cpu()  # [T, K]
            counts = torch.bincount(top_idx.flatten(), minlength=c.num_experts).numpy()  # [E]
        experts.route(layer_idx, top_idx, counts)  # one lookup per distinct expert
        nxt = self.next_moe_layer.get(layer_idx)
        if nxt is not None and experts.wants_predictions:
            # Prefetch: the next MoE layer's router on this layer's input predicts its experts
            # (softmax is monotonic, so top-K of the logits is top-K of the probabilities).
            next_logits = x @ self.layers[nxt].router_t  # [T, E]
            experts.predict(nxt, torch.topk(next_logits, K, dim=-1).indices)  # [T, K]
        return experts.apply(layer_idx, x, top_idx, top_w)  # [T, D]


def load_qwen3_moe(
    reader: CheckpointReader,
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> Qwen3MoeModel:
    """Load the non-expert weights (embeddings, attention, norms, routers, dense MLPs, shared
    experts, lm_head) of any supported family."""
    t0 = time.perf_counter()

    def get_t(name: str) -> torch.Tensor:  # a [out, in] weight as [in, out]
        return reader.get(name, dtype).t()

    def get_split(*names: str) -> torch.Tensor:  # [out_i, in] weights -> [S, in, sum(out)/S]
        return split_columns(torch.cat([get_t(n) for n in names], dim=1)).to(device)

    def get(name: str) -> torch.Tensor:
        return reader.get(name, dtype).to(device)

    def get_swiglu(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:  # [2, D, I], [S, I, D/S]
        gate_up = torch.stack([get_t(f"{prefix}.gate_proj.weight"),
                               get_t(f"{prefix}.up_proj.weight")])
        return gate_up.contiguous().to(device), get_split(f"{prefix}.down_proj.weight")

    qk_norm = config.qk_norm != "none"
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        w = LayerWeights(
            input_norm=get(f"{p}.input_layernorm.weight"),
            post_attn_norm=get(f"{p}.post_attention_layernorm.weight"),
            qkv=None if config.kv_lora_rank else get_split(
                f"{a}.q_proj.weight", f"{a}.k_proj.weight", f"{a}.v_proj.weight"),
            o=get_split(f"{a}.o_proj.weight"),
            q_norm=get(f"{a}.q_norm.weight") if qk_norm else None,
            k_norm=get(f"{a}.k_norm.weight") if qk_norm else None,
        )
        if config.kv_lora_rank:
            w.mla = deepseek.load_mla(get, get_split, a, config)
        elif config.attention_bias:
            w.qkv_bias = (get(f"{a}.q_proj.bias"), get(f"{a}.k_proj.bias"), get(f"{a}.v_proj.bias"))
            w.o_bias = get(f"{a}.o_proj.bias") if f"{a}.o_proj.bias" in reader else None
        moe = f"{p}.{config.weight_names.moe}"
        if config.is_moe_layer(i):
            w.router_t = get_t(f"{moe}.gate.weight").contiguous().to(device)
            if f"{moe}.gate.e_score_correction_bias" in reader:
                w.router_bias = get(f"{moe}.gate.e_score_correction_bias")
            names = config.weight_names
            if config.shared_expert_intermediate_size:
                w.shared_gate_up, w.shared_down = get_swiglu(f"{moe}.{names.shared}")
            if config.shared_expert_intermediate_size and names.shared_gate:
                w.shared_gate_t = get_t(f"{moe}.{names.shared_gate}.weight").contiguous().to(device)
        else:
            w.mlp_gate_up, w.mlp_down = get_swiglu(f"{p}.mlp")
        layers.append(w)
    embed = get("model.embed_tokens.weight")
    if config.tie_word_embeddings or "lm_head.weight" not in reader:
        lm_head = split_columns(embed.t()).to(device)
    else:
        lm_head = get_split("lm_head.weight")
    model = Qwen3MoeModel(config, embed, layers, get("model.norm.weight"), lm_head, device)
    log.info(
        "loaded non-expert weights of %d layers in %.1f s",
        config.num_layers,
        time.perf_counter() - t0,
    )
    return model
