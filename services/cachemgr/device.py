"""Device memory figures: free/total VRAM from CUDA when present, host RAM otherwise.

On a CPU-only host the "device" is host RAM (the engine's slot pool lives there) and the budget
an operator configures stands in for free VRAM.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import psutil

log = logging.getLogger("strata.cachemgr")


@dataclass(frozen=True)
class DeviceMemory:
    kind: str  # "cuda:0" or "host"
    total_bytes: int
    free_bytes: int


@functools.cache
def _cuda_available() -> bool:
    # Importing torch costs seconds; skip it where no NVIDIA driver is loaded.
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
    """Free and total memory of CUDA device 0, or of host RAM when there is no CUDA device."""
    if _cuda_available():
        import torch

        free_bytes, total_bytes = torch.cuda.mem_get_info(0)
        return DeviceMemory("cuda:0", int(total_bytes), int(free_bytes))
    memory = psutil.virtual_memory()
    return DeviceMemory("host", int(memory.total), int(memory.available))
