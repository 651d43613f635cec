"""ResourceSampler: machine figures every `interval_s` while a bench runs (a daemon thread).

CPU load and RAM always (psutil); the engine's resident memory when its pid is known; per GPU
utilisation, memory, power, temperature and SM clock through NVML (`pynvml`) when importable,
else `nvidia-smi` when on PATH, else none. Energy is the integral of power over the samples,
so J/token is known only where power is.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time
from typing import Any

import psutil

from services.bench.stats import median

_SMI_FIELDS = ("utilization.gpu", "memory.used", "memory.total", "power.draw",
               "temperature.gpu", "clocks.sm")
_SMI_KEYS = ("util_pct", "mem_used_mib", "mem_total_mib", "power_w", "temp_c", "sm_clock_mhz")


class _Nvml:
    def __init__(self) -> None:
        import pynvml  # optional: nvidia-ml-py

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                        for i in range(pynvml.nvmlDeviceGetCount())]

    def read(self) -> list[dict[str, float]]:
        nv, out = self.nv, []
        for h in self.handles:
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            out.append({"util_pct": nv.nvmlDeviceGetUtilizationRates(h).gpu,
                        "mem_used_mib": mem.used / 2**20, "mem_total_mib": mem.total / 2**20,
                        "power_w": nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                        "temp_c": nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                        "sm_clock_mhz": nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)})
        return out


class _Smi:
    def __init__(self, path: str) -> None:
        self.path = path
        self.read()  # fail now if it does not work

    def read(self) -> list[dict[str, float]]:
        text = subprocess.run([self.path, f"--query-gpu={','.join(_SMI_FIELDS)}",
                               "--format=csv,noheader,nounits"], capture_output=True,
                              text=True, timeout=5, check=True).stdout
        gpus = []
        for line in text.strip().splitlines():
            values = [v.strip() for v in line.split(",")]
            gpus.append({k: _number(v) for k, v in zip(_SMI_KEYS, values, strict=False)})
        return gpus


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _gpu_reader() -> _Nvml | _Smi | None:
    try:
        return _Nvml()
    except Exception:  # not installed, no driver, no device: all mean "no GPU figures"
        pass
    path = shutil.which("nvidia-smi")
    if path:
        try:
            return _Smi(path)
        except (OSError, subprocess.SubprocessError):
            return None
    return None


class ResourceSampler:
    def __init__(self, interval_s: float = 2.0, engine_pid: int | None = None):
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._engine = _process(engine_pid)
        self._gpu = _gpu_reader()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="strata-bench-sampler",
                                        daemon=True)
        self._t0 = 0.0

    def __enter__(self) -> ResourceSampler:
        self._t0 = time.perf_counter()
        psutil.cpu_percent(None)  # prime: the first call has no interval to measure
        time.sleep(0.05)  # the opening sample's CPU figure then covers 50 ms
        self.sample()  # an opening and a closing sample: a bench shorter than the interval
        self._thread.start()  # still has two points
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(self.interval_s + 6)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        mem = psutil.virtual_memory()
        row: dict[str, Any] = {"t_s": round(time.perf_counter() - self._t0, 3),
                               "cpu_pct": psutil.cpu_percent(None),
                               "load_1m": psutil.getloadavg()[0],
                               "ram_used_mib": round((mem.total - mem.available) / 2**20, 1),
                               "ram_total_mib": round(mem.total / 2**20, 1)}
        if self._engine is not None:
            try:
                row["engine_rss_mib"] = round(self._engine.memory_info().rss / 2**20, 2)
            except psutil.Error:
                self._engine = None
        if self._gpu is not None:
            try:
                row["gpus"] = self._gpu.read()
            except Exception as exc:  # a driver hiccup must not end the bench
                row["gpu_error"] = f"{type(exc).__name__}: {exc}"
        self.samples.append(row)

    def summary(self, tokens_generated: int | None = None) -> dict[str, Any]:
        s = self.samples
        out: dict[str, Any] = {"interval_s": self.interval_s, "num_samples": len(s),
                               "gpu": "none" if self._gpu is None else type(self._gpu).__name__,
                               "cpu_pct_p50": median([r["cpu_pct"] for r in s]),
                               "load_1m_max": max((r["load_1m"] for r in s), default=None),
                               "ram_used_mib_max": max((r["ram_used_mib"] for r in s),
                                                       default=None)}
        rss = [r["engine_rss_mib"] for r in s if "engine_rss_mib" in r]
        if rss:
            out.update(engine_rss_mib_first=rss[0], engine_rss_mib_last=rss[-1],
                       engine_rss_mib_max=max(rss))
        energy = self.energy_j()
        out["energy_j"] = energy
        out["j_per_token"] = (energy / tokens_generated
                              if energy is not None and tokens_generated else None)
        return out

    def energy_j(self) -> float | None:
        """Trapezoid integral of the summed GPU power over the samples; None without power."""
        points = [(r["t_s"], sum(g.get("power_w") or 0.0 for g in r["gpus"]))
                  for r in self.samples if r.get("gpus")]
        if len(points) < 2:
            return None
        return sum((t1 - t0) * (p0 + p1) / 2 for (t0, p0), (t1, p1) in zip(points, points[1:], strict=False))


def _process(pid: int | None) -> psutil.Process | None:
    if not pid:
        return None
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None
