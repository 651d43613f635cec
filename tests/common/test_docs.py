"""The README's configuration tables are generated from the declared settings."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_readme_settings_tables_are_up_to_date():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_settings_docs.py"),
                             "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
