"""Gateway settings: every flag and `STRATA_*` variable the gateway reads, declared once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.common.settings import Setting, non_negative_int, positive_int


def _addresses(text: str) -> tuple[str, ...]:
    addresses = tuple(part.strip() for part in text.split(",") if part.strip())
    if not addresses:
        raise ValueError("needs at least one host:port engine address")
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{address!r} is not host:port")
    return addresses


def _keys(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError("must be a TCP port (0-65535)")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError("must be > 0")
    return value


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "STRATA_GATEWAY_HOST", str, "127.0.0.1", "address the HTTP server binds"),
    Setting("port", "STRATA_GATEWAY_PORT", _port, 8000, "HTTP port"),
    Setting("engine", "STRATA_ENGINE_ADDR", _addresses, ("127.0.0.1:50051",),
            "engine gRPC addresses, comma-separated host:port"),
    Setting("max_inflight", "STRATA_MAX_INFLIGHT", positive_int, 4,
            "requests in flight at each engine"),
    Setting("max_queue", "STRATA_MAX_QUEUE", non_negative_int, 16,
            "requests waiting for an engine slot; beyond this the gateway answers 429"),
    Setting("queue_timeout_s", "STRATA_QUEUE_TIMEOUT_S", _positive_float, 30.0,
            "longest a request waits in the queue before a 429"),
    Setting("api_keys", "STRATA_API_KEYS", _keys, frozenset(),
            "accepted bearer API keys, comma-separated; empty disables auth"),
)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engine_addrs: tuple[str, ...] = ("127.0.0.1:50051",)
    max_inflight: int = 4
    max_queue: int = 16
    queue_timeout_s: float = 30.0
    api_keys: frozenset[str] = frozenset()
    # Not operator settings: tests shorten them.
    health_interval_s: float = 2.0
    engine_timeout_s: float = 2.0  # for GetStatus probes
    max_body_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        assert self.engine_addrs, "at least one engine address"
        assert self.max_inflight >= 1 and self.max_queue >= 0

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> GatewayConfig:
        """Build from `resolve(SETTINGS, args)`; keys left out keep their defaults."""
        renamed = {"engine": "engine_addrs"}
        fields = cls.__dataclass_fields__
        kwargs = {renamed.get(k, k): v for k, v in values.items() if renamed.get(k, k) in fields}
        if isinstance(kwargs.get("engine_addrs"), str):
            kwargs["engine_addrs"] = _addresses(kwargs["engine_addrs"])
        if isinstance(kwargs.get("api_keys"), str):
            kwargs["api_keys"] = _keys(kwargs["api_keys"])
        return cls(**kwargs)

    @property
    def capacity(self) -> int:
        """Requests the engines run at once, all engines together."""
        return self.max_inflight * len(self.engine_addrs)
