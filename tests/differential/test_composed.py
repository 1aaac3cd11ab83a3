"""Control flow composed with tfun's other transforms, along every path, against the float64
eager oracle (outputs and gradients).

The cases (`cases.COMPOSED_CASES`) put a `tfun.custom_vjp` function in a scan body and in a cond
branch, a `tfun.custom_jvp` function in a scan body and a cond branch, and `tfun.checkpoint`
around a scan (pytree carry, reverse), a cond and a switch, and a while_loop. Their custom rules
are deliberately not the derivative of the primal, so a path that ignores a rule is caught.

Paths (see `harness`): eager float32 (hypothesis over shapes); `tfun.jit` with `aot_eager` and
with Inductor, `.backward()`-style (`torch.autograd.grad` through the jitted outputs) and JAX's
`jit(value_and_grad)`; `grad(jit(f))`; `vmap`, per-example gradients and `jvp` (hypothesis);
and the vmap paths compiled, `jit(vmap(f))` and `jit(vmap(value_and_grad))`. A path gives the
oracle's numbers or raises a tfun error; `REFUSED` lists the ones that raise one today, each
asserted to raise it.

This file also compiles the vmap paths of the plain `tfun.lax` cases, and checks JAX's
forwarding under vmap with a batched predicate: an operand a cond/switch/while_loop returns
unchanged stays unbatched (`out_axes=None`), eagerly, against a per-example Python loop, and
under `tfun.jit`.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfun
from tfun.errors import JitError, TfunError

from . import harness
from .cases import CASES, COMPOSED_CASES

lax = tfun.lax

# torch 2.13 cannot compile a torch.func transform around a control-flow HOP (see
# tests/test_jit_matrix.py), nor trace a custom rule inside one: `jit(vmap(f))` of a composed
# case is refused with a JitError, except `remat_cond`'s and `custom_vjp_cond`'s (a batched
# predicate: every branch inline, then a select), and `remat_scan`'s (since tfun's vmap rule for
# scan keeps the batch dimension first, `_compat.scan_vmap_fixes`), which compile and are compared.
# (`jit(vmap(value_and_grad))` is refused for every case, plain ones included: see below.)
_COMPILE_UNDER_VMAP = ("remat_cond", "custom_vjp_cond", "remat_scan")
REFUSED: dict[tuple[str, str], type[TfunError]] = {
    **{(name, "aot_eager+vmap"): JitError for name in COMPOSED_CASES if name not in _COMPILE_UNDER_VMAP},
    # forward mode through a custom_vjp function is refused eagerly, as in JAX
    ("custom_vjp_scan", "jvp"): TfunError,
}
#: refused only where the data takes the branch holding the custom_vjp function (eagerly, only
#: the branch taken runs): the path must match the oracle or raise this error
REFUSED_IF_TAKEN: dict[tuple[str, str], type[TfunError]] = {("custom_vjp_cond", "jvp"): TfunError}


def _check(name: str, spec: dict, path: str, dtype: torch.dtype = torch.float32) -> None:
    why = REFUSED.get((name, path))
    maybe = REFUSED_IF_TAKEN.get((name, path))
    if maybe is not None:
        res = harness.compare(name, spec, path, dtype)
        if isinstance(res, harness.Refused):
            assert isinstance(res.error, maybe), res.error
        else:
            harness.assert_matches(name, spec, path, dtype)
        return
    if why is None:
        harness.assert_matches(name, spec, path, dtype)
        return
    res = harness.compare(name, spec, path, dtype)
    assert isinstance(res, harness.Refused), f"{name} along {path} now runs: move it out of REFUSED"
    assert isinstance(res.error, why), res.error


@st.composite
def specs(draw: st.DrawFn) -> dict:
    return {
        "T": draw(st.one_of(st.sampled_from([1, 2, 7]), st.integers(1, 40))),
        "C": draw(st.sampled_from([1, 2, 5])),
        "seed": draw(st.integers(0, 10_000)),
        "reverse": draw(st.booleans()),
    }


@pytest.mark.parametrize("name", sorted(COMPOSED_CASES))
@settings(max_examples=8)
@given(spec=specs())
def test_eager_float32_matches_float64(name: str, spec: dict) -> None:
    harness.assert_matches(name, spec, "eager", torch.float32)


@pytest.mark.parametrize("path", ["vmap", "vmap+grad", "jvp"])
@pytest.mark.parametrize("name", sorted(COMPOSED_CASES))
@settings(max_examples=5)
@given(spec=specs())
def test_functorch_paths(name: str, path: str, spec: dict) -> None:
    for dtype in (torch.float64, torch.float32):
        _check(name, spec, path, dtype)


JIT_SPEC = {"T": 5, "C": 3, "seed": 5, "reverse": True}


#: `jit(value_and_grad)` (the slowest cells) for the custom_vjp cases only: the custom_jvp one
#: runs it under Inductor below, and jit(grad(checkpoint(control flow))) is compared with eager
#: float64 in tests/test_checkpoint_jit.py
AOT_EAGER_CELLS = [
    *((name, path) for name in sorted(COMPOSED_CASES) for path in ("aot_eager", "grad_of_jit", "aot_eager+vmap")),
    ("custom_vjp_scan", "aot_eager+grad"),
    ("custom_vjp_cond", "aot_eager+grad"),
    # `jit(lambda: vjp(f, x)[1](ct))`: the rules (deliberately not the derivatives) must be used
    # (CI's second torch phase runs these on the cond and scan with a custom_vjp: `heavy`, pyproject.toml)
    *(
        (name, "aot_eager+vjp") if name in ("custom_vjp_cond", "custom_vjp_scan")
        else pytest.param(name, "aot_eager+vjp", marks=pytest.mark.heavy)
        for name in sorted(COMPOSED_CASES)
    ),
]


@pytest.mark.parametrize(("name", "path"), AOT_EAGER_CELLS)
def test_jit_aot_eager(name: str, path: str) -> None:
    torch._dynamo.reset()  # each cell compiles from scratch, as a new program would
    _check(name, JIT_SPEC, path)


#: Inductor takes 10-30 s per cell on a 2-core CI machine: one cell per rule kind and place
#: (a custom_vjp in a scan body and in a cond branch, a custom_jvp in both under
#: `jit(value_and_grad)`, a checkpointed while_loop). A checkpointed scan under Inductor is in
#: tests/test_checkpoint_jit.py; the other cells pass too (run them with `-k inductor` after
#: widening this list) but are left out of CI for time.
#: CI's second torch phase keeps the cond and while_loop cells (`heavy`: see pyproject.toml).
INDUCTOR_CELLS = [
    pytest.param("custom_vjp_scan", "inductor", marks=pytest.mark.heavy),
    ("custom_vjp_cond", "inductor"),
    pytest.param("custom_jvp_scan", "inductor+grad", marks=pytest.mark.heavy),
    ("remat_while", "inductor"),
]


@pytest.mark.parametrize(("name", "path"), INDUCTOR_CELLS)
def test_jit_inductor(name: str, path: str) -> None:
    torch._dynamo.reset()
    _check(name, JIT_SPEC, path)


# ----------------------------------------------------------------------------------------
# The vmap paths of the plain tfun.lax cases, compiled: jit(vmap(f)) and jit(vmap(grad))
# ----------------------------------------------------------------------------------------

#: (case, path) -> why torch 2.13 makes tfun raise a JitError there; the other cases compile
#: under a traced vmap and are compared
REFUSED_LAX_VMAP_JIT: dict[tuple[str, str], str] = {
    ("fori_loop", "aot_eager+vmap"): "xs[i] with a traced index (as without vmap)",
    ("while_loop", "aot_eager+vmap"): "torch's while_loop has no vmap rule (tfun's JitError)",
}
# vmap of a gradient through control flow compiles as the gradient of the summed, vmapped
# loss (`tfun._vmap._per_example_gradients`); the loops refused under a traced vmap stay refused
for _name in ("fori_loop", "while_loop"):
    REFUSED_LAX_VMAP_JIT[(_name, "aot_eager+vmap+grad")] = REFUSED_LAX_VMAP_JIT[(_name, "aot_eager+vmap")]


# torch's vmap falls back to a loop for aten::select_copy (map's slices) and says so with a
# UserWarning, which this suite's warnings-as-errors would turn into a compile failure
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
@pytest.mark.parametrize(
    ("name", "path"),
    [
        *((name, "aot_eager+vmap") for name in sorted(CASES)),
        *((name, "aot_eager+vmap+grad") for name in sorted(CASES)),
    ],
)
def test_lax_vmap_under_jit(name: str, path: str) -> None:
    torch._dynamo.reset()
    spec = {"T": 4, "C": 2, "seed": 7, "reverse": True, "axis": 1, "batch_size": 2}
    why = REFUSED_LAX_VMAP_JIT.get((name, path))
    if why is None:
        harness.assert_matches(name, spec, path, torch.float32)
        return
    res = harness.compare(name, spec, path, torch.float32)
    assert isinstance(res, harness.Refused), f"{name} along {path} now runs ({why}): move it out"
    assert isinstance(res.error, JitError), res.error


# ----------------------------------------------------------------------------------------
# JAX's forwarding under vmap: an operand that cond/switch/while_loop return unchanged stays
# unbatched (out_axes=None), against a per-example Python loop in float64
# ----------------------------------------------------------------------------------------

FORWARD_OPS = ("cond", "switch", "while_loop")
#: (op, predicate, path) -> refused with a JitError: any while_loop under a traced vmap (no
#: vmap rule for torch's while_loop). A cond or switch with a batched predicate there is every
#: branch and a select (`_cond._lower_selected`), and forwards as eagerly.
REFUSED_FORWARDING = {
    ("while_loop", "batched", "aot_eager"),
    ("while_loop", "unbatched", "aot_eager"),
}


def _forwarding_fn(op: str, pred: str):
    """f(x, y) -> (out, y): `y` (shared by the batch, in_axes None) is returned unchanged by
    every branch / by the loop body; the predicate depends on `x` ("batched") or on `y`."""

    def f(x, y):
        s = (x if pred == "batched" else y).sum()
        if op == "cond":
            return lax.cond(s > 0, lambda x, y: (x * 2 + y, y), lambda x, y: (torch.sin(x) * y, y), x, y)
        if op == "switch":
            index = (s > 0).to(torch.int64) + (s > 1).to(torch.int64)
            branches = [lambda x, y: (x * y, y), lambda x, y: (torch.tanh(x) + y, y), lambda x, y: (x * x, y)]
            return lax.switch(index, branches, x, y)
        n = (s.abs() * 2).to(torch.int64) % 4

        def body(c):
            i, x, y = c
            return i + 1, torch.sin(x) * y + 0.5, y

        _, x, y = lax.while_loop(lambda c: c[0] < n, body, (torch.zeros((), dtype=torch.int64), x, y))
        return x, y

    return f


def _forwarding_inputs(B: int, C: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, generator=g, dtype=torch.float64) * 1.5, torch.randn(C, generator=g, dtype=torch.float64)


def _forwarding_loss(out: torch.Tensor, y_out: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(9)
    w_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    w_y = torch.randn(y_out.shape, generator=g, dtype=torch.float64)
    return (out.double() * w_out).sum() + (y_out.double() * w_y).sum()


def _check_forwarding(op: str, pred: str, path: str, B: int, C: int, seed: int) -> None:
    f = _forwarding_fn(op, pred)
    xs64, y64 = _forwarding_inputs(B, C, seed)
    # the oracle: each example alone, eagerly, in float64, from the float32-rounded inputs
    xs_o, y_o = (t.float().double().requires_grad_() for t in (xs64, y64))
    per = [f(xs_o[k], y_o) for k in range(B)]
    assert all(p[1] is y_o for p in per)  # eagerly, every example forwards y itself
    want_out = torch.stack([p[0] for p in per])
    want_g = torch.autograd.grad(_forwarding_loss(want_out, per[0][1]), (xs_o, y_o))

    vf = tfun.vmap(f, in_axes=(0, None), out_axes=(0, None))
    run = vf if path == "eager" else tfun.jit(vf, backend=path)
    xs, y = (t.float().requires_grad_() for t in (xs64, y64))
    if (op, pred, path) in REFUSED_FORWARDING:
        # (a while_loop under a traced vmap is refused by tfun itself: it has no vmap rule)
        with pytest.raises(JitError, match="tfun.jit: could not compile|tfun.lax.while_loop: under tfun.jit, this loop is inside a torch.func transform"):
            run(xs, y)
        return
    out, y_out = run(xs, y)
    assert y_out.shape == y.shape  # unbatched: out_axes=None applied
    got_g = torch.autograd.grad(_forwarding_loss(out, y_out), (xs, y))
    out_tol, grad_tol = harness.TOLERANCE[torch.float32]
    assert harness.max_rel_error(harness._cpu64([out, y_out]), [want_out.detach(), y_o.detach()]) <= out_tol
    assert harness.max_rel_error(harness._cpu64(got_g), list(want_g)) <= grad_tol


@pytest.mark.parametrize("pred", ["batched", "unbatched"])
@pytest.mark.parametrize("op", FORWARD_OPS)
@settings(max_examples=8)
@given(B=st.integers(1, 5), C=st.sampled_from([1, 2, 5]), seed=st.integers(0, 10_000))
def test_forwarding_under_vmap_eager(op: str, pred: str, B: int, C: int, seed: int) -> None:
    _check_forwarding(op, pred, "eager", B, C, seed)


@pytest.mark.parametrize("pred", ["batched", "unbatched"])
@pytest.mark.parametrize("op", FORWARD_OPS)
def test_forwarding_under_vmap_jit(op: str, pred: str) -> None:
    """Regression (cond, switch with an unbatched predicate): under tfun.jit, torch.cond
    batched the forwarded operand, and out_axes=None failed with a false "depends on the mapped
    axis"; `_cond._forward` now returns the operand itself, as eagerly. With a batched predicate
    (every branch, then a select) they were refused: torch's vmap rule for torch.cond kept only
    the first of the two outputs."""
    torch._dynamo.reset()
    _check_forwarding(op, pred, "aot_eager", 3, 2, 11)
