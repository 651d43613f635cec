"""Gated DeltaNet: Qwen3-Next's linear attention, a recurrent state per sequence instead of K/V.

Shape legend: T rows, D hidden, Hk / Hv key / value heads, Dk / Dv their dims, C conv channels
(2 Hk Dk + Hv Dv), Kc conv kernel.

    x -> [q | k | v | z] and [b | a] projections (rows re-laid at load from the checkpoint's
         per-key-head groups)
      -> depthwise causal conv over q|k|v (Kc taps, the last Kc - 1 inputs carried) -> silu
      -> q, k L2-normalized per head, q times Dk^-0.5; each key head serves Hv / Hk value heads
      -> per token, per value head, state S [Dk, Dv]:
             S *= exp(g)      g = -exp(A_log) * softplus(a + dt_bias)
             S += k (beta (v - k^T S))^T      beta = sigmoid(b)
             o  = q^T S
      -> RMSNorm(o) * w * silu(z) per head -> out projection

A sequence's state (the conv's last inputs and S per value head) lives here, keyed by its id:
created at its first position, carried across prefill chunks and decode steps, dropped by
release() when it finishes or is preempted (its recomputation starts again from position 0).
The paged KV pool holds nothing for these layers, and a prefix shared in the pool would skip
positions whose state this layer never saw: the engine turns prefix reuse off for such models.

A verification span (speculative decoding: the last token and k drafts) runs token by token
through the decode recurrence, and the state before it is kept with the span's inputs: when
only a prefix of the drafts is accepted, rewind() restores that state and replays the accepted rows
(no per-row snapshots: k+1 states of every layer would outweigh the rows' inputs many times).

Decode rows of a step advance together (their states stacked). A prefill span runs in chunks
of CHUNK tokens, each in closed form: with G_t the product of the decays up to t and S0 the
state before the chunk, the recurrence unrolls to

    S_t = G_t S0 + sum_{i<=t} (G_t / G_i) k_i u_i^T
    u_t + sum_{i<t} beta_t (G_t / G_i) (k_t . k_i) u_i = beta_t (v_t - G_t S0^T k_t)

a unit lower-triangular system for the chunk's u (one triangular solve), then
o_t = G_t S0^T q_t + sum_{i<=t} (G_t / G_i) (q_t . k_i) u_i: matrix products instead of a
Python step per token (the same sums as the recurrence, in another order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from services.engine.model.step import Span, Step

CHUNK = 64  # prefill tokens per closed-form block


@dataclass
class State:
    conv: torch.Tensor  # [Kc - 1, C] the last conv inputs
    s: torch.Tensor  # [Hv, Dk, Dv] fp32
    pos: int = 0  # positions consumed
    replay: _Replay | None = None  # the last verification span, until it is settled


@dataclass
class _Replay:
    """What a verification span started from, and its rows' inputs (to replay a prefix)."""

    pos: int
    conv: torch.Tensor
    s: torch.Tensor
    mixed: torch.Tensor  # [t, C]
    beta: torch.Tensor  # [t, Hv]
    g: torch.Tensor  # [t, Hv]


@dataclass
class GatedDeltaNet:
    qkvz: torch.Tensor  # [2 Hk Dk + 2 Hv Dv, D]: q | k | v | z rows
    ba: torch.Tensor  # [2 Hv, D]: b | a rows
    conv: torch.Tensor  # [Kc, C] depthwise taps (tap j reads the input j - Kc + 1 steps back)
    decay: torch.Tensor  # [Hv] -exp(A_log), fp32
    dt_bias: torch.Tensor  # [Hv] fp32
    norm: torch.Tensor  # [Dv] the gated RMSNorm's weight
    out: torch.Tensor  # [D, Hv Dv]
    key_heads: int  # Hk
    value_heads: int  # Hv
    key_dim: int  # Dk
    value_dim: int  # Dv
    eps: float
    states: dict[int, State] = field(default_factory=dict)

    plain = False  # not what the fused decode kernel computes
    capturable = False  # host-side state per sequence

    def release(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)

    def rewind(self, seq_id: int, pos: int) -> None:
        """The sequence's positions now end at `pos` (drafts after it were rejected): its
        state goes back to where its last verification span started and replays the rows
        up to `pos`."""
        st = self.states.get(seq_id)
        if st is None:
            return
        r, st.replay = st.replay, None
        if st.pos <= pos:  # every row was accepted
            return
        if r is None or not r.pos <= pos:
            raise RuntimeError(f"sequence {seq_id}: cannot rewind a linear-attention state at "
                               f"position {st.pos} to {pos} (no verification span covers it)")
        st.conv, st.s, st.pos = r.conv, r.s, r.pos
        for row in range(pos - r.pos):
            self._recur([st], r.mixed[row:row + 1], r.beta[row:row + 1], r.g[row:row + 1])

    def __call__(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [T, D] (normalized) -> [T, D]."""
        be = step.backend
        Hk, Hv, Dk, Dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        qkvz = be.linear(x, self.qkvz).float()  # [T, 2 Hk Dk + 2 Hv Dv]
        ba = be.linear(x, self.ba).float()  # [T, 2 Hv]
        mixed, z = qkvz.split([2 * Hk * Dk + Hv * Dv, Hv * Dv], dim=1)
        beta, g = ba[:, :Hv].sigmoid(), self.decay * F.softplus(ba[:, Hv:] + self.dt_bias)
        o = torch.empty(x.shape[0], Hv, Dv, device=x.device)
        decode = [s for s in step.all_spans if s.row_end - s.row_start == 1]
        if decode:
            rows = torch.tensor([s.row_start for s in decode], device=x.device)
            states = [self._state(s, mixed.shape[1], x.device) for s in decode]
            o[rows] = self._recur(states, mixed[rows], beta[rows], g[rows])
        for s in step.all_spans:
            if s.row_end - s.row_start > 1:
                rows = slice(s.row_start, s.row_end)
                if s.drafts:
                    o[rows] = self._verify(s, mixed[rows], beta[rows], g[rows])
                else:
                    o[rows] = self._prefill(s, mixed[rows], beta[rows], g[rows])
        y = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)  # [T, Hv, Dv]
        y = (self.norm.float() * y) * F.silu(z.view(-1, Hv, Dv))
        return be.linear(y.reshape(x.shape[0], Hv * Dv).to(x.dtype), self.out)

    def _state(self, span: Span, channels: int, device: torch.device) -> State:
        if span.pos_start == 0:  # a sequence's first token (or its recomputation's)
            self.states[span.seq_id] = State(
                torch.zeros(self.conv.shape[0] - 1, channels, device=device),
                torch.zeros(self.value_heads, self.key_dim, self.value_dim, device=device))
        state = self.states.get(span.seq_id)
        if state is None or state.pos != span.pos_start:
            raise RuntimeError(
                f"sequence {span.seq_id} reached position {span.pos_start} of a linear-attention "
                f"layer whose state is at {'none' if state is None else state.pos} (a reused "
                "prefix, or rejected drafts not rewound?)")
        state.replay = None  # settled: the rows it held are the sequence's
        return state

    def _qkv(self, conv_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv's outputs [n, C] -> q, k [n, Hv, Dk] (L2-normalized, q scaled, each key
        head repeated for its value heads), v [n, Hv, Dv]."""
        Hk, Hv, Dk, Dv = self.key_heads, self.value_heads, self.key_dim, self.value_dim
        q, k, v = F.silu(conv_in).split([Hk * Dk, Hk * Dk, Hv * Dv], dim=1)
        q, k = _l2(q.view(-1, Hk, Dk)), _l2(k.view(-1, Hk, Dk))
        return (q.repeat_interleave(Hv // Hk, dim=1) * Dk**-0.5,
                k.repeat_interleave(Hv // Hk, dim=1), v.view(-1, Hv, Dv))

    def _prefill(self, span: Span, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
                 ) -> torch.Tensor:
        """A span's tokens: mixed [t, C], beta, g [t, Hv] -> o [t, Hv, Dv], in chunks of
        CHUNK tokens (the module docstring's closed form); its state advanced past them."""
        state = self._state(span, mixed.shape[1], mixed.device)
        window = torch.cat([state.conv, mixed])  # [Kc - 1 + t, C]
        taps = window.unfold(0, self.conv.shape[0], 1)  # [t, C, Kc]: token i's inputs
        q, k, v = self._qkv((taps * self.conv.t()).sum(dim=-1))
        state.conv = window[-(self.conv.shape[0] - 1):]
        state.pos += mixed.shape[0]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [Hv, t, .]
        beta, g = beta.t(), g.t()  # [Hv, t]
        s, out = state.s, torch.empty_like(v)
        for c0 in range(0, q.shape[1], CHUNK):
            c = slice(c0, c0 + CHUNK)
            qc, kc, vc, bc = q[:, c], k[:, c], v[:, c], beta[:, c]
            log_g = g[:, c].cumsum(dim=1)  # [Hv, L] log G_t
            n = qc.shape[1]
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            ratio = (log_g[:, :, None] - log_g[:, None, :]).masked_fill(~causal, -torch.inf)
            ratio = ratio.exp()  # [Hv, L, L] G_t / G_i for i <= t, else 0
            system = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * ratio).tril(-1)
            rhs = bc[:, :, None] * (vc - log_g.exp()[:, :, None] * (kc @ s))
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
            out[:, c] = log_g.exp()[:, :, None] * (qc @ s) + ((qc @ kc.transpose(1, 2))
                                                              * ratio) @ u
            tail = (log_g[:, -1:] - log_g).exp()[:, :, None]  # [Hv, L, 1] G_L / G_i
            s = log_g[:, -1].exp()[:, None, None] * s + (kc * tail).transpose(1, 2) @ u
        state.s = s
        return out.transpose(0, 1)

    def _verify(self, span: Span, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor
                ) -> torch.Tensor:
        """A verification span's rows (mixed [t, C], beta, g [t, Hv]) one by one through the
        decode recurrence -> o [t, Hv, Dv]; what it started from is kept for rewind()."""
        state = self._state(span, mixed.shape[1], mixed.device)
        replay = _Replay(state.pos, state.conv, state.s, mixed, beta, g)
        out = torch.cat([self._recur([state], mixed[r:r + 1], beta[r:r + 1], g[r:r + 1])
                         for r in range(mixed.shape[0])])
        state.replay = replay
        return out

    def _recur(self, states: list[State], mixed: torch.Tensor, beta: torch.Tensor,
               g: torch.Tensor) -> torch.Tensor:
        """One token of each of B sequences: mixed [B, C] (q|k|v before the conv), beta, g
        [B, Hv] -> o [B, Hv, Dv]; their states advanced."""
        window = torch.cat([torch.stack([st.conv for st in states]), mixed[:, None]], dim=1)
        q, k, v = self._qkv((window * self.conv).sum(dim=1))  # [B, Hv, Dk / Dv]
        s = torch.stack([st.s for st in states]) * g.exp()[..., None, None]  # [B, Hv, Dk, Dv]
        delta = (v - torch.einsum("bhk,bhkv->bhv", k, s)) * beta[..., None]
        s = s + k[..., None] * delta[..., None, :]
        o = torch.einsum("bhk,bhkv->bhv", q, s)
        for i, st in enumerate(states):
            st.conv, st.s, st.pos = window[i, 1:], s[i], st.pos + 1
        return o


def _l2(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the FLA library's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
