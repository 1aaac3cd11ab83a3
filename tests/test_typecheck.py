"""The public API type-checks: a user program of it passes pyright with no errors."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_public_api_typechecks_with_pyright():
    pytest.importorskip("pyright")
    if shutil.which("node") is None:
        pytest.skip("pyright needs Node.js, which is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, str(ROOT / "tests" / "typecheck")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 errors" in proc.stdout
