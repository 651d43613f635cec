"""Cache manager settings: each is a flag and a `STRATA_*` variable (see services.common.settings)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.settings import Setting, non_negative_int, parse_bytes


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port, 0..65535 (0 = any free port)")
    return value


def _redis_url(text: str) -> str | None:
    if not text:
        return None
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError("must start with redis://, rediss:// or unix:// "
                         "(e.g. redis://127.0.0.1:6379/0)")
    return text


def _optional_path(text: str) -> Path | None:
    return Path(text) if text else None


def _optional_bytes(text: str) -> int | None:
    return parse_bytes(text) if text else None


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "STRATA_CACHEMGR_HOST", str, "127.0.0.1",
            "address the cache manager's gRPC server binds"),
    Setting("port", "STRATA_CACHEMGR_PORT", _port, 50061,
            "gRPC port of the cache manager (0 = any free port)"),
    Setting("metrics_port", "STRATA_METRICS_PORT", non_negative_int, 9464,
            "Prometheus scrape port for /metrics (0 disables it)"),
    Setting("redis_url", "STRATA_REDIS_URL", _redis_url, None,
            "Redis holding routing counts shared by cache managers (empty = in memory only)"),
    Setting("profile_path", "STRATA_PROFILE", _optional_path, None,
            "expert-profile.bin ranking pairs until routing counts arrive", flag="--profile"),
    Setting("reserve_bytes", "STRATA_RESERVE", parse_bytes, "700MiB",
            "device memory kept out of the expert cache when an engine does not say",
            flag="--reserve"),
    Setting("device_memory_bytes", "STRATA_DEVICE_MEMORY", _optional_bytes, None,
            "device memory budget when an engine does not say (default: free device memory)",
            flag="--device-memory"),
)


@dataclass(frozen=True)
class CacheMgrConfig:
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 9464  # 0 = no Prometheus endpoint
    redis_url: str | None = None
    profile_path: Path | None = None
    reserve_bytes: int = 700 * 2**20
    device_memory_bytes: int | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> CacheMgrConfig:
        """From `resolve(SETTINGS, args)`; settings left out take their defaults."""
        merged = {s.name: s.default for s in SETTINGS} | dict(values)
        merged["reserve_bytes"] = parse_bytes(merged["reserve_bytes"])  # default is "700MiB"
        return cls(**{name: merged[name] for name in cls.__dataclass_fields__})
