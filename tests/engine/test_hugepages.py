"""Weights on 2 MB pages: torch's allocator asked through THP_MEM_ALLOC_ENABLE, and a log line
that says what the weights sit on and what to do where it is not huge pages."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.engine import hugepages

PROBE = """
from services.engine import hugepages
hugepages.request()
import torch
before = hugepages.huge_page_bytes()
x = torch.empty(64 * 2**20, dtype=torch.uint8)
x.fill_(1)
print(hugepages.huge_page_bytes() - before)
"""


@pytest.mark.skipif(hugepages.thp_mode() not in ("always", "madvise"),
                    reason="this system gives no transparent huge pages")
def test_a_fresh_process_that_requests_them_gets_its_large_tensors_on_huge_pages():
    """The contract with torch (c10's alloc_cpu reads THP_MEM_ALLOC_ENABLE at the process's
    first CPU allocation): a 64 MiB tensor gets at least half its bytes on 2 MB pages."""
    env = {k: v for k, v in os.environ.items() if k != hugepages.ENV}
    grown = int(subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                               check=True, env=env, cwd=Path(__file__).parents[2],
                               timeout=120).stdout.split()[-1])
    assert grown >= 32 * 2**20


def test_request_keeps_the_operators_choice(monkeypatch):
    monkeypatch.setenv(hugepages.ENV, "0")
    hugepages.request()
    assert os.environ[hugepages.ENV] == "0"
    monkeypatch.delenv(hugepages.ENV)
    hugepages.request()
    assert os.environ[hugepages.ENV] == "1"


@pytest.mark.parametrize("text, mode", [
    ("always [madvise] never\n", "madvise"), ("[always] madvise never\n", "always"),
    ("always madvise [never]\n", "never"), ("garbage\n", "unavailable")])
def test_thp_mode_reads_the_bracketed_choice(tmp_path, monkeypatch, text, mode):
    path = tmp_path / "enabled"
    path.write_text(text)
    monkeypatch.setattr(hugepages, "THP_MODE_FILE", path)
    assert hugepages.thp_mode() == mode


def test_log_line_says_what_the_weights_sit_on_and_what_to_do(tmp_path, monkeypatch):
    path = tmp_path / "enabled"
    monkeypatch.setattr(hugepages, "THP_MODE_FILE", path)
    path.write_text("always madvise [never]\n")
    assert "4 KB pages (transparent huge pages: never)" in hugepages.log_line(2**30)
    assert "to madvise" in hugepages.log_line(2**30)
    path.write_text("always [madvise] never\n")
    monkeypatch.setenv(hugepages.ENV, "0")
    assert "opts out" in hugepages.log_line(2**30)
    monkeypatch.setenv(hugepages.ENV, "1")
    monkeypatch.setattr(hugepages, "huge_page_bytes", lambda: 2**30)
    line = hugepages.log_line(2**30)
    assert line.startswith("weights on 2 MB pages: 1.00 GiB") and "fewer" not in line
    monkeypatch.setattr(hugepages, "huge_page_bytes", lambda: 0)
    assert "fewer than asked" in hugepages.log_line(2**30)
