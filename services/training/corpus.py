"""The training corpus: the running Python's standard-library source, split by whole module.

Files: every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by relative POSIX path,
skipping test suites and installed packages (any directory named test, tests, idle_test,
site-packages, dist-packages, __pycache__), the build directory `config-*`, the machine-specific
`_sysconfigdata_*` modules, and files that are not valid UTF-8.

Split (fixed, documented, whole modules): a file belongs to the top-level module that is its first
path component (`json/decoder.py` -> `json`, `os.py` -> `os`). A module is held out iff
`zlib.crc32(name) % 12 == 0` (about 1 module in 12; on CPython 3.11 that is 16 modules and ~9.5%
of the bytes, e.g. asyncio, unittest, _pydecimal). crc32 is stable across runs and machines,
unlike `hash()`.
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)
HELD_OUT_MODULUS = 12


@dataclass(frozen=True)
class SourceFile:
    rel_path: str  # POSIX path relative to the stdlib root
    module: str  # top-level module name
    held_out: bool


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_of(rel_path: str) -> str:
    return rel_path.split("/", 1)[0].removesuffix(".py")


def is_held_out(module: str) -> bool:
    return zlib.crc32(module.encode()) % HELD_OUT_MODULUS == 0


def _included(rel: Path) -> bool:
    dirs = rel.parts[:-1]
    if set(dirs) & SKIP_DIRS:
        return False
    if dirs and dirs[0].startswith("config-"):
        return False
    return not rel.name.startswith("_sysconfigdata")


def list_sources(root: Path | None = None) -> list[SourceFile]:
    """All corpus files in sorted order, each tagged with its module and split."""
    root = Path(root) if root is not None else stdlib_root()
    rels = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file())
    out = []
    for rel in rels:
        if _included(Path(rel)):
            module = module_of(rel)
            out.append(SourceFile(rel, module, is_held_out(module)))
    return out


def read_source(root: Path, src: SourceFile) -> str | None:
    """The file's text, or None if it is not UTF-8 (skipped, deterministically)."""
    try:
        return (root / src.rel_path).read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None


def iter_texts(split: str, root: Path | None = None, max_bytes: int | None = None) -> Iterator[str]:
    """Texts of one split ("train" or "heldout") in corpus order; stops after `max_bytes` of text
    (whole files; always at least one)."""
    assert split in ("train", "heldout"), split
    root = Path(root) if root is not None else stdlib_root()
    total = 0
    for src in list_sources(root):
        if src.held_out != (split == "heldout"):
            continue
        text = read_source(root, src)
        if text is None or not text.strip():
            continue
        yield text
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            return


@dataclass(frozen=True)
class SplitSummary:
    train_files: int
    heldout_files: int
    train_modules: int
    heldout_modules: tuple[str, ...]

    def as_dict(self) -> dict:
        return {
            "train_files": self.train_files,
            "heldout_files": self.heldout_files,
            "train_modules": self.train_modules,
            "heldout_modules": list(self.heldout_modules),
        }


def split_summary(root: Path | None = None) -> SplitSummary:
    sources = list_sources(root)
    held = [s for s in sources if s.held_out]
    return SplitSummary(
        train_files=len(sources) - len(held),
        heldout_files=len(held),
        train_modules=len({s.module for s in sources if not s.held_out}),
        heldout_modules=tuple(sorted({s.module for s in held})),
    )


def snippets(split: str, count: int, max_chars: int = 320, root: Path | None = None) -> list[str]:
    """`count` code snippets of one split, from files spread evenly over the split: each starts at
    a top-level `def` or `class` line and ends at a line boundary within `max_chars`. Prompts for
    benchmarks and quality checks that are real Python the model did (train) or did not (heldout)
    see; deterministic for a given Python installation."""
    assert split in ("train", "heldout"), split
    root = Path(root) if root is not None else stdlib_root()
    files = [s for s in list_sources(root) if s.held_out == (split == "heldout")]
    out: list[str] = []
    stride = max(1, len(files) // max(count, 1))
    for start in range(stride):  # a second pass over shifted files fills skipped ones
        for src in files[start::stride]:
            if len(out) == count:
                return out
            text = read_source(root, src)
            snippet = _snippet(text, max_chars) if text else None
            if snippet and snippet not in out:
                out.append(snippet)
            if len(out) == count:
                return out
    return out


def _snippet(text: str, max_chars: int = 320) -> str | None:
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.startswith(("def ", "class ")):
            taken, size = [], 0
            for part in lines[i:]:
                if size + len(part) > max_chars:
                    break
                taken.append(part)
                size += len(part)
            snippet = "".join(taken)
            return snippet if len(taken) >= 2 else None
    return None
