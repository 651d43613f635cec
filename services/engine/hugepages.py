"""A CPU engine's weights on 2 MB pages (Linux transparent huge pages).

A decode step on the CPU streams every weight it reads from memory: on the bench preset about
190 MB a token, 47,000 pages of 4 KB, each a TLB miss and a page walk; on 2 MB pages the same
bytes are about 100 pages. With the kernel's default THP mode (`madvise`) memory gets huge
pages only where a process asks for them. torch's CPU allocator asks (`madvise(MADV_HUGEPAGE)`
on every buffer of 2 MB or more) when `THP_MEM_ALLOC_ENABLE` is set, and reads the variable
once, at the process's first CPU allocation: `request()` sets it, unless the operator did,
before the runner allocates anything (llama.cpp's default, the GGUF file mapped from the page
cache, is on 4 KB pages). Measured on the bench preset, batch 1, alternating: 10 of 12 runs
faster, median +7% (docs/benchmarks.md). Nothing here changes a value, only the pages that
hold them.
"""

from __future__ import annotations

import os
from pathlib import Path

from services.common.sizing import proc_kib

ENV = "THP_MEM_ALLOC_ENABLE"
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def request() -> None:
    """Have torch's CPU allocator ask for huge pages, unless the environment says otherwise
    (THP_MEM_ALLOC_ENABLE=0 opts out). Takes effect only before the process's first CPU
    tensor."""
    os.environ.setdefault(ENV, "1")


def thp_mode() -> str:
    """The system's THP mode (always, madvise, never), or "unavailable"."""
    try:
        text = THP_MODE_FILE.read_text()
    except OSError:
        return "unavailable"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unavailable"


def huge_page_bytes() -> int:
    """This process's anonymous memory on huge pages (AnonHugePages), 0 where unknown."""
    return proc_kib("/proc/self/smaps_rollup", "AnonHugePages") or 0


def log_line(weight_bytes: int) -> str:
    """What the loaded weights sit on, and what to do where it is not 2 MB pages."""
    mode = thp_mode()
    if mode in ("never", "unavailable"):
        return (f"weights on 4 KB pages (transparent huge pages: {mode}); a CPU decode step "
                "reads them with fewer TLB misses on 2 MB pages: set "
                f"{THP_MODE_FILE} to madvise")
    if os.environ.get(ENV, "1") in ("0", ""):
        return f"weights on 4 KB pages ({ENV}={os.environ.get(ENV)!r} opts out)"
    huge = huge_page_bytes()
    line = (f"weights on 2 MB pages: {huge / 2**30:.2f} GiB of the process's memory on huge "
            f"pages for {weight_bytes / 2**30:.2f} GiB of weights and KV cache")
    if huge < weight_bytes // 2:
        line += (" (fewer than asked: a CPU tensor was allocated before the runner, so torch "
                 f"did not read {ENV}; or the kernel found no free 2 MB pages, see "
                 "/sys/kernel/mm/transparent_hugepage/defrag)")
    return line
