"""Acceptance of draft tokens from one verification forward: logits [k+1, V] for the positions
of [last token, d1 .. dk]; row i is the model's distribution of the token after d_i (row 0:
after the last token).

    greedy:  keep d_i while it is row i-1's argmax; then row j's argmax (j = drafts kept) is one
             more token, so a step emits 1..k+1 tokens, exactly the tokens plain decoding gives.
    sampled: speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023). Draft d_i
             with draft probability q(d_i) is kept with probability min(1, p(d_i) / q(d_i)), p =
             the target distribution after temperature / top-k / top-p; at the first rejection
             the token is drawn from max(p - q, 0) normalized; with every draft kept one more is
             drawn from row k. A deterministic source (q a point mass on d_i, `draft_probs`
             None) keeps d_i with probability p(d_i) and otherwise draws from p without d_i.
             Each emitted token is then distributed exactly as plain sampling would draw it.

Shape legend: k drafts, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.engine.sampling import Sampler, argmax_ids


def accept_tokens(
    sampler: Sampler,
    logits: torch.Tensor,
    draft: Sequence[int],
    draft_probs: torch.Tensor | None = None,
) -> list[int]:
    """logits [k+1, V] (fp32), draft [k], draft_probs [k, V] or None -> the emitted tokens:
    the kept drafts, then one token from the target (1 .. k+1 tokens in all)."""
    k = len(draft)
    assert logits.shape[0] == k + 1, (logits.shape, k)
    if sampler.cfg.greedy:
        targets = argmax_ids(sampler.process(logits))  # [k+1]
        kept = 0
        while kept < k and targets[kept] == draft[kept]:
            kept += 1
        return [*draft[:kept], targets[kept]]
    out: list[int] = []
    for i, d in enumerate(draft):
        p = sampler.probs(logits[i], row=i)  # [V]
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if sampler.uniform() * q_d < float(p[d]):  # u < p(d) / q(d), without dividing by 0
            out.append(int(d))
            continue
        residual = p.clone()
        if draft_probs is None:
            residual[d] = 0.0
        else:
            residual = torch.clamp(p - draft_probs[i].float().cpu(), min=0.0)
        total = float(residual.sum())
        out.append(sampler.draw(residual / total if total > 0 else p))  # p == q: nothing left
        return out
    out.append(sampler.draw(sampler.probs(logits[k], row=k)))
    return out
