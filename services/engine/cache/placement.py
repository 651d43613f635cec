"""Miss placement: run a missed expert on the host, or copy its blob over the link and run it on
the device — whichever the cost model says is sooner, within the exactness setting.

    host_s(n) = host.fixed_s + host.per_token_s * n  (+ moving n activations both ways on CUDA)
    copy_s(n) = slot_bytes / link_bytes_per_s + device.fixed_s + device.per_token_s * n

Both terms are measured at start-up: a link probe (pinned host -> device copies on CUDA; a host
memcpy on CPU, where "the device" is the host) and timed runs of one expert on 1 and 16 tokens.
Since both costs are linear in n, the choice reduces to one crossover: the host below it.

Placement modes (`--placement`):
  exact  only placements bit-identical to a hit. Where "host" runs the same kernel on the
         same bytes — the CPU kernels on CPU, the device kernel reading the pinned host store
         over the link on CUDA (services.engine.kernels.gpu_moe) — both are, so the cost model
         decides; otherwise (CUDA without Triton, quantized experts) every miss is copied (a
         host matmul can differ from the device's in the last bits, and greedy tokens could
         then drift), and a miss the host would have run sooner waits for its copy.
  auto   the cost model over both placements (fastest; last-bit differences possible where
         "host" is the CPU computing for a CUDA device)
  host   every miss on the host;  copy: every miss copied to the device
Reasons are counted per missed pair as "<placement>:<why>", why in cheaper | exact | forced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.cache.formats import device_kernel
from services.engine.cache.moe_compute import CpuMoe, Placed, moe_compute

if TYPE_CHECKING:
    from services.engine.cache.formats import ExpertFormat
    from services.engine.cache.host_store import HostStore
    from services.engine.kernels import CpuKernels

log = logging.getLogger("strata.engine")

PLACEMENTS = ("exact", "auto", "host", "copy")
DEFAULT_PLACEMENT = "exact"


@dataclass(frozen=True)
class LinkProbe:
    bytes_per_s: float  # best of the samples
    samples_gb_s: tuple[float, ...]
    kind: str  # "pcie" (host -> CUDA device) or "memcpy" (CPU: host -> host)

    def log_line(self) -> str:
        samples = " ".join(f"{s:.1f}" for s in self.samples_gb_s)
        note = "" if self.kind == "pcie" else " [no link on CPU: host memcpy]"
        return (f"PCIe probe: {self.bytes_per_s / 1e9:.1f} GB/s host->device "
                f"(best of {samples}){note}")


def probe_link(device: torch.device, num_bytes: int | None = None, tries: int = 4) -> LinkProbe:
    """Time `tries` copies of a host buffer to `device`; the best is the link's speed."""
    on_cuda = device.type == "cuda"
    num_bytes = num_bytes or (256 if on_cuda else 8) * 2**20
    src = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=on_cuda)
    src.fill_(1)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst.copy_(src)  # warm-up (allocations, page faults)
    samples = []
    for _ in range(tries):
        if on_cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=on_cuda)
        if on_cuda:
            torch.cuda.synchronize(device)
        samples.append(num_bytes / max(time.perf_counter() - t0, 1e-9) / 1e9)
    return LinkProbe(max(samples) * 1e9, tuple(samples), "pcie" if on_cuda else "memcpy")


@dataclass(frozen=True)
class ExpertTiming:
    """Seconds to run one expert on n tokens: fixed_s + per_token_s * n."""

    fixed_s: float
    per_token_s: float

    def seconds(self, num_tokens: int) -> float:
        return self.fixed_s + self.per_token_s * num_tokens

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.seconds(1)


def time_expert(fmt: ExpertFormat, blob: torch.Tensor, tries: int = 5,
                dtype: torch.dtype | None = None, device: torch.device | None = None,
                forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                ) -> ExpertTiming:
    """Time one expert in `blob`'s place (host or device) on 1 and 16 tokens of `dtype`
    (default: the blob's; a quantized blob is bytes) on `device` (default: the blob's), run by
    `forward(x, blob)` (default: the format's): the best of `tries` rounds of several runs
    each (a short run is easily disturbed)."""
    device = device or blob.device
    forward = forward or fmt.forward
    on_cuda = device.type == "cuda"
    best = {}
    for n, runs in ((1, 16), (16, 4)):
        x = torch.randn(n, fmt.hidden_size, dtype=dtype or blob.dtype, device=device)
        forward(x, blob)  # warm-up
        times = []
        for _ in range(tries):
            if on_cuda:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(runs):
                forward(x, blob)
            if on_cuda:
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - t0) / runs)
        best[n] = min(times)
    per_token = max(0.0, (best[16] - best[1]) / 15)
    return ExpertTiming(max(0.0, best[1] - per_token), per_token)


@dataclass(frozen=True)
class CostModel:
    slot_bytes: int
    link_bytes_per_s: float
    host: ExpertTiming
    device: ExpertTiming
    activation_s: float = 0.0  # moving a token's activations to the host and back (CUDA)

    def host_s(self, num_tokens: int) -> float:
        return self.host.seconds(num_tokens) + self.activation_s

    def copy_s(self, num_tokens: int) -> float:
        return self.slot_bytes / self.link_bytes_per_s + self.device.seconds(num_tokens)

    @property
    def host_below_tokens(self) -> float:
        """The crossover: misses with fewer tokens than this are sooner on the host."""
        slope = self.host.per_token_s - self.device.per_token_s
        gap = self.copy_s(0) - self.host_s(0)
        if slope <= 0:
            return float("inf") if gap > 0 else 0.0
        return max(0.0, gap / slope)


class Placer:
    """Chooses each miss's placement; `choose(n)` -> ("host" | "copy", reason)."""

    def __init__(self, mode: str, cost: CostModel | None, host_exact: bool):
        """host_exact: whether a miss placed on the host gives the bits of a hit."""
        if mode not in PLACEMENTS:
            raise ValueError(f"unknown placement {mode!r} (choose from {PLACEMENTS})")
        assert cost is not None or mode in ("host", "copy") or (mode == "exact" and not host_exact)
        self.mode = mode
        self.cost = cost
        self.host_exact = host_exact
        self._fixed: tuple[str, str] | None = None
        if mode in ("host", "copy"):
            self._fixed = (mode, f"{mode}:forced")
        elif mode == "exact" and not host_exact:
            self._fixed = ("copy", "copy:exact")

    def choose(self, num_tokens: int) -> tuple[str, str]:
        if self._fixed is not None:
            return self._fixed
        assert self.cost is not None
        if num_tokens < self.cost.host_below_tokens:
            return "host", "host:cheaper"
        return "copy", "copy:cheaper"

    def describe(self) -> str:
        if self.cost is None:
            return f"placement {self.mode}: {self._fixed[0] if self._fixed else '?'} for every miss"
        c = self.cost
        text = (f"placement {self.mode}: host {c.host.fixed_s * 1e3:.3f} ms + "
                f"{c.host.per_token_s * 1e3:.4f} ms/token ({c.host.tokens_per_s:.0f} tokens/s "
                f"for one expert), copy {c.slot_bytes / c.link_bytes_per_s * 1e3:.3f} ms/slot "
                f"+ device {c.device.fixed_s * 1e3:.3f} ms + {c.device.per_token_s * 1e3:.4f} "
                f"ms/token")
        if self._fixed is not None:
            return f"{text} -> every miss {self._fixed[0]} ({self._fixed[1]})"
        return f"{text} -> host below {c.host_below_tokens:.1f} tokens per expert, else copy"


def measure_cost_model(fmt: ExpertFormat, host: HostStore, link: LinkProbe,
                       device: torch.device, dtype: torch.dtype,
                       cpu_kernels: CpuKernels | None = None) -> CostModel:
    """Measured host and device expert speeds (the same on CPU) for miss placement. On
    CUDA with the device kernel, "host" is that kernel reading the pinned host blob in place
    over the link; without it, the CPU computing (and the activations' round trip). On the
    CPU the expert is timed in what computes it there: the C kernel where the format has one,
    else the format's torch ops."""
    pair = host.pairs[0]
    if device.type == "cpu":
        compute = moe_compute(fmt, device, 1, cpu_kernels)
        if isinstance(compute, CpuMoe):
            timing = time_expert(fmt.at(pair[0]), host.blob(pair), dtype=dtype,
                                 forward=_one_expert(compute, pair[0]))
            _log_host_timing(timing)
            return CostModel(fmt.blob_bytes, link.bytes_per_s, timing, timing)
    fmt = fmt.at(pair[0])  # the timed pair's layer (block types may differ by layer)
    gpu = device_kernel(fmt, device)
    if gpu is not None:
        weights = gpu.Weights.of(fmt)

        def forward(x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
            return gpu.expert_forward(x, blob, fmt.ffn_size, weights)

        host_timing = time_expert(fmt, host.blob(pair), dtype=dtype,
                                  device=device, forward=forward)
        device_timing = time_expert(fmt, host.blob(pair).to(device),
                                    dtype=dtype, forward=forward)
        log.info("device kernel on one expert: %.3f ms from a slot, %.3f ms read in place "
                 "from the host store (1 token)", device_timing.seconds(1) * 1e3,
                 host_timing.seconds(1) * 1e3)
        return CostModel(fmt.blob_bytes, link.bytes_per_s, host_timing, device_timing)
    host_timing = time_expert(fmt, host.blob(pair), dtype=dtype)
    device_timing, activation_s = host_timing, 0.0
    if device.type == "cuda":
        device_timing = time_expert(fmt, host.blob(pair).to(device), dtype=dtype)
        x = torch.zeros(1, fmt.hidden_size, dtype=dtype, device=device)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(5):
            x = x.cpu().to(device)
        torch.cuda.synchronize(device)
        activation_s = (time.perf_counter() - t0) / 5
    _log_host_timing(host_timing)
    return CostModel(fmt.blob_bytes, link.bytes_per_s, host_timing, device_timing,
                     activation_s)


def _one_expert(compute: CpuMoe, layer: int) -> Callable[[torch.Tensor, torch.Tensor],
                                                          torch.Tensor]:
    """forward(x [n, D], blob) through the C kernel: every row routed to the one expert."""
    def forward(x: torch.Tensor, blob: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return compute(x, torch.zeros(n, 1, dtype=torch.long), torch.ones(n, 1, dtype=x.dtype),
                       Placed({0: blob}, layer=layer))
    return forward


def _log_host_timing(timing: ExpertTiming) -> None:
    log.info("host expert throughput: %.0f tokens/s for one expert at 1 token (%.3f ms), "
             "%.0f tokens/s at 16 tokens", timing.tokens_per_s, timing.seconds(1) * 1e3,
             16 / timing.seconds(16))
