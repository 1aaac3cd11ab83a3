"""Run a differential case along one path and compare it with the float64 eager oracle.

Paths:

- `"eager"`: the op as called, in the given dtype and device.
- `"aot_eager"`, `"inductor"`: `tfun.jit(fn, backend=...)`, gradients by `torch.autograd.grad`
  of a loss computed from the jitted outputs (the backward is compiled by AOTAutograd).
- `"aot_eager+grad"`, `"inductor+grad"`: JAX's training step, `tfun.jit(tfun.value_and_grad(loss))`,
  the whole forward and backward traced into one graph.
- `"aot_eager+vjp"`, `"inductor+vjp"`: `tfun.vjp` inside `tfun.jit`, JAX's `jit(lambda: vjp(f, x)[1](ct))`,
  pulling back the loss weights (so its gradients are the loss's).
- `"vmap"`: `tfun.vmap(fn)` over a batch of `VMAP_BATCH` copies of the case, each built from its
  own seed (`spec["seed"] + k`); gradients by autograd through the batched outputs. Slice `k` is
  compared with the oracle of seed `k`, so a batched predicate (cond, switch, while_loop) must
  take each example's own branch or trip count, as in JAX.
- `"vmap+grad"`: per-example gradients, `tfun.vmap(tfun.value_and_grad(loss))`, over the same batch.
- `"aot_eager+vmap"`, `"inductor+vmap"`: `tfun.jit(tfun.vmap(fn), backend=...)`, the vmap path
  compiled (gradients by autograd through the jitted batched outputs); `"...+vmap+grad"`:
  `tfun.jit(tfun.vmap(tfun.value_and_grad(loss)))`, per-example gradients compiled.
- `"grad_of_jit"`: `tfun.value_and_grad` of a loss of `tfun.jit(fn)` (JAX's `grad(jit(f))`;
  torch cannot enter Dynamo inside a torch.func transform, so `tfun.jit` runs `fn` eagerly there).
- `"jvp"`: forward mode, `tfun.jvp(fn, args, tangents)` with random tangents `v`. Its outputs are
  the primal outputs; its "gradient" is the directional derivative of the weighted loss,
  `sum(w * tangent_out)`, which the oracle computes by reverse mode as `sum(grad * v)`.

The loss is a fixed random weighting of every floating output, so every output's gradient
matters. A path either gives the oracle's outputs and gradients within the dtype's tolerance, or
raises a `tfun.errors.TfunError` (returned as `Refused`); any other exception propagates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

import tfun
from tfun.errors import TfunError
from tfun.tree import tree_leaves

from .cases import ALL_CASES, Spec

#: (relative tolerance on outputs, on gradients), relative to the largest oracle magnitude
TOLERANCE = {
    torch.float64: (1e-9, 1e-8),
    torch.float32: (2e-4, 1e-3),
    torch.bfloat16: (6e-2, 1.5e-1),
}
PATHS = (
    "eager",
    "aot_eager",
    "inductor",
    "aot_eager+grad",
    "inductor+grad",
    "aot_eager+nograd",
    "inductor+nograd",
    "aot_eager+vjp",
    "inductor+vjp",
    "vmap",
    "vmap+grad",
    "jvp",
    "aot_eager+vmap",
    "inductor+vmap",
    "aot_eager+vmap+grad",
    "inductor+vmap+grad",
    "grad_of_jit",
)
#: examples in the batch of the vmap paths
VMAP_BATCH = 3


@dataclasses.dataclass
class Result:
    outs: list[torch.Tensor]
    grads: list[torch.Tensor]


@dataclasses.dataclass
class Refused:
    error: TfunError


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())


def _weights(outs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randn(t.shape, generator=g, dtype=torch.float64) if _floating(t) else None for t in outs]


def _loss(outs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor | None]) -> torch.Tensor:
    total = None
    for t, w in zip(outs, weights):
        if w is not None:
            term = (t.to(torch.float64) * w.to(t.device)).sum()
            total = term if total is None else total + term
    assert total is not None, "a differential case must have a floating output"
    return total


def _cpu64(ts: Sequence[Any]) -> list[torch.Tensor]:
    out = []
    for t in ts:
        t = torch.as_tensor(t).detach().cpu()
        out.append(t.to(torch.float64) if _floating(t) else t)
    return out


def run(
    name: str,
    spec: Spec,
    path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    rounded_to: torch.dtype | None = None,
) -> Result | Refused:
    """Outputs and gradients of case `name` built for `spec`, along `path`.

    `rounded_to`: round the floating inputs to that dtype first (then convert to `dtype`), so an
    oracle sees exactly the inputs a lower-precision path sees: a comparison near a branch's
    threshold (`select`, `cond`) then takes the same side on both paths.
    """
    if path.endswith(("vmap", "vmap+grad")):
        backend = path.partition("+")[0] if "+" in path and not path.startswith("vmap") else None
        try:
            return _vmapped(name, spec, dtype, torch.device(device), grad=path.endswith("+grad"), backend=backend)
        except TfunError as e:
            return Refused(e)
    path, frozen = _frozen(path)
    fn, args = ALL_CASES[name](spec, dtype, torch.device(device))
    if rounded_to is not None:
        args = tuple(a.to(rounded_to).to(dtype) if a.is_floating_point() else a for a in args)
    args = tuple(a.detach().requires_grad_(i not in frozen) for i, a in enumerate(args))
    try:
        if path == "eager":
            return _forward_then_grad(fn, args)
        if path == "jvp":
            return _jvp(fn, args)
        if path == "grad_of_jit":
            return _jit_value_and_grad(fn, args, "aot_eager", jit_inside=True)
        backend, _, mode = path.partition("+")
        if backend not in ("aot_eager", "inductor"):
            raise ValueError(f"unknown path {path!r}")
        if mode == "":
            return _forward_then_grad(tfun.jit(fn, backend=backend), args)
        if mode == "grad":
            return _jit_value_and_grad(fn, args, backend, frozen=frozen)
        if mode == "nograd":
            # inference: traced under torch.no_grad(), where lowerings differ (CUDA's fused
            # associative_scan, complex carries passed as real pairs, ...); outputs only
            with torch.no_grad():
                return Result(_cpu64(tree_leaves(tfun.jit(fn, backend=backend)(*args))), [])
        if mode == "grad+graphs":
            return _jit_value_and_grad_replayed(fn, args, backend)
        if mode == "vjp":
            return _jit_vjp(fn, args, backend)
        raise ValueError(f"unknown path {path!r}")
    except TfunError as e:
        return Refused(e)


def _frozen(path: str) -> tuple[str, frozenset[int]]:
    """A path with the suffix `/frozen0` runs with the case's first argument not requiring grad
    (an RNN's initial state, a batch of data): only the other arguments are differentiated,
    and only their gradients are compared (see `compare`)."""
    base, sep, suffix = path.partition("/")
    if not sep:
        return path, frozenset()
    if suffix != "frozen0":
        raise ValueError(f"unknown path suffix {suffix!r} in {path!r}")
    return base, frozenset({0})


def _forward_then_grad(fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> Result:
    outs = tree_leaves(fn(*args))
    weights = _weights(_cpu64(outs))
    wrt = [a for a in args if a.requires_grad]
    grads = dict(zip(map(id, wrt), torch.autograd.grad(_loss(outs, weights), wrt, allow_unused=True)))
    return Result(_cpu64(outs), _cpu64([g if (g := grads.get(id(a))) is not None else torch.zeros_like(a) for a in args]))


def _jit_value_and_grad(
    fn: Callable[..., Any],
    args: tuple[torch.Tensor, ...],
    backend: str,
    jit_inside: bool = False,
    frozen: frozenset[int] = frozenset(),
) -> Result:
    # the loss weights depend only on the output shapes: take them from an eager call
    with torch.no_grad():
        weights = _weights(_cpu64(tree_leaves(fn(*args))))

    inner = tfun.jit(fn, backend=backend) if jit_inside else fn

    def loss(*xs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs = tree_leaves(inner(*xs))
        return _loss(outs, weights), outs

    argnums = tuple(i for i in range(len(args)) if i not in frozen)
    step = tfun.value_and_grad(loss, argnums=argnums, has_aux=True)
    if not jit_inside:
        step = tfun.jit(step, backend=backend)
    (_, outs), grads = step(*(a.detach() for a in args))
    by_arg = dict(zip(argnums, grads))
    return Result(_cpu64(outs), _cpu64([by_arg.get(i, torch.zeros_like(a)) for i, a in enumerate(args)]))


def _jit_value_and_grad_replayed(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], backend: str) -> Result:
    """`"inductor+grad+graphs"` (check_cuda only, not in PATHS): the training step of
    `"inductor+grad"` under `tfun.jit(..., cuda_graphs=True)`, called three times (compile,
    record, replay) on the same arguments; the replay's result is compared. The loss weights are
    arguments (on the outputs' device), so the step reads nothing it is not given. A call that
    cannot be replayed is a `JitError` (a refusal row, with the reason)."""
    with torch.no_grad():
        outs0 = tree_leaves(fn(*args))
    weights = [w.to(o.device) if w is not None else None for w, o in zip(_weights(_cpu64(outs0)), outs0)]
    present = [w for w in weights if w is not None]

    def loss(*xs_and_w: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        xs, ws = xs_and_w[: len(args)], iter(xs_and_w[len(args) :])
        outs = tree_leaves(fn(*xs))
        return _loss(outs, [next(ws) if w is not None else None for w in weights]), outs

    step = tfun.jit(
        tfun.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True), backend=backend, cuda_graphs=True
    )
    call_args = [a.detach() for a in args] + present
    for _ in range(2):
        step(*call_args)
    (_, outs), grads = step(*call_args)
    return Result(_cpu64(outs), _cpu64(list(grads)))


def _jit_vjp(fn: Callable[..., Any], args: tuple[torch.Tensor, ...], backend: str) -> Result:
    """`tfun.vjp` inside `tfun.jit`: the pullback of the loss weights (as cotangents of the
    outputs' dtypes; zeros for integer outputs) is the weighted loss's gradient."""
    with torch.no_grad():
        outs0 = tree_leaves(fn(*args))
    weights = _weights(_cpu64(outs0))
    cts = [w.to(o.dtype).to(o.device) if w is not None else torch.zeros_like(o) for o, w in zip(outs0, weights)]

    def step(*xs: torch.Tensor) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        outs, pull = tfun.vjp(lambda *a: tree_leaves(fn(*a)), *xs)
        return outs, pull(cts)

    outs, grads = tfun.jit(step, backend=backend)(*(a.detach() for a in args))
    return Result(_cpu64(outs), _cpu64(list(grads)))


def _slice_specs(spec: Spec) -> list[Spec]:
    return [{**spec, "seed": int(spec.get("seed", 0)) + k} for k in range(VMAP_BATCH)]


def _vmapped(name: str, spec: Spec, dtype: torch.dtype, device: torch.device, grad: bool, backend: str | None = None) -> Result:
    """`tfun.vmap` of the case over the batch of `_slice_specs(spec)`, compiled by `tfun.jit`
    with `backend` if one is given; outputs and gradients of each example, concatenated in
    example order (as `_oracle` lays them out)."""
    built = [ALL_CASES[name](s, dtype, device) for s in _slice_specs(spec)]
    fn = built[0][0]  # the function depends on the spec's shapes, not on its seed
    args = tuple(torch.stack(col).detach() for col in zip(*(b[1] for b in built)))
    with torch.no_grad():
        weights = _weights(_cpu64(tree_leaves(ALL_CASES[name](spec, torch.float64, torch.device("cpu"))[0](*built[0][1]))))

    def loss(*xs: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs = tree_leaves(fn(*xs))
        return _loss(outs, weights), outs

    def jit(f: Callable[..., Any]) -> Callable[..., Any]:
        return f if backend is None else tfun.jit(f, backend=backend)

    if grad:
        (_, outs), grads = jit(tfun.vmap(tfun.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)))(*args)
    else:
        args = tuple(a.requires_grad_() for a in args)
        outs = tree_leaves(jit(tfun.vmap(fn))(*args))
        # the loss of each example with the same weights: slice k's gradient is example k's
        total = sum(_loss([o[k] for o in outs], weights) for k in range(VMAP_BATCH))
        found = torch.autograd.grad(total, args, allow_unused=True)
        grads = [torch.zeros_like(a) if g is None else g for a, g in zip(args, found)]
    return Result(_per_example(_cpu64(outs)), _per_example(_cpu64(grads)))


def _per_example(batched: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t[k] for k in range(VMAP_BATCH) for t in batched]


def _jvp(fn: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> Result:
    primals = tuple(a.detach() for a in args)
    tangents = _tangents(primals)
    outs, touts = tfun.jvp(lambda *xs: tree_leaves(fn(*xs)), primals, tangents)
    weights = _weights(_cpu64(outs))
    directional = sum(
        (t.to(torch.float64) * w.to(t.device)).sum() for t, w in zip(touts, weights) if w is not None and _floating(t)
    )
    return Result(_cpu64(outs), _cpu64([torch.as_tensor(directional)]))


def _tangents(primals: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(4321)
    return tuple(
        torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype).to(p.device) if p.is_floating_point() else torch.zeros_like(p)
        for p in primals
    )


def _oracle(name: str, spec: Spec, path: str, dtype: torch.dtype) -> Result:
    """The float64 eager oracle of `path`, laid out as that path lays out its results."""
    oracle_spec = {**spec, "impl": "torch"} if "impl" in spec else spec
    if path.endswith(("vmap", "vmap+grad")):
        parts = [run(name, s, "eager", torch.float64, "cpu", rounded_to=dtype) for s in _slice_specs(oracle_spec)]
        for r in parts:
            assert isinstance(r, Result), f"the oracle itself refused: {getattr(r, 'error', None)}"
        return Result([t for r in parts for t in r.outs], [t for r in parts for t in r.grads])  # type: ignore[union-attr]
    oracle = run(name, oracle_spec, "eager", torch.float64, "cpu", rounded_to=dtype)
    assert isinstance(oracle, Result), f"the oracle itself refused: {getattr(oracle, 'error', None)}"
    if path.endswith("+nograd"):
        return Result(oracle.outs, [])  # outputs only
    if path == "jvp":
        fn, args = ALL_CASES[name](oracle_spec, torch.float64, torch.device("cpu"))
        args = tuple(a.to(dtype).to(torch.float64) if a.is_floating_point() else a for a in args)
        tangents = [t.to(dtype).to(torch.float64) for t in _tangents(args)]
        directional = sum((g * t).sum() for g, t in zip(oracle.grads, tangents) if _floating(g))
        return Result(oracle.outs, [torch.as_tensor(directional, dtype=torch.float64)])
    return oracle


def max_rel_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float:
    """The largest |got - want| over all leaves, relative to the largest |want| (at least 1)."""
    if len(got) != len(want):
        return float("inf")
    err = 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return float("inf")
        if not _floating(w):
            if not torch.equal(g, w):
                return float("inf")
            continue
        if w.numel() == 0:
            continue
        scale = max(w.abs().max().item(), 1.0)
        err = max(err, (g - w).abs().max().item() / scale)
    return err


def compare(name: str, spec: Spec, path: str, dtype: torch.dtype, device: str | torch.device = "cpu") -> tuple[float, float] | Refused:
    """(output error, gradient error) of a path against the float64 eager oracle on the CPU."""
    # the oracle runs the pure-torch algorithms (a spec's `impl` picks the path under test)
    _, frozen = _frozen(path)
    oracle = _oracle(name, spec, path.partition("/")[0], dtype)
    got = run(name, spec, path, dtype, device)
    if isinstance(got, Refused):
        return got
    # a frozen argument's gradient is not asked for: the others' must match the oracle's,
    # which differentiates every argument (the same numbers, mathematically)
    keep = [i for i in range(len(oracle.grads)) if i not in frozen]
    got_grads = [got.grads[i] for i in keep] if len(got.grads) == len(oracle.grads) else got.grads
    return max_rel_error(got.outs, oracle.outs), max_rel_error(got_grads, [oracle.grads[i] for i in keep])


def assert_matches(name: str, spec: Spec, path: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> None:
    res = compare(name, spec, path, dtype, device)
    if isinstance(res, Refused):
        raise AssertionError(f"{name} {spec} along {path} refused:\n{res.error}")
    out_err, grad_err = res
    out_tol, grad_tol = TOLERANCE[dtype]
    assert out_err <= out_tol, f"{name} {spec} {path} {dtype}: outputs off by {out_err:.3g} (tolerance {out_tol})"
    assert grad_err <= grad_tol, f"{name} {spec} {path} {dtype}: gradients off by {grad_err:.3g} (tolerance {grad_tol})"
