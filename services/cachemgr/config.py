"""Cache manager settings: each is a flag and a `STRATA_*` variable (see services.common.settings)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.settings import (
    Setting,
    non_negative_float,
    non_negative_int,
    parse_bytes,
    port,
    positive_float,
)


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






def _share(text: str) -> float:
    """'0.02' or '2%' -> 0.02."""
    text = str(text).strip()
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 < value <= 1:
        raise ValueError("must be a share in (0, 1], e.g. 0.02 or 2%")
    return value


def default_data_dir() -> Path:
    """$STRATA_HOME/cachemgr ($STRATA_HOME defaults to ~/.cache/strata)."""
    home = os.environ.get("STRATA_HOME") or Path.home() / ".cache" / "strata"
    return Path(home) / "cachemgr"


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "STRATA_CACHEMGR_HOST", str, "127.0.0.1",
            "address the cache manager's gRPC server binds"),
    Setting("port", "STRATA_CACHEMGR_PORT", port, 50061,
            "gRPC port of the cache manager (0 = any free port)"),
    Setting("metrics_port", "STRATA_METRICS_PORT", non_negative_int, 9464,
            "Prometheus scrape port for /metrics (0 disables it)"),
    Setting("redis_url", "STRATA_REDIS_URL", _redis_url, None,
            "Redis holding routing counts shared by cache managers (empty = in memory only)"),
    Setting("data_dir", "STRATA_CACHEMGR_DATA_DIR", _optional_path, None,
            "where the cache manager keeps its files (default: $STRATA_HOME/cachemgr)"),
    Setting("profile_path", "STRATA_PROFILE", _optional_path, None,
            "expert-profile.bin: read at start, then the live (decayed) profile is saved there "
            "(default: <data dir>/expert-profile.bin)", flag="--profile"),
    Setting("profile_save_interval_s", "STRATA_PROFILE_SAVE_INTERVAL", non_negative_float, 60.0,
            "seconds between saves of the live profile (0 = only at shutdown)",
            flag="--profile-save-interval"),
    Setting("profile_half_life_s", "STRATA_PROFILE_HALF_LIFE", positive_float, 600.0,
            "half-life of routing counts in the live profile, in seconds",
            flag="--profile-half-life"),
    Setting("replan_drift", "STRATA_REPLAN_DRIFT", _share, 0.02,
            "issue a new plan version when the pinned set misses this share of routed work "
            "that the best set would serve (e.g. 0.02 or 2%)"),
    Setting("replan_settle_s", "STRATA_REPLAN_SETTLE", non_negative_float, 10.0,
            "seconds the best set must stay put in a drift event before its one new plan "
            "version is issued",
            flag="--replan-settle"),
    Setting("sample_interval_s", "STRATA_SAMPLE_INTERVAL", positive_float, 2.0,
            "seconds between device samples (memory, utilisation, power for J/token)",
            flag="--sample-interval"),
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
    profile_path: Path | None = None  # None = no profile file (read or written)
    reserve_bytes: int = 700 * 2**20
    device_memory_bytes: int | None = None
    data_dir: Path | None = None
    profile_save_interval_s: float = 60.0  # 0 = only at shutdown
    profile_half_life_s: float = 600.0
    replan_drift: float = 0.02
    replan_settle_s: float = 10.0
    sample_interval_s: float = 2.0

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> CacheMgrConfig:
        """From `resolve(SETTINGS, args)`; settings left out take their defaults. The profile
        path defaults to <data dir>/expert-profile.bin."""
        merged = {s.name: s.default for s in SETTINGS} | dict(values)
        merged["reserve_bytes"] = parse_bytes(merged["reserve_bytes"])  # default is "700MiB"
        if merged["profile_path"] is None:
            data_dir = merged["data_dir"] or default_data_dir()
            merged["profile_path"] = Path(data_dir) / "expert-profile.bin"
        return cls(**{name: merged[name] for name in cls.__dataclass_fields__})
