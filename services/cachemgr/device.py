"""Device figures: NVML (nvidia-ml-py) when an NVIDIA GPU is present, host figures (psutil) else.

    GPU:  memory total/used/free, utilisation, power, temperature, SM clock, energy counter
    CPU:  host RAM as "device" memory (the engine's slot pool lives there; the configured budget
          stands in for free VRAM), CPU utilisation and clock; no power, so no J/token

Energy per token: the energy the device used over a window (NVML's energy counter where the GPU
has one, else power samples integrated over time) divided by the tokens engines reported in it.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import logging
import os
import platform
import time
from dataclasses import dataclass
from typing import Any

import psutil

log = logging.getLogger("strata.cachemgr")


@dataclass(frozen=True)
class DeviceMemory:
    kind: str  # "cuda:0" or "host"
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class DeviceSample:
    kind: str  # "cuda:0" or "host"
    name: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    utilization: float | None = None  # 0..1
    power_w: float | None = None
    temperature_c: float | None = None
    sm_clock_hz: float | None = None
    energy_j: float | None = None  # cumulative, since an arbitrary origin

    @property
    def memory(self) -> DeviceMemory:
        return DeviceMemory(self.kind, self.total_bytes, self.free_bytes)


@functools.cache
def load_nvml() -> Any | None:
    """The initialised pynvml module with at least one GPU, else None (logged once)."""
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")):
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() < 1:
            return None
        return pynvml
    except ImportError:
        log.warning("NVIDIA driver present but nvidia-ml-py is not installed; reporting host "
                    "figures as device figures")
    except Exception as exc:  # pynvml.NVMLError and friends
        log.warning("NVML unusable (%s); reporting host figures as device figures", exc)
    return None


def _optional(read: Any) -> float | None:
    try:
        return float(read())
    except Exception:  # not supported on this GPU, or a transient NVML error
        return None


class DeviceMonitor:
    """Samples one device. `nvml` is the pynvml module (None: host figures); tests pass a fake."""

    def __init__(self, nvml: Any | None = None, index: int = 0) -> None:
        self.nvml = nvml
        self.kind = f"cuda:{index}" if nvml is not None else "host"
        self._handle = nvml.nvmlDeviceGetHandleByIndex(index) if nvml is not None else None
        self.name = self._device_name()
        self._energy_j = 0.0  # integrated from power samples when there is no energy counter
        self._last: tuple[float, float] | None = None  # (time_s, power_w) of the last sample
        self._counter_origin_mj: float | None = None
        self.latest: DeviceSample | None = None

    @classmethod
    def detect(cls) -> DeviceMonitor:
        return cls(load_nvml())

    def _device_name(self) -> str:
        if self.nvml is None:
            return platform.processor() or platform.machine() or "host"
        name = self.nvml.nvmlDeviceGetName(self._handle)
        return name.decode() if isinstance(name, bytes) else str(name)

    def sample(self, now_s: float | None = None) -> DeviceSample:
        now_s = time.monotonic() if now_s is None else now_s
        sample = self._sample_gpu(now_s) if self.nvml is not None else self._sample_host()
        self.latest = sample
        return sample

    def _sample_gpu(self, now_s: float) -> DeviceSample:
        nvml, h = self.nvml, self._handle
        memory = nvml.nvmlDeviceGetMemoryInfo(h)
        util = _optional(lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        power_w = _optional(lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000)  # mW
        temperature = _optional(lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        clock = _optional(lambda: nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM))  # MHz
        counter_mj = _optional(lambda: nvml.nvmlDeviceGetTotalEnergyConsumption(h))
        if counter_mj is not None:  # Volta and later: an exact counter
            if self._counter_origin_mj is None:
                self._counter_origin_mj = counter_mj
            energy_j = (counter_mj - self._counter_origin_mj) / 1000
        else:
            energy_j = self._integrate(now_s, power_w)
        return DeviceSample(self.kind, self.name, int(memory.total), int(memory.used),
                            int(memory.free), None if util is None else util / 100, power_w,
                            temperature, None if clock is None else clock * 1e6, energy_j)

    def _integrate(self, now_s: float, power_w: float | None) -> float | None:
        if power_w is None:
            return None
        if self._last is not None:
            last_s, last_w = self._last
            self._energy_j += (now_s - last_s) * (last_w + power_w) / 2  # trapezoid
        self._last = (now_s, power_w)
        return self._energy_j

    def _sample_host(self) -> DeviceSample:
        memory = psutil.virtual_memory()
        freq = _optional(lambda: psutil.cpu_freq().current)  # MHz; None where unknown
        return DeviceSample("host", self.name, int(memory.total), int(memory.total - memory.available),
                            int(memory.available), psutil.cpu_percent(interval=None) / 100,
                            sm_clock_hz=None if freq is None else freq * 1e6)


class EnergyMeter:
    """Joules per generated token over a sliding window of (time, energy, tokens) samples."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self._samples: collections.deque[tuple[float, float, int]] = collections.deque()

    def add(self, now_s: float, energy_j: float | None, tokens: int) -> None:
        if energy_j is None:
            return
        self._samples.append((now_s, energy_j, tokens))
        # Keep one sample at or before the window's start, so the window spans window_s.
        while len(self._samples) > 2 and self._samples[1][0] <= now_s - self.window_s:
            self._samples.popleft()

    def joules_per_token(self) -> float | None:
        """None until tokens were produced within the window (or without an energy reading)."""
        if len(self._samples) < 2:
            return None
        (_, e0, t0), (_, e1, t1) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return None
        return (e1 - e0) / (t1 - t0)


@functools.cache
def _torch_cuda_available() -> bool:
    # Only without NVML. Importing torch costs seconds; skip it where no driver is loaded.
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")):
        return False
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    try:
        return bool(torch.cuda.is_available())
    except RuntimeError as exc:
        log.warning("CUDA present but unusable (%s); reporting host RAM as device memory", exc)
        return False


def read_device_memory() -> DeviceMemory:
    """Free and total memory of GPU 0 (NVML, else torch), or of host RAM without a GPU."""
    nvml = load_nvml()
    if nvml is not None:
        memory = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(0))
        return DeviceMemory("cuda:0", int(memory.total), int(memory.free))
    if _torch_cuda_available():
        import torch

        free_bytes, total_bytes = torch.cuda.mem_get_info(0)
        return DeviceMemory("cuda:0", int(total_bytes), int(free_bytes))
    memory = psutil.virtual_memory()
    return DeviceMemory("host", int(memory.total), int(memory.available))
