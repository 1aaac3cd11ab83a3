"""Smoke-run the tfun.nn training examples in a subprocess with tiny sizes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("script,png", [("train_lstm.py", "train_lstm_loss.png"), ("train_ssm.py", "train_ssm_loss.png")])
def test_example_smoke(script, png, tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg", "PYTHONWARNINGS": "error::DeprecationWarning:tfun"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final loss" in proc.stdout
    out = tmp_path / png
    assert out.exists() and out.stat().st_size > 1000
    if script == "train_ssm.py":
        err = float(proc.stdout.split("max abs difference ")[1].split()[0])
        assert err < 1e-4
