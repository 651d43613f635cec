"""Engine settings: flags and STRATA_* variables, declared once."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.settings import (
    Setting,
    choice,
    non_negative_float,
    non_negative_int,
    optional_str,
    parse_bool,
    parse_bytes,
    positive_float,
    positive_int,
)
from services.engine.cache.placement import DEFAULT_PLACEMENT, PLACEMENTS
from services.engine.cache.policy import (
    DEFAULT_CRF_LAMBDA,
    DEFAULT_PINNED_FRACTION,
    DEFAULT_POLICY,
    POLICIES,
    PolicySpec,
)
from services.engine.model.dtypes import DTYPES
from services.engine.model.quant import EXPERT_DTYPES
from services.engine.spec.base import SPEC_METHODS

DEFAULT_CPU_DEVICE_MEMORY = 768 * 2**20


def _device(text: str) -> str:
    if text not in {"auto", "cpu", "cuda"} and not text.startswith("cuda:"):
        raise ValueError("must be auto, cpu, cuda or cuda:N")
    return text


def _kv_dtype(text: str) -> str:
    if text not in {"auto", "int8"}:
        raise ValueError("must be auto or int8")
    return text






def _auto_ms(text: str | float | None) -> float | None:
    """Milliseconds >= 0, or None for "auto" (the engine decides from its host)."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        return None
    return non_negative_float(str(text))


def _auto_bool(text: str | bool | None) -> bool | None:
    """A boolean, or None for "auto" (the engine decides from the device)."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "auto"):
        return None
    return parse_bool(text)


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be between 0 and 1")
    return value


def _crf_lambda(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError("must be > 0 and <= 1")
    return value


SETTINGS = (
    Setting("model", "STRATA_MODEL", optional_str, None,
            "checkpoint directory (default: the shipped strata-stdlib-moe, trained on the Python "
            "standard library)"),
    Setting("host", "STRATA_ENGINE_HOST", str, "127.0.0.1", "gRPC bind address"),
    Setting("port", "STRATA_ENGINE_PORT", non_negative_int, 50051, "gRPC port (0 = any free port)"),
    Setting("engine_id", "STRATA_ENGINE_ID", optional_str, None,
            "name in logs, metrics and the registry (default: host:port)"),
    Setting("device", "STRATA_DEVICE", _device, "auto", "auto, cpu, cuda or cuda:N"),
    Setting("device_memory", "STRATA_DEVICE_MEMORY", parse_bytes, None,
            "device memory the engine may take, at most the free VRAM: the non-expert "
            "weights, the KV pool, the draft reserve and --reserve come out of it and the "
            "expert cache gets the rest (default: free VRAM on CUDA; on CPU 768MiB if every "
            "pair's slot fits in it, else no cache slots)"),
    Setting("reserve", "STRATA_RESERVE", parse_bytes, 700 * 2**20,
            "device memory kept out of the expert cache besides the weights, KV and draft "
            "reserve: activations, CUDA graphs, allocator slack"),
    Setting("cache_slots", "STRATA_CACHE_SLOTS", non_negative_int, None,
            "expert cache slots, instead of as many as the budget holds (start-up fails "
            "with the numbers when they do not fit)"),
    Setting("cachemgr", "STRATA_CACHEMGR_ADDR", optional_str, None,
            "cache manager gRPC address host:port (default: none, plan locally)"),
    Setting("profile", "STRATA_PROFILE", optional_str, None,
            "expert-profile.bin used to pre-fill the cache when no cache manager is set"),
    Setting("report_interval_s", "STRATA_REPORT_INTERVAL_S", positive_float, 2.0,
            "seconds between routing reports to the cache manager"),
    Setting("redis_url", "STRATA_REDIS_URL", optional_str, None,
            "Redis for the engine registry (heartbeat with load) that gateways discover engines "
            "from (default: none, gateways use static addresses)"),
    Setting("advertise", "STRATA_ENGINE_ADVERTISE", optional_str, None,
            "host:port gateways dial, as registered (default: bind address, or the hostname "
            "when binding all interfaces)"),
    Setting("max_running", "STRATA_MAX_RUNNING", positive_int, 8,
            "sequences decoded together in one step (continuous batching); more wait"),
    Setting("prefill_chunk", "STRATA_PREFILL_CHUNK", positive_int, 512,
            "tokens per engine step: decode tokens first, then prefill chunks up to this"),
    Setting("gather_ms", "STRATA_GATHER_MS", non_negative_float, 10.0,
            "the longest an idle engine holds its first step for the requests a gateway says "
            "it is still forwarding, and never longer than its recent steps took (a burst then "
            "starts in one step; a lone request never waits; 0: never hold)"),
    Setting("kv_memory", "STRATA_KV_MEMORY", parse_bytes, None,
            "device memory for the paged KV cache (default: 4 context windows' worth)"),
    Setting("kv_block_size", "STRATA_KV_BLOCK_SIZE", positive_int, 16,
            "token positions per KV block (the unit of prefix reuse)"),
    Setting("dtype", "STRATA_DTYPE", choice(DTYPES), "auto",
            "weights (non-expert, host store, cache slots): auto (as the checkpoint stores "
            "them: bf16 for bf16 and GGUF files, fp32 for fp32 and fp16), bf16 or fp32 (the "
            "reference path); activations and KV run in fp32 on the CPU kernels"),
    Setting("kv_dtype", "STRATA_KV_DTYPE", _kv_dtype, "auto",
            "auto (the activations' dtype) or int8 (per-block scales, about 1/4 of fp32)"),
    Setting("expert_dtype", "STRATA_EXPERT_DTYPE", choice(EXPERT_DTYPES), "auto",
            "expert weights in the host store and the cache slots: auto (the engine's --dtype),"
            " int8 (per-channel scales, ~1/4 of fp32) or int4 (scales per 32 weights, "
            "~1/7); the slot size and the auto-sized slot count follow"),
    Setting("prefix_reuse", "STRATA_PREFIX_REUSE", parse_bool, True,
            "reuse KV blocks of an equal prompt prefix already in the cache"),
    Setting("threads", "STRATA_ENGINE_THREADS", non_negative_int, 0,
            "CPU threads for the engine's tensor work (0: torch's default, one per core)"),
    Setting("first_token_grace_ms", "STRATA_FIRST_TOKEN_GRACE_MS", _auto_ms, None,
            "after a step that sent requests' first tokens, the engine waits this long before "
            "the next one, so that the gateway gets a core to forward them (the second token "
            "comes that much later); unset or auto: 1 on the CPU when the engine's threads take "
            "every core, else 0"),
    Setting("step_trace", "STRATA_STEP_TRACE", optional_str, None,
            "append a JSON line per engine step to this file (its start, its forward pass's "
            "and its sampling's durations, its rows, tokens and prompt tokens); "
            "`python -m services.engine.step_trace FILE` says where the time went"),
    Setting("cpu_kernels", "STRATA_CPU_KERNELS", choice(("auto", "on", "off")), "auto",
            "C kernels for the CPU decode step, built with the machine's compiler at first "
            "use and cached: auto (use them when they build), on (refuse to start without "
            "them), off (torch ops only)"),
    Setting("cuda_graphs", "STRATA_CUDA_GRAPHS", parse_bool, True,
            "CUDA: run each decode step as a CUDA graph replay (one graph per batch size "
            "1..--max-running, at most 64, all captured at start); misses of such steps are "
            "read in place over the link"),
    Setting("draft_reserve", "STRATA_DRAFT_RESERVE", parse_bytes, 0,
            "device memory kept for a draft head, besides --reserve (0: what the "
            "--spec-method source reports, none for ngram)"),
    Setting("spec_tokens", "STRATA_SPEC_TOKENS", non_negative_int, 0,
            "speculative decoding: draft tokens verified per sequence and step, in the same "
            "forward as its decode token (0: off)"),
    Setting("spec_method", "STRATA_SPEC_METHOD", choice(SPEC_METHODS), "ngram",
            "where drafts come from: ngram (prompt lookup in the prompt and output so far), "
            "mtp (the checkpoint's own multi-token-prediction layer: Qwen3-Next/3.5, "
            "DeepSeek-V3, Kimi-K2, GLM-4.5; else a head from strata model train-mtp), draft (a "
            "separate small model)"),
    Setting("spec_draft_model", "STRATA_SPEC_DRAFT_MODEL", optional_str, None,
            "--spec-method draft: checkpoint directory of the draft model (same tokenizer); "
            "its weights and KV are reserved before the expert cache is sized"),
    Setting("policy", "STRATA_CACHE_POLICY", choice(POLICIES), DEFAULT_POLICY,
            "eviction order of the dynamic cache region: " + ", ".join(POLICIES)
            + " (static: every slot pinned from the profile)"),
    Setting("pinned_fraction", "STRATA_PINNED_FRACTION", _fraction, DEFAULT_PINNED_FRACTION,
            "share of the slots pinned with the profile's hottest pairs; the rest is dynamic"),
    Setting("crf_lambda", "STRATA_CRF_LAMBDA", _crf_lambda, DEFAULT_CRF_LAMBDA,
            "crf policy: decay per pair access (towards 0: frequency, 1: recency)"),
    Setting("placement", "STRATA_PLACEMENT", choice(PLACEMENTS), DEFAULT_PLACEMENT,
            "where misses run: exact (cost model among placements bit-identical to a hit: "
            "both with the CPU kernels or the CUDA Triton kernel, which reads the host store in "
            "place; else copy), auto (cost model, fastest), host, copy"),
    Setting("prefetch", "STRATA_PREFETCH", _auto_bool, None,
            "prefetch the next layer's predicted experts (its router on this layer's input); "
            "unset or auto: on for CUDA, off on the CPU (there a fill is a memcpy on the compute "
            "thread that cannot run ahead, and decode steps without it run in one call)"),
    Setting("record_routing", "STRATA_RECORD_ROUTING", optional_str, None,
            "write every step's routed pairs to this trace file (for strata cache replay)"),
    Setting("metrics_port", "STRATA_ENGINE_METRICS_PORT", non_negative_int, 9466,
            "Prometheus scrape port for the request and load metrics at /metrics (0 disables it)"),
    Setting("plan_swap_slots", "STRATA_PLAN_SWAP_SLOTS", positive_int, 64,
            "a new plan version is applied between engine steps, at most this many cache slots "
            "swapped per step (decode never waits for a whole refill)"),
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
    cache_slots: int | None = None
    cachemgr: str | None = None
    profile: str | None = None
    report_interval_s: float = 2.0
    redis_url: str | None = None
    advertise: str | None = None
    max_running: int = 8
    prefill_chunk: int = 512
    gather_ms: float = 10.0
    kv_memory: int | None = None
    kv_block_size: int = 16
    dtype: str = "auto"
    kv_dtype: str = "auto"
    expert_dtype: str = "auto"
    prefix_reuse: bool = True
    threads: int = 0
    first_token_grace_ms: float | None = None  # None (auto): server.first_token_grace_s
    step_trace: str | None = None
    cpu_kernels: str = "auto"
    cuda_graphs: bool = True
    draft_reserve: int = 0
    spec_tokens: int = 0
    spec_method: str = "ngram"
    spec_draft_model: str | None = None
    policy: str = DEFAULT_POLICY
    pinned_fraction: float = DEFAULT_PINNED_FRACTION
    crf_lambda: float = DEFAULT_CRF_LAMBDA
    placement: str = DEFAULT_PLACEMENT
    prefetch: bool | None = None  # None (auto): ModelRunner turns it on for CUDA, off on CPU
    record_routing: str | None = None
    metrics_port: int = 9466  # 0: no Prometheus endpoint
    plan_swap_slots: int = 64

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> EngineConfig:
        return cls(**values)

    @property
    def model_dir(self) -> Path:
        if self.model:
            return Path(self.model).expanduser()
        from services.models import default_model_dir

        return default_model_dir()

    @property
    def policy_spec(self) -> PolicySpec:
        return PolicySpec(self.policy, self.pinned_fraction, self.crf_lambda)

    def advertised_address(self, bound_port: int) -> str:
        if self.advertise:
            return self.advertise
        host = socket.gethostname() if self.host in {"0.0.0.0", "::", "[::]"} else self.host
        return f"{host}:{bound_port}"

    def resolved_engine_id(self, bound_port: int) -> str:
        return self.engine_id or f"{socket.gethostname()}:{bound_port}"
