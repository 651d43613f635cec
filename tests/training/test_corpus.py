"""The stdlib corpus: which files are read and the fixed held-out split of whole modules."""

from __future__ import annotations

from services.training.corpus import (
    is_held_out,
    iter_texts,
    list_sources,
    module_of,
    split_summary,
    stdlib_root,
)


def test_split_is_deterministic_and_disjoint():
    first, second = list_sources(), list_sources()
    assert first == second and len(first) > 100
    assert [s.rel_path for s in first] == sorted(s.rel_path for s in first)
    train = {s.module for s in first if not s.held_out}
    held = {s.module for s in first if s.held_out}
    assert train and held and not train & held  # whole modules, never split
    assert all(s.held_out == is_held_out(s.module) for s in first)
    share = len([s for s in first if s.held_out]) / len(first)
    assert 0.02 < share < 0.25


def test_split_rule_is_crc32_of_the_module_name():
    # crc32 does not depend on the Python version or PYTHONHASHSEED
    assert is_held_out("asyncio") and is_held_out("unittest")
    assert not is_held_out("json") and not is_held_out("os")
    assert module_of("json/decoder.py") == "json" and module_of("os.py") == "os"
    summary = split_summary()
    assert summary.heldout_files + summary.train_files == len(list_sources())


def test_test_suites_and_site_packages_are_skipped():
    for src in list_sources():
        parts = set(src.rel_path.split("/")[:-1])
        assert not parts & {"test", "tests", "idle_test", "site-packages", "__pycache__"}
        assert not src.rel_path.rsplit("/", 1)[-1].startswith("_sysconfigdata")


def test_rules_on_a_fake_stdlib(tmp_path):
    files = {
        "os.py": "import sys\n",
        "asyncio/base.py": "async def f(): ...\n",
        "unittest/test/test_case.py": "skip\n",
        "site-packages/pkg/mod.py": "skip\n",
        "_sysconfigdata__linux.py": "skip\n",
        "config-3.11-x86_64/python-config.py": "skip\n",
        "latin.py": b"# caf\xe9\n",
    }
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert [s.rel_path for s in list_sources(tmp_path)] == ["asyncio/base.py", "latin.py", "os.py"]
    assert list(iter_texts("train", tmp_path)) == ["import sys\n"]  # latin-1 file skipped
    assert list(iter_texts("heldout", tmp_path)) == ["async def f(): ...\n"]


def test_max_bytes_reads_whole_files_in_order():
    texts = list(iter_texts("train", stdlib_root(), max_bytes=1))
    assert len(texts) == 1
