"""MTP drafts (services/engine/spec/mtp.py): greedy output identical with and without them (a
tiny checkpoint with a random head, and the shipped model with its trained head), the head's
file format, its hidden-state bookkeeping, and the refusal without a head."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.engine.block_manager import BlockManager, BlockTable
from services.engine.kernels.backend import TorchBackend
from services.engine.model.checkpoint import CheckpointReader, load_model_config
from services.engine.runner import ChunkWork
from services.engine.spec import draft_memory_bytes, make_draft_source
from services.engine.spec.base import DraftRequest
from services.engine.spec.mtp import MtpDraft
from services.engine.spec.mtp_head import (
    MTP_CONFIG_FILE,
    MTP_WEIGHTS_FILE,
    MtpConfig,
    MtpHead,
    has_mtp_head,
    load_mtp_head,
    save_mtp_head,
)
from services.models import default_model_dir
from tests.engine.test_spec_engine import (  # noqa: F401 - fixtures
    PROMPTS,
    assert_all_blocks_free,
    engine_factory,
    make_runner,
    plain_greedy,
    request,
    run_all,
)


def write_random_mtp_head(model_dir, seed: int = 0, window: int = 4) -> MtpHead:
    """A randomly initialised head for the checkpoint in model_dir, written beside it."""
    torch.manual_seed(seed)
    head = MtpHead(MtpConfig.for_model(load_model_config(model_dir), window=window))
    save_mtp_head(model_dir, head, {"note": "random, for tests"})
    return head


@pytest.fixture(scope="module")
def mtp_dir(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with a random MTP head (window 4: the window slides in the tests)."""
    path = tmp_path_factory.mktemp("mtp") / "tiny-mtp"
    shutil.copytree(tiny_dir, path)
    write_random_mtp_head(path)
    return path


def test_the_head_file_round_trips_beside_unchanged_main_weights(tiny_dir, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, path)
    assert not has_mtp_head(path)
    head = write_random_mtp_head(path, seed=3)
    assert has_mtp_head(path)
    meta = json.loads((path / MTP_CONFIG_FILE).read_text())
    assert meta["format"] == "strata-mtp" and meta["dtype"] == "bfloat16"
    assert meta["config"]["hidden_source"] == "pre_final_norm"
    loaded = load_mtp_head(path)
    assert loaded.config == head.config
    for name, want in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], want.to(torch.bfloat16).float()), name
    # The main checkpoint reads exactly as before: no mtp.* tensor, the same fingerprint.
    config = load_model_config(path)
    before, after = CheckpointReader(tiny_dir), CheckpointReader(path)
    assert not any(n.startswith("mtp.") for n in after.names)
    assert after.fingerprint(config) == before.fingerprint(config)
    assert draft_memory_bytes("mtp", None, path) == head.config.num_params() * 4
    assert head.config.num_params() == sum(p.numel() for p in head.parameters())


def test_mtp_refuses_clearly_without_a_head(tiny_dir):
    runner = make_runner(tiny_dir, 8)
    with pytest.raises(ValueError, match="no multi-token-prediction head.*train-mtp"):
        make_draft_source("mtp", runner=runner)
    with pytest.raises(ValueError, match="no multi-token-prediction head"):
        draft_memory_bytes("mtp", None, tiny_dir)
    assert runner.hidden_sink is None


def test_the_first_draft_is_the_head_on_the_main_models_last_hidden_state(mtp_dir):
    """d1 = lm_head(norm(head(h_{<n}, emb(x_{1..n}))[-1])) with h the main model's pre-norm
    hidden states of the prompt; rows of rejected drafts are never read."""
    runner = make_runner(mtp_dir, 8)
    source = make_draft_source("mtp", runner=runner)
    assert isinstance(source, MtpDraft) and source.draft_lookups == 0
    prompt = runner.tokenizer.encode("def add(a, b):\n    return")[:6]
    table = BlockTable()
    BlockManager(runner.kv.num_blocks, runner.kv.block_size).append(table, len(prompt) + 3)
    [(logits, _)] = runner.step([ChunkWork(prompt, 0, table.block_ids, True, True, seq_id=7)])
    hidden = runner.model.last_hidden.clone()  # [P, D]
    x_n = int(torch.argmax(logits))
    [[d1, d2]] = source.propose([DraftRequest(7, [*prompt, x_n], len(prompt), 2)])

    model, W = runner.model, source.head.config.window
    ids = torch.tensor([*prompt[1:], x_n])[-W:]
    g = source.head(hidden[None, -W:], model.embed[ids][None],
                    torch.arange(len(prompt) - W, len(prompt))[None])[0, -1]
    rms_norm = TorchBackend(torch.device("cpu")).rms_norm
    want = (rms_norm(g[None], model.final_norm, runner.config.rms_norm_eps)
            @ model.lm_head.t())[0]
    assert d1 == int(torch.argmax(want[: runner.num_usable_tokens]))

    # Verify [x_n, d1, d2], then pretend d1 was rejected: the d1/d2 rows must be dropped.
    runner.step([ChunkWork([x_n, d1, d2], len(prompt), table.block_ids, False, True,
                           num_draft=2, seq_id=7)])
    other = (d1 + 1) % runner.num_usable_tokens
    first, rows = source._context(DraftRequest(7, [*prompt, x_n, other], len(prompt), 2))
    assert first == len(prompt) + 1 - W and len(rows) == W
    assert torch.equal(rows[-1], runner.model.last_hidden[0])  # h at x_n, from the verify
    assert source._context(DraftRequest(7, [*prompt, other, 5], len(prompt), 2)) is None
    source.release(7)
    assert source._context(DraftRequest(7, [*prompt, x_n], len(prompt), 2)) is None


@pytest.mark.parametrize("spec_tokens", [1, 2, 4])
def test_mtp_greedy_is_identical_alone_and_batched(
    engine_factory, plain_greedy, mtp_dir, spec_tokens  # noqa: F811
):
    for max_running in (1, 8):
        runner = make_runner(mtp_dir, 8)
        source = make_draft_source("mtp", runner=runner)
        engine = engine_factory(spec_tokens, draft_source=source, runner=runner,
                                max_running=max_running)
        clients = run_all(engine, [request(p) for p in PROMPTS])
        assert [c.tokens for c in clients] == plain_greedy
        stats = [c.finished.stats for c in clients]
        assert sum(s.drafts_proposed for s in stats) > 0
        assert sum(s.draft_lookups for s in stats) == 0  # the head has no experts
        assert_all_blocks_free(engine)


@pytest.mark.skipif(not has_mtp_head(default_model_dir()), reason="no shipped MTP head")
def test_the_shipped_models_head_keeps_greedy_output_and_gets_drafts_accepted(engine_factory):  # noqa: F811
    model = default_model_dir()
    prompts = ["def read_lines(path):\n    with open(path) as f:\n",
               "class Stack:\n    def __init__(self):\n        self."]
    outputs = {}
    for k in (0, 2):
        runner = make_runner(model)
        source = make_draft_source("mtp", runner=runner) if k else None
        engine = engine_factory(k, draft_source=source, runner=runner, max_running=2)
        clients = run_all(engine, [request(p, max_tokens=24) for p in prompts])
        outputs[k] = [c.tokens for c in clients]
        if k:
            stats = [c.finished.stats for c in clients]
            accepted = sum(s.drafts_accepted for s in stats)
            assert accepted / sum(s.drafts_proposed for s in stats) > 0.2
    assert outputs[2] == outputs[0]
    assert (model / MTP_WEIGHTS_FILE).stat().st_size < 5 * 2**20


def test_the_engine_reserves_the_heads_memory_or_refuses_at_start(mtp_dir, tiny_dir):
    """`strata engine --spec-tokens 2 --spec-method mtp`: the head's bytes are reserved before
    the expert cache is sized; a checkpoint without a head is a ConfigError naming the flag."""
    from services.common.settings import ConfigError
    from services.engine.__main__ import _draft_bytes
    from services.engine.config import EngineConfig

    config = EngineConfig(model=str(mtp_dir), spec_tokens=2, spec_method="mtp")
    head = MtpConfig.for_model(load_model_config(mtp_dir), window=4)
    assert _draft_bytes(config, "cpu") == head.num_params() * 4
    with pytest.raises(ConfigError, match="--spec-method=mtp.*no multi-token-prediction head"):
        _draft_bytes(EngineConfig(model=str(tiny_dir), spec_tokens=2, spec_method="mtp"), "cpu")
