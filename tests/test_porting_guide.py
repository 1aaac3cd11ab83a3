"""The worked ports of docs/porting.md: each JAX program and its tfun port print the same numbers.

Both sides live in examples/ports/ and are included verbatim into the page, so the page
cannot drift from what is tested here. The JAX side is skipped only if jax is absent.
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PORTS = ROOT / "examples" / "ports"
NAMES = ["rnn", "s5", "solver"]
HAVE_JAX = importlib.util.find_spec("jax") is not None
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?|\b(?:True|False)\b")
RTOL, ATOL = 1e-3, 1e-5


def _run(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(path)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"},
    )


@pytest.fixture(scope="module")
def outputs() -> dict[str, subprocess.CompletedProcess[str]]:
    files = [f"{n}_tfun.py" for n in NAMES] + ([f"{n}_jax.py" for n in NAMES] if HAVE_JAX else [])
    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = {f: pool.submit(_run, PORTS / f) for f in files}
        return {f: fut.result() for f, fut in futures.items()}


def _numbers(text: str) -> list[float | bool]:
    out: list[float | bool] = []
    for tok in NUMBER.findall(text):
        out.append(tok == "True" if tok in ("True", "False") else float(tok))
    return out


def _ok(res: subprocess.CompletedProcess[str], name: str) -> str:
    assert res.returncode == 0, f"examples/ports/{name} failed:\n{res.stdout}\n{res.stderr}"
    assert res.stdout.strip(), f"examples/ports/{name} printed nothing"
    return res.stdout


@pytest.mark.parametrize("name", NAMES)
def test_tfun_side_runs(outputs, name: str) -> None:
    _ok(outputs[f"{name}_tfun.py"], f"{name}_tfun.py")


@pytest.mark.skipif(not HAVE_JAX, reason="jax is not installed")
@pytest.mark.parametrize("name", NAMES)
def test_both_sides_print_the_same_numbers(outputs, name: str) -> None:
    j = _ok(outputs[f"{name}_jax.py"], f"{name}_jax.py")
    t = _ok(outputs[f"{name}_tfun.py"], f"{name}_tfun.py")
    nj, nt = _numbers(j), _numbers(t)
    assert len(nj) == len(nt), f"{name}: different output layout\n--- jax\n{j}\n--- tfun\n{t}"
    bad = [
        (k, a, b) for k, (a, b) in enumerate(zip(nj, nt))
        if (type(a) is bool or type(b) is bool) and a != b
        or not (type(a) is bool or type(b) is bool) and not math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)
    ]
    assert not bad, f"{name}: numbers differ (index, jax, tfun): {bad}\n--- jax\n{j}\n--- tfun\n{t}"


def test_ports_are_included_in_the_guide() -> None:
    page = (ROOT / "docs" / "porting.md").read_text()
    for n in NAMES:
        for side in ("jax", "tfun"):
            assert f"examples/ports/{n}_{side}.py" in page, f"docs/porting.md does not include {n}_{side}.py"
