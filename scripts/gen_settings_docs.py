"""Write the README's configuration tables from the services' declared settings.

    python scripts/gen_settings_docs.py           # rewrite the tables in README.md
    python scripts/gen_settings_docs.py --check   # exit 1 if README.md is out of date

Each table sits between `<!-- settings:NAME -->` and `<!-- /settings:NAME -->` markers.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.common.settings import Setting, format_bytes, parse_bytes  # noqa: E402

SERVICES = {
    "engine": "services.engine.config",
    "gateway": "services.gateway.config",
    "cachemgr": "services.cachemgr.config",
}


def _default(s: Setting) -> str:
    if s.default is None or s.default == "" or s.default == () or s.default == frozenset():
        return "—"
    if isinstance(s.default, bool):
        return "on" if s.default else "off"
    if isinstance(s.default, tuple | list | frozenset | set):
        return ", ".join(sorted(map(str, s.default)))
    if s.parse is parse_bytes and isinstance(s.default, int):
        return format_bytes(s.default).replace(".00 ", "").replace(" ", "")
    return str(s.default)


def table(settings: tuple[Setting, ...]) -> str:
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for s in settings:
        meaning = " ".join(s.help.split()).replace("|", "\\|")
        rows.append(f"| `{s.option}` | `{s.env}` | {_default(s)} | {meaning} |")
    return "\n".join(rows)


def render(text: str) -> str:
    for name, module in SERVICES.items():
        settings = importlib.import_module(module).SETTINGS
        pattern = re.compile(rf"(<!-- settings:{name} -->\n).*?(<!-- /settings:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"README.md has no <!-- settings:{name} --> block")
        text = pattern.sub(lambda m, s=settings: m.group(1) + table(s) + "\n" + m.group(2), text)
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    readme = ROOT / "README.md"
    current = readme.read_text()
    fresh = render(current)
    if args.check:
        if fresh != current:
            print("README.md's settings tables are stale; run `python scripts/gen_settings_docs.py`")
            return 1
        return 0
    readme.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
