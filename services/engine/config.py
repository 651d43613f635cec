"""Engine settings: flags and STRATA_* variables, declared once."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.settings import (
    Setting,
    non_negative_int,
    optional_str,
    parse_bytes,
)

DEFAULT_CPU_DEVICE_MEMORY = 768 * 2**20


def _device(text: str) -> str:
    if text not in {"auto", "cpu", "cuda"} and not text.startswith("cuda:"):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return text


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


SETTINGS = (
    Setting("model", "STRATA_MODEL", optional_str, None,
            "checkpoint directory (default: the built-in demo model, created on first use)"),
    Setting("host", "STRATA_ENGINE_HOST", str, "127.0.0.1", "gRPC bind address"),
    Setting("port", "STRATA_ENGINE_PORT", non_negative_int, 50051, "gRPC port (0 = any free port)"),
    Setting("engine_id", "STRATA_ENGINE_ID", optional_str, None,
            "name in logs, metrics and the registry (default: host:port)"),
    Setting("device", "STRATA_DEVICE", _device, "auto", "auto, cpu, cuda or cuda:N"),
    Setting("device_memory", "STRATA_DEVICE_MEMORY", parse_bytes, None,
            "device memory budget for the engine (default: free VRAM on CUDA, 768MiB on CPU)"),
    Setting("reserve", "STRATA_RESERVE", parse_bytes, 700 * 2**20,
            "device memory kept out of the expert cache (activations, KV, workspace)"),
    Setting("cachemgr", "STRATA_CACHEMGR_ADDR", optional_str, None,
            "cache manager gRPC address host:port (default: none, plan locally)"),
    Setting("profile", "STRATA_PROFILE", optional_str, None,
            "expert-profile.bin used to pre-fill the cache when no cache manager is set"),
    Setting("report_interval_s", "STRATA_REPORT_INTERVAL_S", _positive_float, 2.0,
            "seconds between routing reports to the cache manager"),
)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 50051
    engine_id: str | None = None
    device: str = "auto"
    device_memory: int | None = None
    reserve: int = 700 * 2**20
    cachemgr: str | None = None
    profile: str | None = None
    report_interval_s: float = 2.0

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> EngineConfig:
        return cls(**values)

    @property
    def model_dir(self) -> Path:
        if self.model:
            return Path(self.model).expanduser()
        from services.engine.model.demo import ensure_default_model

        return ensure_default_model()

    def resolved_engine_id(self, bound_port: int) -> str:
        return self.engine_id or f"{socket.gethostname()}:{bound_port}"
