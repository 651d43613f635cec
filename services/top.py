"""`strata top`: what an operator runs first — engines, queue, hit rate, spill, coverage, tok/s,
device memory and power, from the cache manager (GetOverview) and optionally the gateway.

    strata top                          refresh every 2 s until Ctrl-C (plain ANSI, no curses)
    strata top --once                   one frame
    strata top --json                   one JSON object: {"cachemgr": ..., "gateway": ...}
    strata top --gateway http://127.0.0.1:8000   add the gateway's /health (queue, in flight)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from services.common.pb.strata.v1 import cachemgr_pb2, cachemgr_pb2_grpc
from services.common.settings import format_bytes

CLEAR = "\x1b[H\x1b[2J"
BOLD, DIM, RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"


def fetch_overview(address: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """The cache manager's overview as a dict; {"error": ...} when it cannot be reached."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = cachemgr_pb2_grpc.CacheManagerStub(channel).GetOverview(
                cachemgr_pb2.OverviewRequest(), timeout=timeout_s)
    except grpc.RpcError as exc:
        return {"error": f"cache manager at {address}: {exc.code().name}: {exc.details()}"}
    return MessageToDict(reply, preserving_proto_field_name=True,
                         always_print_fields_with_no_presence=True)


def fetch_gateway(url: str, timeout_s: float = 3.0) -> dict[str, Any]:
    """The gateway's /health JSON (a 503 still carries it); {"error": ...} when unreachable."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout_s) as reply:
            return json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            return {"error": f"gateway at {url}: HTTP {exc.code}"}
    except (OSError, ValueError) as exc:
        return {"error": f"gateway at {url}: {exc}"}


def snapshot(cachemgr: str, gateway: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {"cachemgr": fetch_overview(cachemgr)}
    if gateway:
        out["gateway"] = fetch_gateway(gateway)
    return out


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * float(value):.1f}%"


def _num(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(float(value))


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else \
        f"{seconds // 60}m{seconds % 60:02d}s"


def _device_line(d: dict[str, Any]) -> str:
    used, total = int(d.get("memory_used_bytes", 0)), int(d.get("memory_total_bytes", 0))
    parts = [f"{d.get('kind', '?')} {d.get('name', '')}".strip(),
             f"memory {format_bytes(used)} / {format_bytes(total)} used"]
    if "utilization" in d:
        parts.append(f"util {_pct(d['utilization'])}")
    if "power_w" in d:
        parts.append(f"{float(d['power_w']):.0f} W")
    if "temperature_c" in d:
        parts.append(f"{float(d['temperature_c']):.0f} C")
    if "sm_clock_hz" in d:
        parts.append(f"{float(d['sm_clock_hz']) / 1e9:.2f} GHz")
    if "joules_per_token" in d:
        parts.append(f"{float(d['joules_per_token']):.2f} J/token")
    return "device  " + ", ".join(parts)


ENGINE_COLUMNS = ("ENGINE", "MODEL", "SLOTS", "COVER", "HIT", "SPILL", "TOK/S", "RUN", "WAIT",
                  "PLAN", "MEMORY")


def _engine_row(e: dict[str, Any]) -> tuple[str, ...]:
    return (e["engine_id"], e.get("model_name") or e["model"][:16], str(e["slots"]),
            _pct(e["coverage"]), _pct(e["hit_ratio"]), _pct(e["spill_ratio"]),
            _num(e["tokens_per_s"]), str(e.get("requests_running", "-")),
            str(e.get("requests_waiting", "-")), f"v{e['plan_version']}",
            format_bytes(int(e["device_memory_bytes"])))


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], color: bool) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    head = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    lines = [f"{BOLD}{head}{RESET}" if color else head]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return lines


def render(data: dict[str, Any], cachemgr: str, color: bool = True) -> str:
    """One frame of text."""
    lines = [f"strata top — {time.strftime('%H:%M:%S')} — cache manager {cachemgr}"]
    overview = data["cachemgr"]
    gateway = data.get("gateway")
    if gateway is not None:
        if "error" in gateway:
            lines.append(f"gateway {gateway['error']}")
        else:
            ready = sum(1 for e in gateway.get("engines", []) if e.get("ready"))
            lines.append(f"gateway {gateway.get('status')}: {gateway.get('inflight', 0)} in "
                         f"flight, {gateway.get('queued', 0)} queued, capacity "
                         f"{gateway.get('capacity', '-')}, {ready} engine(s) ready")
    if "error" in overview:
        lines.append(overview["error"])
        return "\n".join(lines) + "\n"
    lines.append(f"up {_duration(float(overview.get('uptime_s', 0)))}, routing counts "
                 f"{overview.get('routing_store', '')}")
    lines.append(_device_line(overview.get("device", {})))
    lines.append("")
    engines = overview.get("engines", [])
    if engines:
        lines += _table(ENGINE_COLUMNS, [_engine_row(e) for e in engines], color)
    else:
        lines.append("no engine has reported yet")
    models = overview.get("models", [])
    if models:
        lines.append("")
        rows = [(m["model"], m.get("model_name", ""), f"v{m['plan_version']}", m["source"],
                 _pct(m["drift"]), str(m["watched_slots"])) for m in models]
        lines += _table(("MODEL", "NAME", "PLAN", "RANKED BY", "DRIFT", "WATCHED SLOTS"),
                        rows, color)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="strata top", description=__doc__.splitlines()[0])
    parser.add_argument("--cachemgr", default="127.0.0.1:50061",
                        help="cache manager gRPC address [default 127.0.0.1:50061]")
    parser.add_argument("--gateway", default=None,
                        help="gateway base URL, e.g. http://127.0.0.1:8000 (adds its queue)")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON object and exit")
    args = parser.parse_args(argv)
    if args.json or args.once:
        data = snapshot(args.cachemgr, args.gateway)
        if args.json:
            print(json.dumps(data, indent=2, sort_keys=True))
        else:
            sys.stdout.write(render(data, args.cachemgr, color=sys.stdout.isatty()))
        return 1 if "error" in data["cachemgr"] else 0
    try:
        while True:
            frame = render(snapshot(args.cachemgr, args.gateway), args.cachemgr)
            sys.stdout.write(CLEAR + frame + f"{DIM}Ctrl-C to quit{RESET}\n")
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
