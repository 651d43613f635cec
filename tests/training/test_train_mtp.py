"""`strata model train-mtp` on the tiny trained checkpoint: deterministic, leaves the main weights
alone, and reads the same pre-final-norm hidden states the engine hands its MTP source."""

from __future__ import annotations

import json
import shutil

import torch

from services.engine.block_manager import BlockManager, BlockTable
from services.engine.runner import ChunkWork, ModelRunner
from services.engine.spec.mtp_head import MTP_CONFIG_FILE, MTP_WEIGHTS_FILE, load_mtp_head
from services.training.mtp import hidden_states, load_frozen, main

ARGS = ["--steps", "3", "--batch", "2", "--context", "16", "--corpus-max-bytes", "30000",
        "--eval-tokens", "128", "--threads", "1", "--mlp", "32", "--window", "4", "--json"]


def test_train_mtp_is_deterministic_and_writes_only_the_head(tiny_run, tmp_path, capsys):
    source, _ = tiny_run
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        shutil.copytree(source, d)
        assert main(["--model", str(d), *ARGS]) == 0
    summary = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert summary["steps"] == 3 and 0.0 <= summary["heldout"]["accuracy"] <= 1.0
    assert summary["heldout"]["loss"] > 0 and summary["command"].startswith("strata model")
    a, b = ((d / MTP_WEIGHTS_FILE).read_bytes() for d in dirs)
    assert a == b  # same seed, same threads: the same head
    assert (dirs[0] / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    meta = json.loads((dirs[0] / MTP_CONFIG_FILE).read_text())
    assert meta["config"]["window"] == 4 and meta["training"]["heldout"] == summary["heldout"]
    assert load_mtp_head(dirs[0]).config.intermediate_size == 32


def test_training_and_engine_read_the_same_hidden_state(tiny_run):
    model_dir, _ = tiny_run
    runner = ModelRunner(model_dir, device_memory_bytes=10**9, reserved_bytes=0)
    ids = runner.tokenizer.encode("def f(x):\n    return x + 1\n")
    table = BlockTable()
    BlockManager(runner.kv.num_blocks, runner.kv.block_size).append(table, len(ids))
    runner.step([ChunkWork(ids, 0, table.block_ids, True, True)])
    want = hidden_states(load_frozen(model_dir), torch.tensor([ids]))[0]  # [T, D]
    torch.testing.assert_close(runner.model.last_hidden, want, atol=2e-4, rtol=2e-4)
