"""Speculative decoding: draft sources propose tokens; one forward over k+1 positions verifies
them, so each routed expert is fetched once per step for all of them (base.py: the contract;
ngram.py: prompt lookup; draft_model.py: a separate small model; mtp.py: the checkpoint's
multi-token-prediction head, mtp_head.py its format; verify.py: acceptance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.engine.spec.base import SPEC_METHODS, DraftRequest, DraftSource

__all__ = [
    "SPEC_METHODS",
    "DraftRequest",
    "DraftSource",
    "draft_memory_bytes",
    "make_draft_source",
]


def draft_memory_bytes(
    method: str,
    draft_model: str | Path | None = None,
    model_dir: str | Path | None = None,
    device: str = "cuda",
) -> int:
    """Device memory the method's source will take, known before anything is loaded (the
    target's expert cache is sized around it); ValueError when the method cannot run.
    `model_dir`: the target's checkpoint (where an MTP head lives)."""
    if method == "mtp":
        if model_dir is None:
            raise ValueError("the checkpoint has no multi-token-prediction head")
        from services.engine.spec.checkpoint_mtp import checkpoint_mtp_bytes, has_checkpoint_mtp
        from services.engine.spec.mtp import mtp_head_bytes

        if has_checkpoint_mtp(model_dir):  # its own MTP layer (checkpoint_mtp.py's families)
            return checkpoint_mtp_bytes(model_dir, device=device)

        return mtp_head_bytes(model_dir)  # ValueError: no head
    if method == "draft":
        if not draft_model:
            raise ValueError("a draft model checkpoint is needed (--spec-draft-model)")
        from services.engine.spec.draft_model import draft_model_bytes

        return draft_model_bytes(Path(draft_model))
    return 0


def make_draft_source(
    method: str,
    *,
    draft_model: str | Path | None = None,
    device: str = "cpu",
    tokenizer: Any = None,
    runner: Any = None,
) -> DraftSource:
    """The draft source for `--spec-method`; ValueError (naming what is missing) when the
    method cannot run with this checkpoint. `tokenizer`: the target's, which a draft model
    must share; `runner`: the target's ModelRunner (an MTP head reads its hidden states)."""
    if method == "ngram":
        from services.engine.spec.ngram import NgramDraft

        return NgramDraft()
    if method == "mtp":
        if runner is None:
            raise ValueError("the checkpoint has no multi-token-prediction head")
        from services.engine.spec.checkpoint_mtp import CheckpointMtp, has_checkpoint_mtp
        from services.engine.spec.mtp import MtpDraft

        if has_checkpoint_mtp(runner.model_dir):  # the checkpoint's own layer before a trained head
            return CheckpointMtp(runner)
        return MtpDraft.load(runner)  # ValueError naming the file when there is no head
    if method == "draft":
        if not draft_model:
            raise ValueError("a draft model checkpoint is needed (--spec-draft-model)")
        from services.engine.spec.draft_model import DraftModel

        source = DraftModel.load(Path(draft_model), device)
        if tokenizer is not None:
            source.check_tokenizer(tokenizer)
        return source
    raise ValueError(f"unknown speculation method {method!r}; one of {', '.join(SPEC_METHODS)}")
