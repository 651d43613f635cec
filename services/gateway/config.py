"""Gateway settings: every flag and `STRATA_*` variable the gateway reads, declared once."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.settings import (
    ConfigError,
    Setting,
    non_negative_float,
    non_negative_int,
    optional_str,
    parse_bool,
    parse_bytes,
    port,
    positive_float,
    positive_int,
)

_SHA256_HEX = re.compile(r"(?:sha256:)?([0-9a-fA-F]{64})")


def hash_key(key: str) -> bytes:
    """How API keys are stored and compared: the SHA-256 digest of the key's UTF-8 bytes."""
    return hashlib.sha256(key.encode()).digest()


def _addresses(text: str) -> tuple[str, ...]:
    """host:port list; `none` when every engine comes from the registry (--redis-url)."""
    if text.strip().lower() == "none":
        return ()
    addresses = tuple(part.strip() for part in text.split(",") if part.strip())
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{address!r} is not host:port")
    return addresses


def _keys(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def load_key_file(path: str) -> frozenset[bytes]:
    """One SHA-256 hex digest per line (optionally `sha256:`-prefixed); `#` comments allowed.
    Make a line with `printf %s "$KEY" | sha256sum`."""
    hashes = set()
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the key file: {exc.strerror}") from None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = _SHA256_HEX.fullmatch(line)
        if not match:
            raise ValueError(f"{path} line {number}: not a SHA-256 hex digest (64 hex digits); "
                             "keys are stored hashed: printf %s KEY | sha256sum")
        hashes.add(bytes.fromhex(match.group(1)))
    if not hashes:
        raise ValueError(f"{path} holds no key hashes")
    return frozenset(hashes)


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "STRATA_GATEWAY_HOST", str, "127.0.0.1", "address the HTTP server binds"),
    Setting("port", "STRATA_GATEWAY_PORT", port, 8000, "HTTP port"),
    Setting("engine", "STRATA_ENGINE_ADDR", _addresses, ("127.0.0.1:50051",),
            "engine gRPC addresses, comma-separated host:port; 'none': registry only"),
    Setting("max_inflight", "STRATA_MAX_INFLIGHT", positive_int, 8,
            "requests in flight at each engine (match the engine's --max-running so its batch "
            "fills)"),
    Setting("max_queue", "STRATA_MAX_QUEUE", non_negative_int, 16,
            "requests waiting for an engine slot; beyond this the gateway answers 429"),
    Setting("queue_timeout_s", "STRATA_QUEUE_TIMEOUT_S", positive_float, 30.0,
            "longest a request waits in the queue before a 429"),
    Setting("max_queued_tokens", "STRATA_MAX_QUEUED_TOKENS", positive_int, 131072,
            "estimated prompt tokens waiting in the queue (body bytes / 4; a continued "
            "Responses conversation: its text / 4); beyond it: 429"),
    Setting("api_keys", "STRATA_API_KEYS", _keys, frozenset(),
            "accepted bearer API keys, comma-separated; empty (and no key file) disables auth"),
    Setting("api_keys_file", "STRATA_API_KEYS_FILE", load_key_file, None,
            "file of accepted API keys as SHA-256 hex digests, one per line"),
    Setting("redis_url", "STRATA_REDIS_URL", optional_str, None,
            "Redis for the engine registry and limits shared by gateway replicas"),
    Setting("request_timeout_s", "STRATA_REQUEST_TIMEOUT_S", positive_float, 600.0,
            "deadline of one request from arrival, passed to the engine as the gRPC deadline"),
    Setting("drain_timeout_s", "STRATA_DRAIN_TIMEOUT_S", non_negative_float, 25.0,
            "on SIGTERM, how long running requests get to finish before the gateway exits"),
    Setting("max_body_bytes", "STRATA_MAX_BODY_BYTES", parse_bytes, 2 * 1024 * 1024,
            "largest request body; larger ones get 413"),
    Setting("log_prompts", "STRATA_LOG_PROMPTS", parse_bool, False,
            "log prompt text (off: prompts never reach the log)"),
    Setting("health_cache_s", "STRATA_HEALTH_CACHE_S", positive_float, 5.0,
            "how long /health reuses its last 1-token generation"),
    Setting("lease_ttl_s", "STRATA_LEASE_TTL_S", positive_float, 15.0,
            "shared-limit leases of a gateway that dies expire after this long"),
    Setting("metrics_port", "STRATA_GATEWAY_METRICS_PORT", port, 9465,
            "Prometheus scrape port for the request metrics at /metrics (0 disables it)"),
    Setting("responses_ttl_s", "STRATA_RESPONSES_TTL_S", positive_float, 86400.0,
            "how long a stored response of /v1/responses (store true, the default) can be read "
            "back or continued with previous_response_id, from when it was made or its "
            "conversation last continued"),
    Setting("responses_max_bytes", "STRATA_RESPONSES_MAX_BYTES", parse_bytes, 256 * 1024 * 1024,
            "stored responses this gateway keeps in memory (without --redis-url, or while Redis "
            "is away); past it the oldest go first"),
    Setting("stream_interval_ms", "STRATA_STREAM_INTERVAL_MS", non_negative_float, 50.0,
            "the longest the engine holds a generated token so that tokens produced close "
            "together travel as one gRPC message and one SSE event (0: each engine step's "
            "tokens at once; tokens that pile up while a client reads slowly are merged "
            "either way; the first tokens and the last are never held)"),
)


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    engine_addrs: tuple[str, ...] = ("127.0.0.1:50051",)
    max_inflight: int = 8
    max_queue: int = 16
    queue_timeout_s: float = 30.0
    max_queued_tokens: int = 131072
    api_keys: frozenset[str] = frozenset()
    api_key_hashes: frozenset[bytes] | None = None  # from --api-keys-file
    redis_url: str | None = None
    request_timeout_s: float = 600.0
    drain_timeout_s: float = 25.0
    max_body_bytes: int = 2 * 1024 * 1024
    log_prompts: bool = False
    health_cache_s: float = 5.0
    lease_ttl_s: float = 15.0
    metrics_port: int = 9465  # 0: no Prometheus endpoint (set up by `serve`, not `init_app`)
    stream_interval_ms: float = 50.0
    responses_ttl_s: float = 86400.0
    responses_max_bytes: int = 256 * 1024 * 1024
    # Not operator settings: tests shorten them.
    health_interval_s: float = 2.0  # engine probes and registry reads
    engine_timeout_s: float = 2.0  # for GetStatus probes
    breaker_threshold: int = 3
    breaker_cooldown_s: float = 5.0
    redis_retry_s: float = 1.0
    redis_timeout_s: float = 0.5
    queue_poll_s: float = 0.05  # shared limits: how often waiters look for slots freed elsewhere

    def __post_init__(self) -> None:
        if not self.engine_addrs and not self.redis_url:
            raise ConfigError("no engines: give --engine addresses, or --redis-url to find "
                             "engines in the registry")
        assert self.max_inflight >= 1 and self.max_queue >= 0

    @property
    def key_hashes(self) -> frozenset[bytes]:
        """Every accepted API key as a SHA-256 digest; empty means auth is off."""
        return frozenset(hash_key(k) for k in self.api_keys) | (self.api_key_hashes or frozenset())

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> GatewayConfig:
        """Build from `resolve(SETTINGS, args)`; keys left out keep their defaults."""
        renamed = {"engine": "engine_addrs", "api_keys_file": "api_key_hashes"}
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
