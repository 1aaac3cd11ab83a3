"""Every `tfun.lax` op along every path against the float64 eager oracle (outputs and gradients).

Eager float32 (and bfloat16 where the op accumulates in float32) is drawn by hypothesis over
shapes: T = 1, odd and long lengths with few channels, reverse, every axis. The compiled paths
(`tfun.jit` with `aot_eager` and with Inductor, the forward jitted and the whole
`value_and_grad` step jitted) run on a fixed set of shapes, since each new shape compiles anew.
A path must give the oracle's numbers or raise a tfun error; `REFUSED` lists the combinations
that raise one today, and each of them is asserted to raise it (not a torch error, not a number).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tfun.errors import TfunError

from . import harness
from .cases import CASES

# (case, path) -> why it is refused on torch 2.13 with a tfun error (JitError) instead of run.
REFUSED: dict[tuple[str, str], str] = {
    # `xs[i]` with the loop index, a 0-d tensor under the scan lowering, is a data-dependent
    # index to torch.compile: "Could not extract specialized integer from data-dependent expression"
    ("fori_loop", "aot_eager"): "xs[i] with a traced index",
    ("fori_loop", "aot_eager+grad"): "xs[i] with a traced index",
    ("fori_loop", "inductor"): "xs[i] with a traced index",
    ("fori_loop", "inductor+grad"): "xs[i] with a traced index",
    ("fori_loop", "aot_eager+vjp"): "xs[i] with a traced index",
    ("fori_loop", "aot_eager+nograd"): "xs[i] with a traced index",
}
# (case, path, spec id) -> a known bug, pinned with a strict xfail until its fix lands
KNOWN: dict[tuple[str, str, str], str] = {}

lengths = st.one_of(st.sampled_from([1, 2, 3, 7, 63]), st.integers(1, 300))
channels = st.sampled_from([1, 2, 3, 5, 16])


@st.composite
def specs(draw: st.DrawFn, name: str) -> dict:
    spec = {"T": draw(lengths), "C": draw(channels), "seed": draw(st.integers(0, 10_000))}
    if name in ("scan", "associative_scan", "linear_scan"):
        spec["reverse"] = draw(st.booleans())
    if name == "associative_scan":
        spec["axis"] = draw(st.sampled_from([0, 1, -1, -2]))
    if name == "map":
        spec["batch_size"] = draw(st.sampled_from([None, 1, 2, 4]))
    return spec


@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_eager_float32_matches_float64(name: str, data: st.DataObject) -> None:
    harness.assert_matches(name, data.draw(specs(name)), "eager", torch.float32)


@pytest.mark.parametrize(("T", "C"), [(1, 1), (63, 2), (1000, 1), (5000, 2)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", ["scan", "linear_scan", "associative_scan"])
def test_eager_long_few_channels(name: str, T: int, C: int, reverse: bool) -> None:
    """fla's odd lengths (63, 1000, 5000) with few channels, both directions."""
    harness.assert_matches(name, {"T": T, "C": C, "reverse": reverse, "seed": T}, "eager", torch.float32)


@pytest.mark.parametrize("name", ["linear_scan", "select", "cond"])
@given(data=st.data())
def test_eager_bfloat16(name: str, data: st.DataObject) -> None:
    harness.assert_matches(name, data.draw(specs(name)), "eager", torch.bfloat16)


def _check_path(name: str, spec: dict, path: str) -> None:
    torch._dynamo.reset()  # each cell compiles from scratch, as a new program would
    why = REFUSED.get((name, path.partition("/")[0]))
    if why is None:
        harness.assert_matches(name, spec, path, torch.float32)
        return
    res = harness.compare(name, spec, path, torch.float32)
    assert isinstance(res, harness.Refused), f"{name} along {path} now runs ({why}): move it out of REFUSED"
    assert isinstance(res.error, TfunError)


JIT_SPECS = [{"T": 1, "C": 1, "seed": 3}, {"T": 9, "C": 3, "seed": 4, "reverse": True, "axis": -1, "batch_size": 2}]


@pytest.mark.parametrize(
    ("name", "path", "spec"),
    [
        # CI's second torch phase runs T=1 forward only (`heavy`: see pyproject.toml)
        pytest.param(n, p, s, id=f"{n}-{p}-{sid}", marks=[pytest.mark.heavy] if (sid == "T1" and p != "aot_eager") else [])
        for n in sorted(CASES)
        for p in ["aot_eager", "aot_eager+grad", "aot_eager+vjp"]
        for s, sid in zip(JIT_SPECS, ["T1", "T9"])
    ],
)
def test_jit_aot_eager(name: str, path: str, spec: dict) -> None:
    _xfail_known(name, path, "T1" if spec["T"] == 1 else "T9")
    _check_path(name, spec, path)


def _xfail_known(name: str, path: str, spec_id: str) -> None:
    why = KNOWN.get((name, path, spec_id))
    if why is not None:
        pytest.xfail(why)  # pragma: no cover - empty today


@pytest.mark.parametrize(
    "name, path",
    [
        # CI's second torch phase leaves the stacked scan and map out (`heavy`: see pyproject.toml)
        pytest.param(n, p, marks=[pytest.mark.heavy] if n in ("scan_stacked", "map") else [])
        for n in ["scan", "scan_stacked", "cond", "while_loop", "map", "linear_scan"]
        for p in ["inductor", "inductor+grad"]
    ]
    # tfun.vjp inside tfun.jit, compiled by Inductor: a loop and a branch (each cell compiles for seconds)
    + [pytest.param("scan", "inductor+vjp", marks=pytest.mark.heavy), ("cond", "inductor+vjp")],
)
def test_jit_inductor(name: str, path: str) -> None:
    _xfail_known(name, path, "")
    _check_path(name, {"T": 5, "C": 2, "seed": 5, "reverse": True}, path)


@pytest.mark.parametrize(
    ("name", "path"),
    [(n, "aot_eager+nograd") for n in sorted(CASES)]
    + [
        # CI's second torch phase leaves the loops out (`heavy`: see pyproject.toml)
        pytest.param(n, "inductor+nograd", marks=[pytest.mark.heavy] if n in ("scan", "while_loop") else [])
        for n in ["scan", "while_loop", "cond", "associative_scan", "linear_scan"]
    ],
)
def test_jit_under_no_grad(name: str, path: str) -> None:
    """Inference: the jitted function called under `torch.no_grad()`, where some lowerings
    differ from the ones traced with gradients (CUDA's fused associative_scan, complex
    carries passed as real pairs). No path of this suite ran there until session 34, when
    the first such call on a GPU (benchmarks/vs_jax.py) found every jitted associative_scan
    refused on CUDA."""
    _check_path(name, JIT_SPECS[1], path)


#: the cases with more than one argument (with one, freezing it leaves nothing to differentiate)
SEVERAL_ARGS = sorted(n for n in CASES if len(CASES[n](JIT_SPECS[1], torch.float32, torch.device("cpu"))[1]) > 1)


# CI's second torch phase runs the gradient cells (`heavy`: see pyproject.toml)
@pytest.mark.parametrize("path", [pytest.param("aot_eager/frozen0", marks=pytest.mark.heavy), "aot_eager+grad/frozen0"])
@pytest.mark.parametrize("name", SEVERAL_ARGS)
def test_jit_with_an_input_that_does_not_require_grad(name: str, path: str) -> None:
    """The case's first argument (a loop's initial carry, the data) does not require grad; the
    others (closed-over parameters) do. torch's while_loop backward then dropped the gradient
    through the carry chain (silently wrong parameter gradients); every argument requiring
    grad, as the other cells run, cannot show it."""
    _xfail_known(name, path, "T9")
    _check_path(name, JIT_SPECS[1], path)


@pytest.mark.heavy
@pytest.mark.parametrize("path", ["inductor/frozen0", "inductor+grad/frozen0"])
@pytest.mark.parametrize("name", ["scan", "while_loop", "cond"])
def test_jit_inductor_with_an_input_that_does_not_require_grad(name: str, path: str) -> None:
    _check_path(name, {"T": 5, "C": 2, "seed": 5, "reverse": True}, path)


@pytest.mark.heavy
def test_compiled_paths_one_after_another() -> None:
    """Cells in one process, without resetting Dynamo between them, as a user's program runs
    them (Dynamo caches and automatic dynamic shapes carry over from one to the next)."""
    torch._dynamo.reset()
    for name in ["scan", "scan_stacked", "cond", "switch", "map"]:
        for spec in ({"T": 4, "C": 2, "seed": 1}, {"T": 6, "C": 3, "seed": 2}):
            harness.assert_matches(name, spec, "aot_eager+grad", torch.float32)


# ----------------------------------------------------------------------------------------
# The functorch paths, eagerly: vmap (forward and backward through it), per-example
# gradients (vmap of value_and_grad) and forward mode (jvp), drawn by hypothesis
# ----------------------------------------------------------------------------------------

#: (case, path) -> why it raises a tfun error eagerly instead of a number, asserted below
REFUSED_FUNCTORCH: dict[tuple[str, str], str] = {}


@pytest.mark.parametrize("path", ["vmap", "vmap+grad", "jvp"])
@pytest.mark.parametrize("name", sorted(CASES))
@given(data=st.data())
def test_functorch_paths_float64_and_float32(name: str, path: str, data: st.DataObject) -> None:
    spec = data.draw(specs(name))
    spec["T"] = min(spec["T"], 40)  # a batch of 3 (vmap) or two passes (jvp): keep it quick
    why = REFUSED_FUNCTORCH.get((name, path))
    for dtype in (torch.float64, torch.float32):
        if why is None:
            harness.assert_matches(name, spec, path, dtype)
        else:
            res = harness.compare(name, spec, path, dtype)
            assert isinstance(res, harness.Refused), f"{name} along {path} now runs ({why})"


@pytest.mark.parametrize("path", ["eager", "vmap", "jvp", "aot_eager"])
@pytest.mark.parametrize("name", ["scan", "associative_scan"])
def test_length_zero(name: str, path: str) -> None:
    """T = 0: the final carry is `init`, the ys are empty (scan); nothing to combine
    (associative_scan). (map and linear_scan at T = 0 return outputs that depend on no input,
    which torch.autograd.grad refuses whatever the path: not compared.)"""
    torch._dynamo.reset()
    harness.assert_matches(name, {"T": 0, "C": 2, "seed": 1, "reverse": True}, path, torch.float32)
