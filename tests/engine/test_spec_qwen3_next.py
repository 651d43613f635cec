"""Speculative decoding on Qwen3-Next's hybrid layers: the Gated DeltaNet's recurrent state per
sequence is rewound to the accepted prefix after every verification step, so greedy output is
the same as plain decoding's whatever the drafts (tiny random checkpoints written by
transformers' own Qwen3Next classes)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from services.engine.core import Engine
from services.engine.runner import ModelRunner
from services.engine.spec.base import DraftRequest, DraftSource
from tests.engine.test_batching import run_all
from tests.engine.test_model_families import make_family_checkpoint
from tests.engine.test_spec_engine import request

PROMPTS = ["The expert cache holds", "abcabcabc", "def f(x):\n    return", "a"]


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    model_dir, _ = make_family_checkpoint(tmp_path_factory.mktemp("q3n") / "qwen3_next",
                                          "qwen3_next", seed=3)
    return model_dir


def serve(model_dir, prompts, max_tokens=12, draft_source=None, spec_tokens=0,
          max_running=4, **runner_kwargs) -> list:
    runner = ModelRunner(model_dir, cache_slots=10**9, reserved_bytes=0, dtype="fp32",
                         **runner_kwargs)
    engine = Engine(runner, max_running=max_running, max_step_tokens=32,
                    draft_source=draft_source, spec_tokens=spec_tokens)
    engine.start()
    try:
        return run_all(engine, [request(p, max_tokens=max_tokens) for p in prompts])
    finally:
        engine.stop()


class MixedDraft(DraftSource):
    """Drafts from the plain greedy continuations: right for a while, then wrong, so that
    steps accept all, some and none of their drafts."""

    method = "mixed"

    def __init__(self, continuations: dict[tuple[int, ...], list[int]]):
        self.continuations = continuations  # prompt ids -> plain greedy tokens

    def propose(self, requests: Sequence[DraftRequest]) -> list[list[int]]:
        drafts = []
        for r in requests:
            want = self.continuations[tuple(r.token_ids[:r.prompt_len])]
            done = len(r.token_ids) - r.prompt_len
            right = want[done:done + r.max_tokens]
            keep = done % (r.max_tokens + 1)  # 0 .. max_tokens right, then one wrong
            draft = right[:keep] + [(t + 1) % 256 for t in right[keep:keep + 1]]
            drafts.append(draft[:r.max_tokens])
        return drafts


@pytest.mark.parametrize("max_running", [1, 4])
def test_rejected_drafts_rewind_the_linear_attention_state(qwen3_next_dir, max_running):
    """Drafts accepted in full, in part and not at all, alone and batched: the tokens plain
    decoding gives (a state left at a rejected draft would change every later token)."""
    plain = serve(qwen3_next_dir, PROMPTS)
    from services.engine.model.tokenizer import Tokenizer

    tok = Tokenizer(qwen3_next_dir)
    source = MixedDraft({tuple(tok.encode(p)): c.tokens for p, c in zip(PROMPTS, plain,
                                                                         strict=True)})
    spec = serve(qwen3_next_dir, PROMPTS, draft_source=source, spec_tokens=3,
                 max_running=max_running)
    assert [c.tokens for c in spec] == [c.tokens for c in plain]
    stats = [c.finished.stats for c in spec]
    proposed = sum(s.drafts_proposed for s in stats)
    accepted = sum(s.drafts_accepted for s in stats)
    assert 0 < accepted < proposed
