"""examples/ports/dropout_mlp_{jax,tfun}.py print the same lines: JAX's init, batch order, dropout mask and losses.

Run here (not in tests/test_porting_guide.py's list) so the issue-17 port is checked exactly:
the lines must be equal as text, not just close.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PORTS = ROOT / "examples" / "ports"


def _run(name: str) -> str:
    # the checkout first, then whatever the caller's path holds (packages installed with --target)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}
    res = subprocess.run([sys.executable, str(PORTS / name)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, f"examples/ports/{name} failed:\n{res.stdout}\n{res.stderr}"
    return res.stdout


def test_tfun_side_runs() -> None:
    out = _run("dropout_mlp_tfun.py")
    assert "step 0 loss:" in out


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_identical_to_the_jax_original() -> None:
    j, t = _run("dropout_mlp_jax.py"), _run("dropout_mlp_tfun.py")
    assert j.splitlines() == t.splitlines(), f"--- jax\n{j}\n--- tfun\n{t}"


def test_the_guide_includes_it() -> None:
    page = (ROOT / "docs" / "porting.md").read_text()
    for side in ("jax", "tfun"):
        assert f"examples/ports/dropout_mlp_{side}.py" in page
