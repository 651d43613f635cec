"""Miss placement: the cost model's crossover, the modes and their reasons, the link probe line."""

from __future__ import annotations

import re

import pytest
import torch

from services.engine.cache.layout import ExpertLayout
from services.engine.cache.placement import (
    CostModel,
    ExpertTiming,
    Placer,
    probe_link,
    time_expert,
)

SLOT = 4 * 2**20  # 4 MiB slot


def cost(host_per_token_s=10e-6, device_per_token_s=1e-6, link=10e9) -> CostModel:
    # copy: 0.42 ms for the slot + 10 us + 1 us/token; host: 20 us + 10 us/token
    return CostModel(SLOT, link, ExpertTiming(20e-6, host_per_token_s),
                     ExpertTiming(10e-6, device_per_token_s))


def test_cost_model_crossover():
    c = cost()
    crossover = c.host_below_tokens  # (419.4 + 10 - 20) us / 9 us per token ~ 45.5 tokens
    assert 45 < crossover < 46
    assert c.host_s(45) < c.copy_s(45) and c.host_s(46) > c.copy_s(46)
    placer = Placer("auto", c, host_exact=False)
    assert placer.choose(1) == ("host", "host:cheaper")
    assert placer.choose(64) == ("copy", "copy:cheaper")
    # CPU: the "device" is the host, so copying first never pays
    same = CostModel(SLOT, 10e9, ExpertTiming(20e-6, 10e-6), ExpertTiming(20e-6, 10e-6))
    assert same.host_below_tokens == float("inf")
    assert Placer("exact", same, host_exact=True).choose(10_000) == ("host", "host:cheaper")


def test_modes_and_reasons():
    c = cost()
    assert Placer("exact", c, host_exact=False).choose(1) == ("copy", "copy:exact")
    assert Placer("host", c, host_exact=False).choose(500) == ("host", "host:forced")
    assert Placer("copy", None, host_exact=True).choose(1) == ("copy", "copy:forced")
    with pytest.raises(ValueError, match="placement"):
        Placer("sometimes", c, host_exact=True)
    assert "host below 45.5 tokens" in Placer("auto", c, host_exact=False).describe()
    assert "every miss copy (copy:exact)" in Placer("exact", c, host_exact=False).describe()


def test_probe_and_expert_timing_on_cpu():
    probe = probe_link(torch.device("cpu"), num_bytes=2**20, tries=4)
    assert probe.kind == "memcpy" and len(probe.samples_gb_s) == 4
    assert probe.bytes_per_s == max(probe.samples_gb_s) * 1e9 > 0
    assert re.fullmatch(r"PCIe probe: [\d.]+ GB/s host->device \(best of( [\d.]+){4}\) "
                        r"\[no link on CPU: host memcpy\]", probe.log_line())
    layout = ExpertLayout(32, 16)
    timing = time_expert(layout, torch.randn(layout.numel), tries=2)
    assert timing.fixed_s >= 0 and timing.per_token_s >= 0 and timing.tokens_per_s > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_probe_on_cuda_reads_the_link():
    probe = probe_link(torch.device("cuda"), tries=4)
    assert probe.kind == "pcie" and probe.bytes_per_s > 1e9
    assert "[no link" not in probe.log_line()
