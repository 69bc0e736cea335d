"""The `crossover` entry point run as `python -m cli.main`: user errors print one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_user_error_under_python_m_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # cli.main runs as __main__ here: UserError must still be the commands' class
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    db = tmp_path / "no" / "such" / "dir.db"
    done = subprocess.run([sys.executable, "-m", "cli.main", "tenants", "list", "--db", str(db)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("crossover tenants: error: ")
