"""MTP drafts from the checkpoint's own multi-token-prediction layer, released beside the model
and never loaded by transformers: Qwen3-Next's and Qwen3.5's `mtp.*`; DeepSeek-V3/R1's, Kimi-K2's
and GLM-4.5's layer `num_hidden_layers` (`eh_proj`, `enorm`, `hnorm`, `shared_head`).

Shape legend: T rows, D hidden, V vocab, E experts.

    h_t   the main model's hidden state at position t, after its final norm
    x_t = fc([enorm(embed(token t+1)); hnorm(h_t)])          2D -> D
    y_t = layer(x_t)          one decoder layer of the family (full attention over the MTP
                              layer's own K/V of positions <= t, a MoE block with its own experts)
    head(norm(y_t)) -> logits of token t+2 (DeepSeek / GLM: shared_head; Qwen: the main lm_head)
    a later round reads norm(y_t) (Qwen) or y_t (DeepSeek / GLM) as its h, and DeepSeek / GLM
    zero the embedding at position 0: both as vLLM runs these layers.

    propose (a sequence's tokens x_0 .. x_n, x_n not yet run; h_0 .. h_{n-1} known):
      round 1   catch up positions [computed, n-1] with (h_t, x_{t+1})  -> d1 from row n-1
      round j   position n-2+j with (g of the last round, d_{j-1})      -> d_j
    Positions below n hold real pairs and are kept (`computed` = n); the draft rounds' K/V at
    n and beyond are overwritten by the next catch-up.

The layer is built by the family's own builder from a view of the checkpoint in which the MTP
decoder layer reads as layer 0 of a one-layer model (attention, norms, router, shared expert:
the main layers' code, so the same kernels). Its K/V lives in a pool of its own, with
its own block tables; its routed experts in an expert cache of their own (one MoE layer): every
pair resident on CUDA, read in place from the host store on the CPU. Their lookups are
`draft_lookups`, never the main cache's. Drafts are greedy: a deterministic function of the
tokens, as the acceptance rule for point-mass drafts needs (verify.py).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from services.engine.block_manager import BlockManager, BlockTable, NoFreeBlocks
from services.engine.cache.expert_cache import ExpertCache
from services.engine.cache.formats import device_kernel
from services.engine.cache.host_store import HostStore
from services.engine.cache.placement import Placer
from services.engine.cache.policy import PolicySpec, Residency
from services.engine.cache.slot_pool import SlotPool
from services.engine.model.checkpoint import CheckpointReader, load_model_config, open_checkpoint
from services.engine.model.config import ModelConfig
from services.engine.model.decoder import Decoder
from services.engine.model.families import family, weight_names
from services.engine.model.families.base import Tensors
from services.engine.model.paged_kv import PagedKVCache
from services.engine.model.step import Span
from services.engine.sampling import argmax_ids
from services.engine.spec.base import DraftRequest, DraftSource

log = logging.getLogger("strata.engine")

KV_WINDOWS = 4  # the MTP layer's KV pool: this many context windows (the draft model's rule)
QWEN = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # mtp.* beside the model
NEXTN = ("deepseek_v3", "kimi_k2", "glm4_moe")  # layer num_hidden_layers (DeepSeek's "nextn")


@dataclass(frozen=True)
class MtpLayout:
    """Where a checkpoint keeps its MTP layer (names as stored) and how it runs."""

    layer: str  # its decoder layer's prefix
    fc: str
    enorm: str
    hnorm: str
    norm: str
    head: str | None  # its own lm_head; None: the main model's
    feed_normed: bool  # a later round reads the last output after the norm (else before it)
    zero_first: bool  # the embedding at position 0 is zeroed


def mtp_layout(c: ModelConfig, reader: Any) -> MtpLayout | None:
    """The checkpoint's MTP layer, or None when it has none this module reads."""
    if c.model_type in QWEN and "mtp.fc.weight" in reader:
        return MtpLayout("mtp.layers.0.", "mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                         "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight", None,
                         feed_normed=True, zero_first=False)
    p = f"model.layers.{c.num_layers}."
    if c.model_type in NEXTN and f"{p}eh_proj.weight" in reader:
        head = f"{p}shared_head.head.weight"
        return MtpLayout(p, f"{p}eh_proj.weight", f"{p}enorm.weight", f"{p}hnorm.weight",
                         f"{p}shared_head.norm.weight", head if head in reader else None,
                         feed_normed=False, zero_first=True)
    return None


def mtp_view(reader: CheckpointReader, layout: MtpLayout) -> CheckpointReader:
    """The checkpoint read as a one-layer model: the MTP decoder layer's tensors as
    model.layers.0.*, the main layers and final norm left out, the rest as stored."""

    def rename(name: str) -> str | None:
        if name.startswith(layout.layer):
            return "model.layers.0." + name[len(layout.layer):]
        if name.startswith(("model.layers.", "model.norm.")):
            return None
        return name

    return reader.renamed(rename)


def mtp_config(c: ModelConfig) -> ModelConfig:
    """The MTP layer as a one-layer model: full attention and a MoE block."""
    return dataclasses.replace(c, num_layers=1, linear_layers=(), mlp_only_layers=(),
                               decoder_sparse_step=1, sliding_layers=())


def _open(model_dir: str | Path) -> tuple[ModelConfig, Any, MtpLayout | None]:
    c = load_model_config(Path(model_dir))
    reader = open_checkpoint(Path(model_dir), weight_names(c))
    return c, reader, mtp_layout(c, reader)


def has_checkpoint_mtp(model_dir: str | Path | None) -> bool:
    """Whether the checkpoint (a safetensors directory) holds an MTP layer this module reads."""
    if model_dir is None or not (Path(model_dir) / "config.json").is_file():
        return False
    return _open(model_dir)[2] is not None


def checkpoint_mtp_bytes(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                         device: str = "cuda") -> int:
    """Device bytes of the MTP layer: its tensors (its experts too where they are resident:
    on CUDA; not the copy of the embeddings some checkpoints keep in it) and its KV pool."""
    c, reader, layout = _open(model_dir)
    if layout is None:
        raise ValueError(f"{Path(model_dir).name} has no multi-token-prediction layer")
    return _mtp_bytes(c, reader, layout, dtype, device)


def _mtp_bytes(c: ModelConfig, reader: Any, layout: MtpLayout, dtype: torch.dtype,
               device: str) -> int:
    own = {layout.fc, layout.enorm, layout.hnorm, layout.norm, layout.head}
    names = [n for n in reader.names
             if (n in own or (n.startswith(layout.layer)
                              and not n.endswith("embed_tokens.weight")))
             and (torch.device(device).type == "cuda" or ".experts." not in n)]
    weights = sum(math.prod(reader.shape(n)) for n in names) * dtype.itemsize
    mc = mtp_config(c)
    blocks = KV_WINDOWS * -(-c.context_window // 16)
    return weights + blocks * PagedKVCache.model_bytes_per_block(mc, 16, dtype)


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # token t+1 of each computed position t
    table: BlockTable = field(default_factory=BlockTable)
    start: int = 0  # position of the first kept main-model hidden row
    hidden: list[torch.Tensor] = field(default_factory=list)  # [D] rows from `start` on
    hidden_tokens: list[int] = field(default_factory=list)  # the token each row was run for

    @property
    def computed(self) -> int:
        return len(self.tokens)


class CheckpointMtp(DraftSource):
    method = "mtp"

    def __init__(self, runner: Any):
        self.runner = runner  # services.engine.runner.ModelRunner of the main model
        main, c = runner.model, runner.config
        stored = open_checkpoint(runner.model_dir, weight_names(c))
        layout = mtp_layout(c, stored)
        if layout is None:
            raise ValueError(f"{runner.model_name} has no multi-token-prediction layer")
        self.layout = layout
        reader = mtp_view(stored, layout)
        self.config = mc = mtp_config(c)
        be = runner.backend

        def tensors(r: Any) -> Tensors:
            return Tensors(r, runner.weight_dtype, be.device,
                           be.activation_dtype(runner.weight_dtype), be.block_matrices,
                           be.fp8_matrices)

        t, own = tensors(reader), tensors(stored)
        layer = family(c.model_type).build_layer(t, mc, 0)
        offset = 1 if c.norm_offset else 0  # (1 + w) norms
        self.fc = own.linear(layout.fc)  # [D, 2D]
        self.norm_embed = own.get(layout.enorm) + offset
        self.norm_hidden = own.get(layout.hnorm) + offset
        head = main.lm_head if layout.head is None else own.linear(layout.head)
        self.decoder = Decoder(mc, main.embed, [layer], own.get(layout.norm) + offset, head,
                               main.rope, be, runner.weight_dtype)
        self.cache = self._expert_cache(reader)
        blocks = KV_WINDOWS * -(-c.context_window // 16)
        self.kv = PagedKVCache.for_model(mc, blocks, 16, main.dtype, be.device)
        self.kv.claim(self)
        self.blocks = BlockManager(blocks, 16, enable_prefix_reuse=False)
        self.memory_bytes = _mtp_bytes(c, stored, layout, runner.weight_dtype, str(be.device))
        self._seqs: dict[int, _Seq] = {}
        runner.hidden_sink = self.record

    holds_kv = True  # bound to its pool for life

    def _expert_cache(self, reader: CheckpointReader) -> ExpertCache:
        """The MTP layer's experts in the main experts' format: all resident on CUDA, read in
        place from the host store on the CPU."""
        runner, device = self.runner, self.runner.device
        fmt = runner.cache.host.format
        E = self.config.num_experts
        host = HostStore(fmt, [(0, e) for e in range(E)], pin_memory=device.type == "cuda")
        host.load(reader)
        slots = E if device.type == "cuda" else 0
        pool = SlotPool(slots, host, device, Residency(slots, PolicySpec()))
        placer = Placer("copy" if slots else "host", None,
                        fmt.exact_on(device, device_kernel(fmt, device) is not None))
        cache = ExpertCache(host, pool, 1, E, placer, cpu_kernels=runner.backend.cpu)
        if slots:
            pool.fill(host.pairs, source="MTP layer: every pair")
            cache.refresh_addresses()
        return cache

    @property
    def draft_lookups(self) -> int:  # type: ignore[override]
        return self.cache.lookups

    def describe(self) -> str:
        c = self.config
        return (f"the checkpoint's MTP layer ({self.runner.model_name}: {self.layout.layer}*, "
                f"{c.num_experts} experts top-{c.experts_per_token}, "
                f"{self.memory_bytes / 2**20:.0f} MiB)")

    def release(self, seq_id: int) -> None:
        st = self._seqs.pop(seq_id, None)
        if st is not None:
            self.blocks.free(st.table)

    # -- the main model's hidden states -----------------------------------------------------
    def record(self, chunks: Sequence[Any], hidden: torch.Tensor) -> None:
        """The runner's hidden sink: keep each sequence's rows from the first position the MTP
        layer has not consumed (hidden [T, D], before the final norm)."""
        row = 0
        for chunk in chunks:
            n = len(chunk.token_ids)
            if chunk.seq_id is not None:
                st = self._seqs.setdefault(chunk.seq_id, _Seq())
                rows = list(hidden[row:row + n].clone())  # not views keeping the step alive
                cut = chunk.pos_start - st.start
                if 0 <= cut <= len(st.hidden):  # rows from pos_start on are replaced
                    st.hidden[cut:] = rows
                    st.hidden_tokens[cut:] = list(chunk.token_ids)
                else:  # a gap (never in order) or a recomputation: start over
                    st.start, st.hidden = chunk.pos_start, rows
                    st.hidden_tokens = list(chunk.token_ids)
            row += n

    def _sync(self, r: DraftRequest) -> bool:
        """Keep the computed positions whose pairs still hold; check that the main model's
        rows for the rest are known; room in the pool for the rounds. False: no drafts."""
        st = self._seqs.get(r.seq_id)
        tokens, n = r.token_ids, len(r.token_ids) - 1
        if st is None:
            return False
        keep = 0
        while keep < min(st.computed, n) and st.tokens[keep] == tokens[keep + 1]:
            keep += 1
        del st.tokens[keep:]
        first = keep - st.start
        if first < 0 or st.start + len(st.hidden) < n or any(
                st.hidden_tokens[t - st.start] != tokens[t] for t in range(keep, n)):
            return False
        if n + r.max_tokens > self.runner.config.context_window:
            return False
        try:
            self.blocks.append(st.table, n + r.max_tokens)
        except NoFreeBlocks:
            self.release(r.seq_id)
            return False
        return True

    # -- drafting ---------------------------------------------------------------------------
    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        live = [i for i, r in enumerate(requests) if r.max_tokens > 0 and self._sync(r)]
        g: dict[int, torch.Tensor] = {}  # request index -> the last round's output row [D]
        rounds = max((requests[i].max_tokens for i in live), default=0)
        for k in range(rounds):
            active = [i for i in live if requests[i].max_tokens > k]
            rows, spans, ids, positions, hidden = 0, [], [], [], []
            for i in active:
                r, st = requests[i], self._seqs[requests[i].seq_id]
                n = len(r.token_ids) - 1
                if k == 0:  # catch up to position n-1 with the main model's rows
                    first = st.computed
                    ids += list(r.token_ids[first + 1:n + 1])
                    hidden += [self._main_norm(torch.stack(st.hidden[first - st.start:
                                                                     n - st.start]))]
                else:  # one position on, from the last round's output and draft
                    first = n - 1 + k
                    ids.append(drafts[i][-1])
                    hidden.append(g[i][None])
                count = len(ids) - rows
                spans.append(Span(rows, rows + count, first, st.table.block_ids, r.seq_id))
                positions += range(first, first + count)
                rows += count
            out, logits = self._forward(ids, positions, spans, torch.cat(hidden))
            best = argmax_ids(logits)
            for j, i in enumerate(active):
                r, st = requests[i], self._seqs[requests[i].seq_id]
                if k == 0:  # the pairs of positions < n are real: kept
                    n = len(r.token_ids) - 1
                    st.tokens = list(r.token_ids[1:n + 1])
                    drop = n - st.start  # rows the MTP layer has consumed
                    st.start, st.hidden = n, st.hidden[drop:]
                    st.hidden_tokens = st.hidden_tokens[drop:]
                g[i] = out[j]
                drafts[i].append(best[j])
        return drafts

    def _main_norm(self, h: torch.Tensor) -> torch.Tensor:
        """The main model's final norm (what its lm_head reads: the MTP layer's h_t)."""
        main = self.runner.model
        return main.backend.rms_norm(h, main.final_norm, main.config.rms_norm_eps)

    def _forward(self, ids: list[int], positions: list[int], spans: list[Span],
                 hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of the MTP layer over every span -> each span's last row: what a
        later round reads as its h, g [B, D], and fp32 logits [B, V]."""
        d, be = self.decoder, self.decoder.backend
        device = d.device
        e = d.embed_rows(torch.tensor(ids, dtype=torch.long, device=device))  # [T, D]
        if self.layout.zero_first:
            e[torch.tensor(positions, device=device) == 0] = 0
        eps = self.config.rms_norm_eps
        x = be.linear(torch.cat([be.rms_norm(e, self.norm_embed, eps),
                                 be.rms_norm(hidden.to(d.dtype), self.norm_hidden, eps)], dim=-1),
                      self.fc)  # [T, D]
        last = torch.tensor([s.row_end - 1 for s in spans], dtype=torch.long)
        prefill = np.array([s.row_end - s.row_start > 1 for s in spans
                            for _ in range(s.row_start, s.row_end)], dtype=bool)
        self.cache.begin_step(len(ids), prefill)
        logits = d.forward(torch.tensor(ids, dtype=torch.long),
                           torch.tensor(positions, dtype=torch.long), spans, self.kv,
                           self.cache, last, inputs=x)  # [B, V]
        logits[:, self.runner.num_usable_tokens:] = float("-inf")
        assert d.last_hidden is not None
        g = d.last_hidden[last.to(device)]  # [B, D]
        if self.layout.feed_normed:
            g = be.rms_norm(g, d.final_norm, eps)
        return g, logits
