"""`strata up`: the whole cluster on this machine, as child processes.

    redis (embedded, unless STRATA_REDIS_URL) -> cachemgr -> engine -> gateway

Each child is started once the one before it is ready (gRPC health SERVING, or HTTP /readyz 200
for the gateway). Their output is echoed with a name prefix and kept in DIR/<name>.log.

`strata up` supervises them the way the compose file's `restart: unless-stopped` does: a child
that dies is reported with its last log lines and started again (same arguments, so the same
ports and registry entry) after a backoff that doubles with each death, while the others keep
running (the gateway answers 503 `no_engine` with Retry-After while the engine is away). A child
that dies `max_deaths` times within `window_s` is crash-looping: the cluster stops, with the
reason and its last log lines. A child that fails before its first readiness stops the start
(a bad flag or a model that does not fit will not get better by retrying).
Ctrl-C / SIGTERM stops every child, gateway first, so in-flight requests drain before the
engine goes.
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.settings import available_cores
from services.models import DEFAULT_MODEL_NAME


class LaunchError(RuntimeError):
    pass


@dataclass
class Child:
    name: str
    argv: list[str]
    ready: Callable[[], bool]
    log_path: Path
    process: subprocess.Popen[str] | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    _pump: threading.Thread | None = None

    def start(self, env: dict[str, str], echo: bool) -> None:
        log_file = self.log_path.open("a", buffering=1)
        self.process = subprocess.Popen(self.argv, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, env=env,
                                        start_new_session=True)

        def pump() -> None:
            assert self.process and self.process.stdout
            for line in self.process.stdout:
                line = line.rstrip("\n")
                self.tail.append(line)
                log_file.write(line + "\n")
                if echo:
                    print(f"{self.name:>8} | {line}", flush=True)
            log_file.close()

        self._pump = threading.Thread(target=pump, name=f"pump-{self.name}", daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def exit_code(self) -> int | None:
        return self.process.poll() if self.process else None

    def report(self) -> str:
        if self._pump is not None and self.exit_code() is not None:
            self._pump.join(1.0)  # the lines it wrote before it died
        lines = "\n".join(f"    {line}" for line in self.tail) or "    (no output)"
        return (f"{self.name} {describe_exit(self.exit_code())}; its last log lines "
                f"(full log: {self.log_path}):\n{lines}")

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, grace_s: float) -> None:
        if not self.process or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class RedisChild:
    """The embedded Redis as a supervised child: restarted on the same port, so every client
    holding its URL reconnects."""

    name = "redis"

    def __init__(self, data_dir: Path) -> None:
        from services.common.redis_server import EmbeddedRedis

        self.server = EmbeddedRedis(data_dir=data_dir)
        self.data_dir = data_dir

    def start(self, env: dict[str, str], echo: bool) -> None:
        self.server.stop()  # a dead server's handles; a restart keeps its port
        self.server.start()

    @property
    def pid(self) -> int | None:
        return self.server.pid

    def ready(self) -> bool:
        return self.server.running

    def exit_code(self) -> int | None:
        return self.server.exit_code()

    def report(self) -> str:
        return f"redis {describe_exit(self.exit_code())} (data: {self.data_dir})"

    def kill(self) -> None:
        self.server.stop(timeout_s=0)

    def stop(self, grace_s: float) -> None:
        self.server.stop(timeout_s=grace_s)


def engine_threads() -> list[str]:
    """The engine's tensor work gets every core this process may run on (its CPU affinity)
    unless STRATA_ENGINE_THREADS says otherwise: the gateway, the cache manager and Redis are
    mostly idle (about 1 ms of CPU a streamed token between them), and decode is bound by
    memory bandwidth, which one thread fewer gives away. Measured through the gateway on 2 cores, bench preset: 2 engine threads
    decode 1.36x (1 client) and 1.69x (8 clients) what 1 thread does (docs/benchmarks.md)."""
    if os.environ.get("STRATA_ENGINE_THREADS"):
        return []
    return ["--threads", str(available_cores())]


def grpc_serving(address: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with grpc.insecure_channel(address) as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    return check


def http_ok(url: str) -> Callable[[], bool]:
    def check() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return response.status == 200
        except OSError:
            return False
    return check


@dataclass(frozen=True)
class UpConfig:
    model: str | None
    device_memory: str | None
    max_inflight: int | None
    max_queue: int | None
    port: int
    engine_port: int
    cachemgr_port: int
    metrics_port: int
    log_dir: Path
    ready_timeout_s: float = 600.0
    echo: bool = True
    gateway_metrics_port: int | None = None  # None: 9465 if free, else any free port
    engine_metrics_port: int | None = None  # None: 9466 if free, else any free port


DEFAULT_GATEWAY_METRICS_PORT = 9465
DEFAULT_ENGINE_METRICS_PORT = 9466


def metrics_port(given: int | None, default: int) -> int:
    """The port given, else the default when nothing listens there, else a free one."""
    if given is not None:
        return given
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", default))
            return default
        except OSError:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]


@dataclass(frozen=True)
class RestartPolicy:
    """What `strata up` does when a child dies: start it again after `first_backoff_s`,
    doubled for each earlier death within `window_s` (at most `max_backoff_s`); the
    `max_deaths`-th death within `window_s` is a crash loop and stops the cluster."""

    max_deaths: int = 5
    window_s: float = 300.0
    first_backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def backoff_s(self, deaths: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2 ** max(0, deaths - 1))


class Supervised:
    """One child's place in the cluster: running, waiting to restart, or starting again."""

    RUNNING, WAITING, STARTING = "running", "waiting", "starting"

    def __init__(self, child: Child | RedisChild, policy: RestartPolicy) -> None:
        self.child = child
        self.policy = policy
        self.state = self.RUNNING
        self.deaths: collections.deque[float] = collections.deque()
        self.since = 0.0  # when the current state began (monotonic)
        self.restarts = 0

    def died(self, now: float) -> float | None:
        """Count a death at `now`; the backoff before the restart, or None for a crash loop."""
        self.deaths.append(now)
        while self.deaths and self.deaths[0] < now - self.policy.window_s:
            self.deaths.popleft()
        if len(self.deaths) >= self.policy.max_deaths:
            return None
        self.state, self.since = self.WAITING, now + self.policy.backoff_s(len(self.deaths))
        return self.since - now


class Cluster:
    def __init__(self, config: UpConfig, policy: RestartPolicy | None = None):
        self.config = config
        self.policy = policy or RestartPolicy()
        self.children: list[Supervised] = []
        self._env: dict[str, str] = {}
        self._stopping = threading.Event()

    def _child(self, name: str, module: str, args: list[str], ready: Callable[[], bool]) -> Child:
        return Child(name, [sys.executable, "-m", module, *args], ready,
                     self.config.log_dir / f"{name}.log")

    def plan(self, redis_url: str) -> list[Child]:
        c = self.config
        model = ["--model", c.model] if c.model else []
        memory = ["--device-memory", c.device_memory] if c.device_memory else []
        admission = ([f"--max-inflight={c.max_inflight}"] if c.max_inflight else []) + (
            [f"--max-queue={c.max_queue}"] if c.max_queue is not None else [])
        cachemgr = f"127.0.0.1:{c.cachemgr_port}"
        engine = f"127.0.0.1:{c.engine_port}"
        gateway_metrics = metrics_port(c.gateway_metrics_port, DEFAULT_GATEWAY_METRICS_PORT)
        engine_metrics = metrics_port(c.engine_metrics_port, DEFAULT_ENGINE_METRICS_PORT)
        self._say(f"metrics: cachemgr http://127.0.0.1:{c.metrics_port}/metrics, gateway "
                  f"http://127.0.0.1:{gateway_metrics}/metrics, engine "
                  f"http://127.0.0.1:{engine_metrics}/metrics")
        return [
            self._child("cachemgr", "services.cachemgr",
                        ["--port", str(c.cachemgr_port), "--metrics-port", str(c.metrics_port),
                         "--redis-url", redis_url, *memory], grpc_serving(cachemgr)),
            self._child("engine", "services.engine",
                        ["--port", str(c.engine_port), "--cachemgr", cachemgr,
                         "--metrics-port", str(engine_metrics), *model, *memory,
                         *engine_threads()],
                        grpc_serving(engine)),
            self._child("gateway", "services.gateway",
                        ["--port", str(c.port), "--engine", engine,
                         "--metrics-port", str(gateway_metrics), *admission],
                        http_ok(f"http://127.0.0.1:{c.port}/readyz")),
        ]

    def start(self) -> None:
        c = self.config
        c.log_dir.mkdir(parents=True, exist_ok=True)
        redis_url = os.environ.get("STRATA_REDIS_URL", "")
        if not redis_url:
            redis = RedisChild(c.log_dir / "redis")
            redis.start({}, c.echo)
            self.children.append(Supervised(redis, self.policy))
            redis_url = redis.server.url
            self._say(f"redis: embedded server at {redis_url} (pid {redis.pid})")
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", "STRATA_REDIS_URL": redis_url}
        for child in self.plan(redis_url):
            self.children.append(Supervised(child, self.policy))
            started = time.monotonic()
            child.start(self._env, c.echo)
            self._say(f"{child.name}: started (pid {child.pid}), waiting until ready")
            while not child.ready():
                if child.exit_code() is not None:
                    raise LaunchError(child.report())
                if self._stopping.is_set():
                    raise LaunchError("interrupted while starting")
                if time.monotonic() - started > c.ready_timeout_s:
                    raise LaunchError(f"{child.name} not ready after {c.ready_timeout_s:.0f} s; "
                                      f"see {child.log_path}")
                time.sleep(0.2)
            self._say(f"{child.name}: ready in {time.monotonic() - started:.1f} s")

    def watch(self, poll_s: float = 0.2) -> None:
        """Tend the children until a signal (clean exit) or a crash loop (LaunchError)."""
        while not self._stopping.wait(poll_s):
            for supervised in self.children:
                self.tend(supervised, time.monotonic())

    def tend(self, s: Supervised, now: float) -> None:
        """One look at one child: notice a death, restart after the backoff, see it ready."""
        child = s.child
        if s.state == s.WAITING:
            if now >= s.since:
                s.state, s.since, s.restarts = s.STARTING, now, s.restarts + 1
                try:
                    child.start(self._env, self.config.echo)
                except (OSError, RuntimeError) as exc:  # e.g. Redis's port taken meanwhile
                    self._say(f"{child.name}: restart {s.restarts} failed: {exc}")
                    if s.died(now) is None:
                        raise LaunchError(f"{child.name} could not be restarted "
                                          f"{len(s.deaths)} times: {exc}") from None
                    return
                self._say(f"{child.name}: restarted (pid {child.pid}, restart {s.restarts}), "
                          "waiting until ready")
            return
        if child.exit_code() is not None:
            report = child.report()
            backoff = s.died(now)
            if backoff is None:
                raise LaunchError(f"{child.name} died {len(s.deaths)} times within "
                                  f"{self.policy.window_s:.0f} s (crash loop; limit "
                                  f"{self.policy.max_deaths}, --max-deaths): stopping the "
                                  f"cluster; fix what its log says and start again. {report}")
            self._say(f"{report}\n{child.name}: restarting in {backoff:.0f} s (death "
                      f"{len(s.deaths)} of {self.policy.max_deaths} allowed within "
                      f"{self.policy.window_s:.0f} s)")
            return
        if s.state == s.STARTING:
            if child.ready():
                s.state = s.RUNNING
                self._say(f"{child.name}: ready again in {now - s.since:.1f} s after restart "
                          f"{s.restarts}")
            elif now - s.since > self.config.ready_timeout_s:
                self._say(f"{child.name}: not ready {self.config.ready_timeout_s:.0f} s after "
                          "its restart; killing it")
                child.kill()

    def request_stop(self, *_: object) -> None:
        self._stopping.set()

    def stop(self) -> None:
        for supervised in reversed(self.children):
            supervised.child.stop(grace_s=20.0)

    def _say(self, message: str) -> None:
        print(f"strata up: {message}", flush=True)


def run_up(config: UpConfig, policy: RestartPolicy | None = None) -> int:
    cluster = Cluster(config, policy)
    signal.signal(signal.SIGINT, cluster.request_stop)
    signal.signal(signal.SIGTERM, cluster.request_stop)
    try:
        cluster.start()
        url = f"http://127.0.0.1:{config.port}/v1"
        print(f"strata up: Strata is serving at {url} (metrics: http://127.0.0.1:"
              f"{config.metrics_port}/metrics; logs: {config.log_dir}); Ctrl-C stops it", flush=True)
        model = Path(config.model).name if config.model else DEFAULT_MODEL_NAME
        print(f"strata up: try  curl {url}/chat/completions -H 'Content-Type: application/json' "
              f"""-d '{{"model": "{model}", "messages": [{{"role": "user", """
              """"content": "def parse_args(argv):"}], "max_tokens": 48}'""", flush=True)
        cluster.watch()
        return 0
    except LaunchError as exc:
        print(f"strata up: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        print("strata up: stopping", flush=True)
        cluster.stop()
        print("strata up: stopped", flush=True)
