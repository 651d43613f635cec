"""Reports: every bench writes NAME.json, NAME.md (tables) and NAME-*.png (matplotlib, Agg)."""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import psutil  # noqa: E402


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(),
            "logical_cpus": os.cpu_count(),
            "ram_gib": round(psutil.virtual_memory().total / 2**30, 1)}


def fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 1) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v, digits) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Report:
    """Collects Markdown sections and figures, then writes the three kinds of file."""

    def __init__(self, out_dir: Path, name: str, title: str):
        self.out_dir, self.name = Path(out_dir), name
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.parts = [f"# {title}\n"]
        self.files: list[str] = []

    def text(self, markdown: str) -> None:
        self.parts.append(markdown.rstrip() + "\n")

    def section(self, heading: str, markdown: str = "") -> None:
        self.parts.append(f"## {heading}\n\n{markdown.rstrip()}\n" if markdown
                          else f"## {heading}\n")

    def figure(self, suffix: str, fig: plt.Figure, caption: str) -> None:
        path = self.out_dir / f"{self.name}-{suffix}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        self.files.append(str(path))
        self.parts.append(f"![{caption}]({path.name})\n")

    def write(self, result: dict) -> dict:
        """Write NAME.json (with these paths under "report") and NAME.md; returns the paths."""
        json_path = self.out_dir / f"{self.name}.json"
        md_path = self.out_dir / f"{self.name}.md"
        paths = {"json": str(json_path), "markdown": str(md_path), "plots": self.files}
        json_path.write_text(json.dumps({**result, "report": paths}, indent=1, default=str)
                             + "\n")
        md_path.write_text("\n".join(self.parts))
        return paths


def header(report: Report, result: dict) -> None:
    ctx, engine, m = result.get("target", {}), result.get("engine") or {}, result["machine"]
    lines = [f"- command: `{result.get('command', '')}`",
             f"- machine: {m['platform']}, {m['logical_cpus']} logical CPUs, "
             f"{m['ram_gib']} GiB RAM; GPU: {result.get('resources', {}).get('gpu', 'none')}"]
    if ctx:
        lines.append(f"- gateway {ctx.get('url')}, model `{ctx.get('model')}`, context window "
                     f"{ctx.get('context_window')} tokens")
    if engine:
        lines.append(f"- engine {engine.get('engine_id')} on {engine.get('device')}: "
                     f"{engine.get('slots')} of {engine.get('total_pairs')} pairs cached "
                     f"(coverage {engine.get('coverage', 0):.1%}), device memory "
                     f"{(engine.get('device_memory_bytes') or 0) / 2**20:.0f} MiB, plan "
                     f"{engine.get('plan_source')}")
    report.text("\n".join(lines) + "\n")


def resources_section(report: Report, samples: Sequence[dict], summary: dict) -> None:
    if not samples:
        return
    report.section(f"Resources (sampled every {summary.get('interval_s', 2):.0f} s)")
    report.text(table(["figure", "value"], [
        ["CPU % (p50)", summary.get("cpu_pct_p50")],
        ["load 1 min (max)", summary.get("load_1m_max")],
        ["RAM used MiB (max)", summary.get("ram_used_mib_max")],
        ["engine RSS MiB first / last", f"{fmt(summary.get('engine_rss_mib_first'))} / "
                                        f"{fmt(summary.get('engine_rss_mib_last'))}"],
        ["GPU energy J", summary.get("energy_j")], ["J/token", summary.get("j_per_token")]], 2))
    t = [s["t_s"] for s in samples]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    axes[0].plot(t, [s["cpu_pct"] for s in samples], label="CPU %")
    gpu = [s for s in samples if s.get("gpus")]
    if gpu:
        axes[0].plot([s["t_s"] for s in gpu], [s["gpus"][0].get("util_pct") or 0 for s in gpu],
                     label="GPU 0 util %")
    axes[0].set(xlabel="s", ylabel="%", title="utilisation")
    axes[0].legend()
    axes[1].plot(t, [s["ram_used_mib"] for s in samples], label="RAM used")
    rss = [s for s in samples if "engine_rss_mib" in s]
    if rss:
        axes[1].plot([s["t_s"] for s in rss], [s["engine_rss_mib"] for s in rss],
                     label="engine RSS")
    axes[1].set(xlabel="s", ylabel="MiB", title="memory")
    axes[1].legend()
    report.figure("resources", fig, "resources over time")
