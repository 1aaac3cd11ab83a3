"""tfun.lax.linear_scan: semantics, the pure-torch paths, gradients, transforms, errors.

The Triton kernels themselves are tested in tests/kernels/test_linear_scan.py (interpreter).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import tfun  # noqa: F401  (registers the impls)
from tfun.errors import ArgumentTypeError, ArgumentValueError, TensorMismatchError
from tfun.kernels import _linear_scan_ref as ref
from tfun.lax._linear_scan import linear_scan

ALGORITHMS = {
    "sequential": ref.linear_scan_sequential,
    "logdepth": ref.linear_scan_logdepth,
    "chunked": ref.linear_scan_chunked,
    "chunked-3": lambda a, b, h0, axis, reverse: ref.linear_scan_chunked(a, b, h0, axis, reverse, chunk=3),
    "auto": ref.linear_scan_torch,
}


def python_loop(a: torch.Tensor, b: torch.Tensor, init: torch.Tensor | None, axis: int, reverse: bool) -> torch.Tensor:
    """The docstring's semantics, literally, in float64 on moved axes."""
    b64 = b.double().movedim(axis, 0)
    a64 = torch.broadcast_to(a.double(), b.shape).movedim(axis, 0)
    h = torch.zeros(b64.shape[1:], dtype=torch.float64) if init is None else torch.broadcast_to(init.double(), b64.shape[1:])
    out = torch.empty_like(b64)
    for t in reversed(range(b64.shape[0])) if reverse else range(b64.shape[0]):
        h = a64[t] * h + b64[t]
        out[t] = h
    return out.movedim(0, axis)


@st.composite
def problems(draw: st.DrawFn) -> tuple:
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(0 if ndim == 1 else 1, 9), min_size=ndim, max_size=ndim)))
    axis = draw(st.integers(-ndim, ndim - 1))
    T = draw(st.integers(0, 70))
    shape = shape[: axis % ndim] + (T,) + shape[axis % ndim + 1 :]
    # a broadcasts to b: drop leading dims and/or set some dims to 1
    a_shape = list(shape)
    for i in range(ndim):
        if draw(st.booleans()):
            a_shape[i] = 1
    a_shape = a_shape[draw(st.integers(0, ndim)) :] if draw(st.booleans()) else a_shape
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    a = -1.2 + 2.4 * torch.rand(a_shape, generator=g, dtype=torch.float64)  # negative and > 1 too
    b = torch.randn(shape, generator=g, dtype=torch.float64)
    state = shape[: axis % ndim] + shape[axis % ndim + 1 :]
    init = torch.randn(state, generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    return a, b, init, axis, draw(st.booleans())


@given(problems())
def test_torch_paths_match_python_loop(problem: tuple) -> None:
    a, b, init, axis, reverse = problem
    expected = python_loop(a, b, init, axis, reverse)
    ax = axis % b.dim()
    state = b.shape[:ax] + b.shape[ax + 1 :]
    h0 = torch.zeros(state, dtype=b.dtype) if init is None else init
    for name, fn in ALGORITHMS.items():
        got = fn(a.expand(b.shape), b, h0, ax, reverse)
        assert got.shape == b.shape, name
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9, msg=lambda m: f"{name}: {m}")
    got = linear_scan(a, b, init, axis=axis, reverse=reverse, impl="torch")
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("reverse", [False, True])
def test_gradcheck(name: str, reverse: bool) -> None:
    g = torch.Generator().manual_seed(1)
    a = torch.rand(1, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 11, 3, generator=g, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    fn = ALGORITHMS[name]
    assert torch.autograd.gradcheck(lambda a, b, h0: fn(a.expand(b.shape), b, h0, 1, reverse), (a, b, h0))


def test_long_sequence_every_algorithm() -> None:
    g = torch.Generator().manual_seed(2)
    a = 0.5 + 0.49 * torch.rand(3000, 4, generator=g, dtype=torch.float64)
    b = torch.randn(3000, 4, generator=g, dtype=torch.float64)
    h0 = torch.randn(4, generator=g, dtype=torch.float64)
    expected = python_loop(a, b, h0, 0, True)
    for name, fn in ALGORITHMS.items():
        torch.testing.assert_close(fn(a, b, h0, 0, True), expected, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_accumulates_in_float32(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    a = (0.9 + 0.099 * torch.rand(2000, 3, generator=g)).to(dtype)
    b = torch.randn(2000, 3, generator=g).to(dtype)
    h = linear_scan(a, b, impl="torch")
    assert h.dtype == dtype
    expected = python_loop(a, b, None, 0, False)
    rtol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(h.double(), expected, rtol=rtol, atol=rtol * expected.abs().max().item())


def test_dtype_promotion_and_broadcast_gradient() -> None:
    a = torch.full((1, 3), 0.5, dtype=torch.float32, requires_grad=True)
    b = torch.ones(4, 3, dtype=torch.float64, requires_grad=True)
    init = torch.tensor(2.0, dtype=torch.float32, requires_grad=True)
    h = linear_scan(a, b, init)
    assert h.dtype == torch.float64
    torch.testing.assert_close(h[:, 0], torch.tensor([2.0, 2.0, 2.0, 2.0], dtype=torch.float64))
    h.sum().backward()
    assert a.grad.shape == (1, 3) and init.grad.shape == ()
    # dL/dinit = sum_t prod a = .5 + .25 + .125 + .0625, for each of 3 channels
    torch.testing.assert_close(init.grad, torch.tensor(3 * 0.9375))


def test_jax_agrees() -> None:
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    jax.config.update("jax_enable_x64", True)
    g = torch.Generator().manual_seed(4)
    a = torch.rand(50, 3, generator=g, dtype=torch.float64)
    b = torch.randn(50, 3, generator=g, dtype=torch.float64)

    def combine(x, y):
        return x[0] * y[0], y[0] * x[1] + y[1]

    for reverse in (False, True):
        _, expected = jax.lax.associative_scan(combine, (jnp.asarray(a.numpy()), jnp.asarray(b.numpy())), reverse=reverse)
        got = linear_scan(a, b, reverse=reverse, impl="torch")
        torch.testing.assert_close(got, torch.from_numpy(jax.device_get(expected).copy()))


def test_transforms_and_compile_torch_path() -> None:
    with warnings.catch_warnings():  # torch's own torch.jit.script warning on the first jvp
        warnings.filterwarnings("ignore", message=".*torch.jit.script.*", category=DeprecationWarning)
        import torch._decomp.decompositions_for_jvp  # noqa: F401
    g = torch.Generator().manual_seed(5)
    a, b, h0 = torch.rand(8, 3, generator=g), torch.randn(8, 3, generator=g), torch.randn(3, generator=g)
    ga = torch.func.grad(lambda a: linear_scan(a, b, h0, impl="torch").sum())(a)
    a2 = a.clone().requires_grad_()
    linear_scan(a2, b, h0).sum().backward()
    torch.testing.assert_close(ga, a2.grad)
    vm = torch.func.vmap(lambda a, b, h: linear_scan(a, b, h), in_dims=(1, 1, 0), out_dims=1)(a, b, h0)
    torch.testing.assert_close(vm, linear_scan(a, b, h0))
    _, tangent = torch.func.jvp(lambda b: linear_scan(a, b, h0), (b,), (torch.ones_like(b),))
    torch.testing.assert_close(tangent, linear_scan(a, torch.ones_like(b)))  # linear in b
    compiled = torch.compile(lambda a, b: linear_scan(a, b, h0, reverse=True), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(a, b), linear_scan(a, b, h0, reverse=True))


def test_algorithm_choice_is_by_shape() -> None:
    assert ref.choose_torch_algorithm(16, 1) == "sequential"
    assert ref.choose_torch_algorithm(4096, 1) == "logdepth"
    assert ref.choose_torch_algorithm(65536, 64) == "chunked"
    assert ref.choose_torch_algorithm(1024, 65536) == "sequential"
    # on CUDA each step is a launch: the loop only for a few steps (H100 measurements)
    assert ref.choose_torch_algorithm(8, 1024, "cuda") == "sequential"
    assert ref.choose_torch_algorithm(4096, 1024, "cuda") == "logdepth"
    assert ref.choose_torch_algorithm(256, 16384, "cuda") == "logdepth"
    assert ref.choose_torch_algorithm(4096, 16384, "cuda") == "chunked"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize(("shape", "axis", "reverse", "loop"), [
    ((40, 300), 0, False, True),  # sequential eagerly (C > 256): one loop op traced
    ((3, 70, 40), 1, True, True),  # chunked eagerly (64 < C <= 256): one loop op traced
    ((2, 33), -1, True, False),  # log-depth eagerly (few channels): the same traced
])
def test_traced_cpu_path_is_one_loop_op_with_eagers_values_and_gradients(backend, shape, axis, reverse, loop) -> None:
    """Traced on the CPU, a shape whose eager algorithm is a Python loop (sequential, chunked)
    runs as one `tfun.lax.scan` instead of `T` steps unrolled into the graph (compile time);
    values and gradients are float64 eager's, forward-then-backward and `tfun.jit(tfun.grad)`."""
    T = shape[axis]
    C = math.prod(shape) // T
    assert (ref.choose_torch_algorithm(T, C) != "logdepth") == loop
    g = torch.Generator().manual_seed(6)
    a = 0.5 + 0.5 * torch.rand(shape, dtype=torch.float64, generator=g)
    b = torch.randn(shape, dtype=torch.float64, generator=g)
    h0 = torch.randn([s for i, s in enumerate(shape) if i != axis % len(shape)], dtype=torch.float64, generator=g)
    w = torch.randn(shape, dtype=torch.float64, generator=g)
    loss = lambda a, b, h0: (linear_scan(a, b, h0, axis=axis, reverse=reverse) * w).sum()
    want = torch.func.grad(loss, argnums=(0, 1, 2))(a, b, h0)
    torch._dynamo.reset()
    low = tfun.jit(lambda a, b, h0: linear_scan(a, b, h0, axis=axis, reverse=reverse)).lower(a, b, h0)
    assert low.count("higher_order.scan") == (1 if loop else 0)
    got = tfun.jit(tfun.grad(loss, argnums=(0, 1, 2)), backend=backend)(a, b, h0)
    torch.testing.assert_close(got, want)
    xs = [t.clone().requires_grad_() for t in (a, b, h0)]
    out = tfun.jit(lambda a, b, h0: linear_scan(a, b, h0, axis=axis, reverse=reverse), backend=backend)(*xs)
    torch.testing.assert_close(out, linear_scan(a, b, h0, axis=axis, reverse=reverse))
    torch.testing.assert_close(torch.autograd.grad((out * w).sum(), xs), want)


def test_traced_loop_not_under_vmap_or_second_order() -> None:
    """Where torch's loop ops cannot go (a `torch.func` transform inside the trace, a
    derivative differentiated again) the plain algorithm is traced, as before: both work."""
    g = torch.Generator().manual_seed(7)
    a = 0.5 + 0.5 * torch.rand(3, 40, 40, dtype=torch.float64, generator=g)
    b = torch.randn(3, 40, 40, dtype=torch.float64, generator=g)
    f = lambda a, b: linear_scan(a, b).pow(2).sum()
    torch._dynamo.reset()
    per_example = tfun.jit(tfun.vmap(tfun.grad(f)), backend="aot_eager")(a, b)
    torch.testing.assert_close(per_example, torch.func.vmap(torch.func.grad(f))(a, b))
    hess = lambda a, b: tfun.grad(lambda a: tfun.grad(f)(a, b).sum())(a)
    torch.testing.assert_close(tfun.jit(hess, backend="aot_eager")(a[0], b[0]), hess(a[0], b[0]))


@pytest.mark.parametrize("where", ["cond", "map", "scan"])
def test_traced_in_a_control_flow_body_with_gradients(where: str) -> None:
    """Inside another op's body the traced loop is not used (torch cannot differentiate a scan
    nested in a `cond` branch or a `map` body: found by a correctness hunt, session 19): values
    and gradients equal eager's, forward+backward compiled together and apart."""
    g = torch.Generator().manual_seed(3)
    T, C = 5, 8  # eagerly the sequential algorithm: traced at top level, a loop op
    a = 0.5 + 0.5 * torch.rand(2, T, C, dtype=torch.float64, generator=g)
    b = torch.randn(2, T, C, dtype=torch.float64, generator=g)
    w = torch.randn(2, T, C, dtype=torch.float64, generator=g)
    if where == "cond":
        inner = lambda a, b: tfun.lax.cond(a.sum() > 0, lambda a, b: linear_scan(a, b, axis=1),
                                           lambda a, b: linear_scan(a, b, axis=1, reverse=True), a, b)
    elif where == "map":
        inner = lambda a, b: tfun.lax.map(lambda ab: linear_scan(ab[0], ab[1]), (a, b))
    else:
        inner = lambda a, b: tfun.lax.scan(lambda c, ab: (c, linear_scan(ab[0], ab[1])), 0.0, (a, b))[1]
    f = lambda a, b: (inner(a, b) * w).sum()
    want = tfun.grad(f, argnums=(0, 1))(a, b)
    torch._dynamo.reset()
    got = tfun.jit(tfun.grad(f, argnums=(0, 1)), backend="aot_eager")(a, b)
    torch.testing.assert_close(got, want)
    torch._dynamo.reset()
    xs = [a.clone().requires_grad_(), b.clone().requires_grad_()]
    torch.testing.assert_close(torch.autograd.grad(tfun.jit(f, backend="aot_eager")(*xs), xs), list(want))


# ----------------------------------------------------------------------------------------------
# errors (wording pinned)


def _raises(exc: type, *args: object, **kw: object) -> str:
    with pytest.raises(exc) as info:
        linear_scan(*args, **kw)  # type: ignore[arg-type]
    return str(info.value)


def test_error_shape_mismatch() -> None:
    assert _raises(TensorMismatchError, torch.rand(5, 2), torch.rand(7, 3)) == (
        "tfun.lax.linear_scan: `a` must broadcast to the shape of `b`, but it does not:\n"
        "  * a: shape (5, 2), b: shape (7, 3)\n"
        "Revise `a` so that its shape broadcasts to (7, 3)."
    )


def test_error_a_larger_than_b() -> None:
    msg = _raises(TensorMismatchError, torch.rand(2, 7, 3), torch.rand(7, 3))
    assert "  * a: shape (2, 7, 3), b: shape (7, 3)" in msg


def test_error_devices() -> None:
    assert _raises(TensorMismatchError, torch.rand(7, 3, device="meta"), torch.rand(7, 3)) == (
        "tfun.lax.linear_scan: `a` and `b` must be on the same device, but they differ:\n"
        "  * a: float32[7,3] on meta, b: float32[7,3] on cpu\n"
        "Move `a` to cpu (or `b` to meta)."
    )


def test_error_integer_dtype() -> None:
    assert _raises(ArgumentTypeError, torch.rand(7, 3), torch.ones(7, 3, dtype=torch.int32)) == (
        "tfun.lax.linear_scan: `b` must have a floating dtype (float16, bfloat16, float32 or float64), "
        "but it is int32[7,3] on cpu.\n"
        "Convert `b` with `.float()` (or another floating dtype)."
    )


def test_error_not_a_tensor() -> None:
    assert _raises(ArgumentTypeError, [0.5], torch.rand(3)) == (
        "tfun.lax.linear_scan: `a` must be a tensor, but it is a list.\n"
        "Pass `a` as a floating-point torch.Tensor."
    )


def test_error_axis_out_of_range() -> None:
    assert _raises(ArgumentValueError, torch.rand(7, 3), torch.rand(7, 3), axis=2) == (
        "tfun.lax.linear_scan: axis=2 is out of range for tensors of rank 2 (valid: -2 to 1)."
    )


def test_error_init_not_broadcastable() -> None:
    assert _raises(TensorMismatchError, torch.rand(7, 3), torch.rand(7, 3), torch.rand(7)) == (
        "tfun.lax.linear_scan: `init` must broadcast to the state shape, `b`'s shape without axis 0, "
        "but it does not:\n"
        "  * init: shape (7,), state: shape (3,) (b: shape (7, 3))\n"
        "Revise `init` so that its shape broadcasts to (3,)."
    )


def test_error_unknown_impl() -> None:
    assert _raises(ArgumentValueError, torch.rand(7, 3), torch.rand(7, 3), impl="cuda") == (
        'tfun.lax.linear_scan: unknown impl "cuda".\n'
        '  * registered impls: "torch", "triton"\n'
        'Pass impl=None (the fastest available), "torch" or "triton".'
    )


def test_error_triton_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    no_cuda = "" if torch.cuda.is_available() else " (no CUDA device is available)"
    assert _raises(ArgumentValueError, torch.rand(7, 3), torch.rand(7, 3), impl="triton") == (
        'tfun.lax.linear_scan: impl="triton" cannot run here: the Triton kernels need a CUDA device, '
        f"and the tensors are on cpu{no_cuda}; move them to CUDA, or set "
        "TRITON_INTERPRET=1 in the environment to run the kernels in Triton's (slow) CPU interpreter.\n"
        'Pass impl=None or impl="torch" to use the pure-torch path.'
    )


def test_error_scalar_b() -> None:
    assert _raises(ArgumentValueError, torch.rand(()), torch.rand(())) == (
        "tfun.lax.linear_scan: `b` must have at least one dim (the time axis), but it is a scalar.\n"
        "Give `b` a time axis, e.g. `b.reshape(1)`."
    )


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize(("reverse", "axis"), [(False, 0), (True, 1)])
def test_export_with_a_dynamic_length_runs_every_length_with_eagers_values_and_gradients(reverse, axis, strict):
    """`torch.export` with a `Dim` along the scan axis (hunt 24, finding 5: torch's raw
    "Constraints violated (T)": choosing the CPU algorithm by length put a guard `T <= 32` on
    it). Exported, the recurrence is one loop op for every length; the module gives the float64
    eager values and every input's gradient at lengths on both sides of that threshold."""
    from torch.export import Dim

    class M(torch.nn.Module):
        def forward(self, a, b, h0):
            return linear_scan(a, b, h0, reverse=reverse, axis=axis)

    shape = lambda T: (T, 3) if axis == 0 else (2, T, 3)  # noqa: E731
    h_shape = (3,) if axis == 0 else (2, 3)
    g = torch.Generator().manual_seed(3)
    T = Dim("T", min=2, max=128)
    ep = torch.export.export(
        M(), (torch.rand(shape(8)), torch.randn(shape(8)), torch.randn(h_shape)),
        dynamic_shapes=({axis: T}, {axis: T}, None), strict=strict,
    )
    for T in (2, 8, 33, 70):
        a = (torch.rand(shape(T), dtype=torch.float64, generator=g) * 0.9).requires_grad_()
        b = torch.randn(shape(T), dtype=torch.float64, generator=g, requires_grad=True)
        h0 = torch.randn(h_shape, dtype=torch.float64, generator=g, requires_grad=True)
        want = M()(a, b, h0)
        wants = torch.autograd.grad((want * torch.cos(want)).sum(), (a, b, h0))
        args = [t.detach().float().requires_grad_() for t in (a, b, h0)]
        got = ep.module()(*args)
        gots = torch.autograd.grad((got * torch.cos(got)).sum(), args)
        for x, w in ((got, want), *zip(gots, wants)):
            torch.testing.assert_close(x.double(), w.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(ALGORITHMS))
@pytest.mark.parametrize("shape", [(0, 3), (4, 0)])
def test_empty_outputs_join_the_graph(name: str, shape: tuple[int, int]) -> None:
    """Hunt 25 (F10): with no steps (or no channels) the torch algorithms returned a fresh
    empty tensor with no `grad_fn`, so `h.sum().backward()` failed with torch's "does not
    require grad"; now every input gets its (zero) gradient, as through torch's own ops."""
    a = torch.rand(*shape, dtype=torch.float64, requires_grad=True)
    b = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(shape[1], dtype=torch.float64, requires_grad=True)
    h = ALGORITHMS[name](a, b, h0, 0, False)
    assert h.shape == shape and h.requires_grad
    for g, x in zip(torch.autograd.grad(h.sum(), (a, b, h0)), (a, b, h0)):
        assert torch.equal(g, torch.zeros_like(x))
    h = linear_scan(a, b, init=h0)
    assert h.requires_grad
    h.sum().backward()
    assert torch.equal(h0.grad, torch.zeros_like(h0))
