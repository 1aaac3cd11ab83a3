"""Smoke-run every example program (`--smoke`) as a subprocess, as a user would run it.

The programs are started together (a few at a time) by one module-scoped fixture, so the
import cost of torch is paid in parallel; each test then checks one program's result.
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# (file, extra arguments); demo.py takes no --smoke flag.
OURS = [
    ("nan_clamping.py", ["--smoke"]),
    ("chunked_cross_entropy.py", ["--smoke"]),
    ("s5_associative_scan.py", ["--smoke"]),
    ("rnn_scan.py", ["--smoke"]),
    ("early_stopping_generation.py", ["--smoke"]),
    ("attention_masks.py", ["--smoke"]),
    ("demo.py", []),
    ("train_distributed.py", ["--smoke"]),  # launches torchrun with two gloo processes itself
]
# Owned by the tfun.nn engineer; smoke-run when present.
# Their plots go to a temporary folder (OUT_DIR, filled in by the fixture), not into the checkout.
OUT_DIR = "{out}"
OPTIONAL = [("train_lstm.py", ["--smoke", "--out", OUT_DIR]), ("train_ssm.py", ["--smoke", "--out", OUT_DIR])]
# tests/test_examples_nn.py (the tfun.nn engineer's) already smoke-runs these; run them here
# only when that file no longer does, so CI does not pay for them twice.
NN_TESTS = ROOT / "tests" / "test_examples_nn.py"


def _covered_elsewhere(name: str) -> bool:
    return NN_TESTS.exists() and name in NN_TESTS.read_text(encoding="utf-8")

# What each program must print (a line that only a successful run prints).
EXPECT = {
    "nan_clamping.py": "weights finite: True",
    "chunked_cross_entropy.py": "memory saved:",
    "s5_associative_scan.py": "max |y_assoc - y_scan|",
    "rnn_scan.py": "tfun.nn.RNN matches torch.nn.RNN: True",
    "early_stopping_generation.py": "matches the hand-written loop: True",
    "attention_masks.py": "match the hand-written if/else: True",
    "demo.py": "associative_scan cumsum:",
    "train_distributed.py": "ranks agree: True",
}

# Per program. Each takes 3-20 s alone on 2 cores; the fixture runs them a few at a time, so the
# first test of this module waits for all of them (its pytest-timeout is raised to match below).
TIMEOUT_S = 240
pytestmark = pytest.mark.timeout(3 * TIMEOUT_S)


def _run(name: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="default", MPLBACKEND="Agg")
    cmd = [sys.executable, str(EXAMPLES / name), *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired as e:  # a failed result with what the program printed, not a fixture error
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(cmd, -9, out, f"{err}\n(killed after {TIMEOUT_S} s)")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    out = str(tmp_path_factory.mktemp("examples-out"))
    todo = list(OURS) + [
        (n, [a.replace(OUT_DIR, out) for a in args])
        for n, args in OPTIONAL
        if (EXAMPLES / n).exists() and not _covered_elsewhere(n)
    ]
    with ThreadPoolExecutor(max_workers=max(2, min(4, os.cpu_count() or 2))) as pool:
        futures = {n: pool.submit(_run, n, a) for n, a in todo}
        return {n: f.result() for n, f in futures.items()}


def _check(res: subprocess.CompletedProcess[str], name: str) -> None:
    assert res.returncode == 0, f"examples/{name} failed (rc={res.returncode}):\n{res.stdout}\n{res.stderr}"
    if name in EXPECT:
        assert EXPECT[name] in res.stdout, f"examples/{name} did not print {EXPECT[name]!r}:\n{res.stdout}"


@pytest.mark.parametrize("name", [n for n, _ in OURS])
def test_example_smoke(results: dict[str, subprocess.CompletedProcess[str]], name: str) -> None:
    _check(results[name], name)


@pytest.mark.parametrize("name", [n for n, _ in OPTIONAL])
def test_training_example_smoke(results: dict[str, subprocess.CompletedProcess[str]], name: str) -> None:
    if not (EXAMPLES / name).exists():
        pytest.skip(f"examples/{name} does not exist yet")
    if _covered_elsewhere(name):
        pytest.skip(f"examples/{name} is smoke-run by tests/test_examples_nn.py")
    _check(results[name], name)


def test_every_example_is_smoke_run() -> None:
    """A new example must be added to this file (ports are run by test_porting_guide.py)."""
    known = {n for n, _ in OURS + OPTIONAL}
    present = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}  # _x.py: helper modules
    assert present <= known, f"examples not smoke-run by tests/test_examples.py: {sorted(present - known)}"
