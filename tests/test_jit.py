"""tfun.jit: JAX's jit semantics over torch.compile."""

from __future__ import annotations

import gc
import re
import warnings

import pytest
import torch

import tfun
from tfun import _jit, lax
from tfun.errors import ArgumentTypeError, ArgumentValueError, StructureMismatchError, TfunError
from tfun.errors import JitError

from .helpers import assert_tree_allclose

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
]


def _loss(W, xs):
    def step(h, x):
        h = torch.tanh(h @ W + x)
        return h, h * 1.0

    return lax.scan(step, torch.zeros(W.shape[0]), xs)[1].sum()


def test_decorator_forms_and_pytrees():
    @tfun.jit(backend="eager")
    def f(d):
        return {"s": d["a"] + d["b"][0], "t": (d["b"][1] * 2, None)}

    @tfun.jit
    def g(x):
        return x + 1

    d = {"a": torch.ones(2), "b": (torch.ones(2), torch.full((1,), 3.0))}
    out = f(d)
    assert_tree_allclose(out, {"s": torch.full((2,), 2.0), "t": (torch.full((1,), 6.0), None)})
    assert f.__name__ == "f"
    assert tfun.jit(lambda x: x * 3, backend="eager")(torch.ones(1)).item() == 3.0
    assert isinstance(g, tfun._jit.Jitted)


def test_static_argnums_compile_once_per_value():
    from torch._dynamo.testing import CompileCounter

    def f(x, n, mode="add"):
        return lax.fori_loop(0, n, lambda i, c: c + 1 if mode == "add" else c * 2, x)

    counter = CompileCounter()
    j = tfun.jit(f, static_argnums=1, static_argnames="mode", backend=counter)
    x = torch.zeros(2)
    assert j(x, 3).tolist() == [3.0, 3.0]
    assert j(x, 3).tolist() == [3.0, 3.0]
    assert j(x, n=3).tolist() == [3.0, 3.0]  # static by name too (JAX)
    assert counter.frame_count == 1
    assert j(torch.ones(2), 2, mode="mul").tolist() == [4.0, 4.0]
    assert counter.frame_count == 2
    assert len(j._cache) == 2


def test_static_cache_is_lru_bounded_and_releases_evicted_values():
    import weakref

    j = tfun.jit(lambda x, k: x * k.scale, static_argnums=1, backend="eager", cache_size=2)

    class K:
        def __init__(self, s):
            self.scale = s

    ks = [K(i) for i in range(3)]
    refs = [weakref.ref(k) for k in ks]
    for k in ks:
        j(torch.ones(1), k)
    assert len(j._cache) == 2
    del ks, k
    gc.collect()
    assert refs[0]() is None  # evicted: nothing keeps it alive
    j.clear_cache()
    gc.collect()
    assert all(r() is None for r in refs)


def test_bad_static_arguments():
    j = tfun.jit(lambda x, n: x * n, static_argnums=1, backend="eager")
    with pytest.raises(ArgumentTypeError, match="argument 1 of `<lambda> at .*` is static, so it must be hashable"):
        j(torch.ones(1), [2])
    with pytest.raises(ArgumentTypeError, match="is static, but it is a tensor"):
        j(torch.ones(1), torch.ones(1))
    with pytest.raises(ArgumentValueError, match="static_argnums contains 5, but `f at .*` takes 2 positional"):

        def f(x, n):
            return x

        tfun.jit(f, static_argnums=5)
    with pytest.raises(ArgumentValueError, match="static_argnames contains 'm'"):
        tfun.jit(f, static_argnames="m")
    with pytest.raises(ArgumentTypeError):
        tfun.jit(f, static_argnums="n")


def test_graph_break_is_jit_error_naming_the_line():
    def f(x):
        if x.sum() > 0:  # data-dependent Python control flow
            return x
        return -x

    with pytest.raises(JitError) as info:
        tfun.jit(f, backend="eager")(torch.ones(2))
    msg = str(info.value)
    assert msg.startswith("tfun.jit: could not compile `f at ")
    assert "test_jit.py:" in msg and "if x.sum() > 0" in msg
    assert isinstance(info.value, TfunError)
    # fullgraph=False lets it break instead
    assert tfun.jit(f, backend="eager", fullgraph=False)(torch.ones(2)).tolist() == [1.0, 1.0]


def test_a_failing_compiler_backend_is_a_jit_error_that_says_so():
    """Traced fine, then the backend failed (torch 2.11's cpp_wrapper on a scan): the error names
    the backend's exception and where it was raised, and does not blame the user's code."""

    def failing_backend(gm, example_inputs):
        raise AssertionError("graph inputs do not match")

    def f(x):
        return lax.fori_loop(0, 3, lambda i, c: c * 2, x)

    with pytest.raises(JitError) as info:
        tfun.jit(f, backend=failing_backend)(torch.ones(2))
    msg = str(info.value)
    assert msg.startswith("tfun.jit: could not compile `f at ")
    assert "the compiler backend failed: AssertionError: graph inputs do not match (raised in `failing_backend`, test_jit.py:" in msg
    assert "not of your code" in msg and 'backend="aot_eager"' in msg
    assert "Revise that line" not in msg


def test_a_warning_raised_as_an_error_while_compiling_says_so():
    """Under warnings-as-errors a warning issued while compiling is an exception (Inductor's
    TF32 advice failed a suite on an H100 that way): the error names the warning and the filter,
    not a compiler failure, and gives a filter that ignores it."""

    def warning_backend(gm, example_inputs):
        warnings.warn("TensorFloat32 tensor cores available but not enabled (a note)", UserWarning, stacklevel=1)
        return gm

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(JitError) as info:
            tfun.jit(lambda x: x * 2, backend=warning_backend)(torch.ones(2))
    msg = str(info.value)
    assert "* UserWarning: TensorFloat32 tensor cores available but not enabled (a note)" in msg
    assert "warnings filter in effect turns warnings into errors" in msg
    assert r'message=r"TensorFloat32 tensor cores available but not enabled \(a note")' in msg
    assert "limitation of the installed torch" not in msg and "Revise that line" not in msg
    # the filter it suggests lets the same call compile
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=_jit._warning_pattern(info.value.dynamo_error.inner_exception))
        assert tfun.jit(lambda x: x * 2, backend=warning_backend)(torch.ones(2)).tolist() == [2.0, 2.0]


def test_the_suggested_filter_escapes_what_a_regex_reads_specially():
    """The pattern tfun.jit suggests for a warning raised as an error matches that warning's
    message: torch's "`torch.jit.script_method` is deprecated. ..." gave "`torch" (cut at the
    first dot) before."""
    message = "`torch.jit.script_method` is deprecated. Please switch to `torch.compile` or `torch.export`."
    pattern = _jit._warning_pattern(DeprecationWarning(message))
    assert pattern == r"`torch\.jit\.script_method` is deprecated\. Please switch to `t"
    assert re.match(pattern, message)
    assert _jit._warning_pattern(UserWarning('a "quoted" (x)')) == "a "  # cut at the first quote


_WARNINGS_AS_ERRORS_PROGRAM = """
import warnings
warnings.simplefilter("error")
import torch
import tfun
from tfun import lax

W = torch.randn(3, requires_grad=True, dtype=torch.float64)


def f(x):
    return lax.scan(lambda c, xt: (torch.tanh(c * W + xt), None), torch.zeros(3, dtype=torch.float64), x)[0].sum()


x = torch.randn(20, 3, dtype=torch.float64)
got = tfun.jit(tfun.grad(f), backend="aot_eager")(x)
want = tfun.grad(f)(x)
print("max abs difference", float((got - want).abs().max().detach()))
"""


def test_a_jitted_gradient_of_a_loop_compiles_under_warnings_as_errors():
    """`python -W error`: the first compile of a traced gradient of a scan closing over a
    parameter imports torch's `torch.utils.mkldnn` (through the HOP partitioner), whose import
    deprecates `torch.jit.script_method` (torch 2.11, 2.13): that failed the compile with a
    JitError naming torch's warning. tfun.jit imports it when tfun is imported, with that one
    message ignored (`_compat.import_torch_scripted_modules`). A fresh process, since the module
    is imported once."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run(
        [sys.executable, "-c", _WARNINGS_AS_ERRORS_PROGRAM], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split("max abs difference")[1]) < 1e-12


def _compile_worker_failure(worker_tail: str) -> str:
    """tfun.jit's message for a backend that fails as Inductor does when a compile worker
    fails: a `SubprocException` whose text is the worker's traceback, ending in `worker_tail`."""

    class SubprocException(Exception):
        pass

    def failing_backend(gm, example_inputs):
        raise SubprocException(
            "An exception occurred in a subprocess:\n\nTraceback (most recent call last):\n"
            '  File "worker.py", line 3, in compile\n    run()\n' + worker_tail
        )

    with pytest.raises(JitError) as info:
        tfun.jit(lambda x: x * 2, backend=failing_backend)(torch.ones(2))
    return str(info.value)


def test_a_compile_worker_failure_names_what_the_worker_raised():
    """Inductor re-raises a failure in a compile worker as `SubprocException`, whose first line
    says only that a subprocess failed (nn.MinGRU and nn.Mamba on CUDA with torch 2.11): the
    error adds the worker's own last line."""
    msg = _compile_worker_failure("triton.compiler.errors.CompilationError: at 12:8: shared memory out of resource\n")
    assert "the compiler backend failed: SubprocException: An exception occurred in a subprocess:" in msg
    assert "the worker raised triton.compiler.errors.CompilationError: at 12:8: shared memory out of resource" in msg


def test_a_triton_compilation_error_in_a_worker_gives_the_failing_line_and_the_reason():
    """Triton's `CompilationError` puts its position on the exception line ("at 61:50:") and
    the kernel's source, a caret and the reason on the lines after: nn.MinGRU and nn.Mamba
    under Inductor on an H200 (torch 2.11) were refused with the position alone. The error
    names the failing source line and the reason."""
    msg = _compile_worker_failure(
        "triton.compiler.errors.CompilationError: at 2:12:\n"
        "def triton_red_fused_0(in_ptr0):\n"
        "    tmp3 = tl.associative_scan(tmp2, 1, _combine)\n"
        "           ^\n"
        "NotImplementedError('associative_scan of a tuple with a reduction')\n"
    )
    assert (
        "the worker raised triton.compiler.errors.CompilationError: at 2:12: | tmp3 = tl.associative_scan(tmp2, 1, "
        "_combine) | NotImplementedError('associative_scan of a tuple with a reduction')"
    ) in msg


def test_a_failure_tracing_a_loop_for_autograd_says_every_backend_fails_and_gives_the_details():
    """A backend failure raised in torch's own tracing of a control-flow op (torch's
    `_higher_order_ops`, which AOTAutograd runs for aot_eager too) does not suggest aot_eager,
    and keeps the lines after a headline that ends with ':' (where torch says what differs)."""
    ns: dict = {}
    exec(  # a backend whose innermost frame is in torch/_higher_order_ops, as torch's check is
        compile(
            "def failing_backend(gm, example_inputs):\n"
            "    raise RuntimeError('Expected init and carry to have same metadata but found:\\n'\n"
            "                       'pair[0] differ in stride: (1, 3) vs (4, 1)\\nWhile executing %scan')\n",
            "/site-packages/torch/_higher_order_ops/utils.py",
            "exec",
        ),
        ns,
    )
    with pytest.raises(JitError) as info:
        tfun.jit(lambda x: x * 2, backend=ns["failing_backend"])(torch.ones(2))
    msg = str(info.value)
    assert "same metadata but found: (raised in `failing_backend`, utils.py:2): pair[0] differ in stride: (1, 3) vs (4, 1)" in msg
    assert "While executing" not in msg
    assert 'which every backend does (backend="aot_eager" too)' in msg and "tfun.vmap(tfun.jit(tfun.grad(loss)))" in msg


# torch warns about its own missing batching rule (aten::select_copy) while tfun.grad probes the
# function under the vmap: torch's warning about torch, not tfun's
@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_grad_of_vmap_of_scan_inside_jit_is_right_or_refused_with_what_to_do():
    """`tfun.jit(tfun.grad(f))` where `f` maps a scan with `tfun.vmap`: torch 2.13's scan batching
    rule leaves an init the body batches unbatched (or moves its batch dimension last, so its
    strides differ from the carry's), and its check refuses the loop under every backend. The
    result equals float64 eagerly, and under tfun.jit it either does too or is a JitError that
    says what to do (apply the vmap outside tfun.jit), which works."""

    def loss(W, xs):
        h, ys = lax.scan(lambda h, x: (torch.tanh(h @ W + x),) * 2, torch.zeros(3, dtype=xs.dtype), xs)
        return ys.sum()

    def f(W, xs):
        return tfun.vmap(loss, in_axes=(None, 0))(W, xs).sum()

    g = torch.Generator().manual_seed(0)
    W, xs = torch.randn(3, 3, generator=g) / 2, torch.randn(4, 5, 3, generator=g)
    want = tfun.grad(f)(W.double(), xs.double())
    assert torch.allclose(tfun.grad(f)(W, xs).double(), want, atol=1e-5)
    for backend in ("aot_eager", "inductor"):
        try:
            got = tfun.jit(tfun.grad(f), backend=backend)(W, xs)
        except JitError as e:
            assert "tfun.vmap(tfun.jit(tfun.grad(loss)))" in str(e)
        else:
            assert torch.allclose(got.double(), want, atol=1e-5)
    per_example = tfun.vmap(tfun.jit(tfun.grad(loss)), in_axes=(None, 0))(W, xs)  # what the message says
    assert torch.allclose(per_example.sum(0).double(), want, atol=1e-5)


def test_tfun_error_inside_body_is_unwrapped():
    def f(x):
        return lax.scan(lambda c, x: ((c, c), x), x[0], x)

    with pytest.raises(StructureMismatchError, match="^tfun.lax.scan: body carry input and output"):
        tfun.jit(f, backend="eager")(torch.ones(3, 2))


def test_module_method_and_backward():
    class RNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.W = torch.nn.Parameter(torch.randn(4, 4) * 0.3)

        def forward(self, xs):
            return _loss(self.W, xs)

        @tfun.jit(backend="aot_eager")
        def jitted_forward(self, xs):
            return _loss(self.W, xs)

    m = RNN()
    xs = torch.randn(5, 4)
    ref = m(xs)
    (g_ref,) = torch.autograd.grad(ref, m.W)
    for fn in (tfun.jit(m, backend="aot_eager"), tfun.jit(m.forward, backend="aot_eager"), m.jitted_forward):
        out = fn(xs)
        assert torch.allclose(out, ref, atol=1e-6)
        m.zero_grad()
        out.backward()
        assert torch.allclose(m.W.grad, g_ref, atol=1e-6)


def test_module_whose_scan_closes_over_parameters_trains_with_inductor():
    import copy

    class RNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell = torch.nn.Linear(8, 8)
            self.inp = torch.nn.Linear(3, 8)
            self.head = torch.nn.Linear(8, 1)

        def forward(self, xs):
            def step(h, x):  # closes over the parameters of three submodules
                h = torch.tanh(self.cell(h) + self.inp(x))
                return h, self.head(h)

            h, ys = lax.scan(step, torch.zeros(xs.shape[1], 8), xs)
            return ys.pow(2).mean() + h.sum()

    torch.manual_seed(0)
    m = RNN()
    ref = copy.deepcopy(m)
    step_c = tfun.jit(m)  # default backend: inductor, forward and backward
    opt, opt_ref = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        xs = torch.randn(7, 2, 3)
        opt.zero_grad()
        loss = step_c(xs)
        loss.backward()
        opt_ref.zero_grad()
        loss_ref = ref(xs)
        loss_ref.backward()
        assert torch.allclose(loss, loss_ref, rtol=1e-5, atol=1e-6)
        for p, q in zip(m.parameters(), ref.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6)
        opt.step()
        opt_ref.step()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6)


def test_grad_of_jit_runs_eagerly_inside_the_transform():
    W, xs = torch.randn(4, 4) * 0.3, torch.randn(5, 4)
    g_ref = torch.func.grad(_loss)(W, xs)
    assert torch.allclose(torch.func.grad(tfun.jit(_loss, backend="eager"))(W, xs), g_ref, atol=1e-6)
    assert torch.allclose(tfun.grad(tfun.jit(_loss, backend="eager"))(W, xs), g_ref, atol=1e-6)


def test_jit_of_grad_without_control_flow_is_one_graph():
    def loss(W, x):
        return torch.tanh(x @ W).sum()

    W, x = torch.randn(3, 3), torch.randn(2, 3)
    j = tfun.jit(torch.func.grad(loss), backend="aot_eager")
    assert torch.allclose(j(W, x), torch.func.grad(loss)(W, x), atol=1e-6)
    assert j.lower(W, x).graph_breaks == 0


def test_jit_of_grad_with_control_flow_is_a_clear_error():
    # torch 2.13 cannot compile torch.func.grad around any control-flow HOP: Dynamo's HOP
    # speculation asserts that the body's inputs are FakeTensors, but under the grad
    # transform they are functorch-wrapped (torch/_higher_order_ops/utils.py,
    # _collect_fake_inputs, called from check_aliasing_and_input_mutation).
    W, xs = torch.randn(4, 4) * 0.3, torch.randn(5, 4)
    with pytest.raises(JitError, match="cannot trace a torch.func transform"):
        tfun.jit(torch.func.grad(_loss), backend="aot_eager")(W, xs)


_D = torch.float64
_W3 = torch.randn(3, 3, generator=torch.Generator().manual_seed(11), dtype=_D) * 0.5
_U3 = torch.randn(3, generator=torch.Generator().manual_seed(12), dtype=_D)


def _smooth(z):
    return (torch.tanh(z @ _W3) * torch.sin(z)).sum()


#: tfun's transforms that run torch.func inside tfun.jit, around a gradient (no control flow):
#: each was a JitError (`jacrev`: Dynamo cannot compare two functions with `is`; a tfun.grad
#: inside a torch.func transform differentiated with autograd, which Dynamo cannot trace there)
_FUNC_AROUND_GRAD = {
    "hessian": lambda x: tfun.hessian(_smooth)(x),
    "jacrev": lambda x: tfun.jacrev(lambda z: torch.tanh(z @ _W3))(x),
    "jacfwd_of_grad": lambda x: tfun.jacfwd(tfun.grad(_smooth))(x),
    "jacrev_of_grad": lambda x: tfun.jacrev(tfun.grad(_smooth))(x),
    "jvp_of_grad": lambda x: tfun.jvp(tfun.grad(_smooth), (x,), (_U3,))[1],
    "vmap_of_grad": lambda x: tfun.vmap(tfun.grad(_smooth))(torch.stack([x, _U3, x * 2])),
    "vmap_of_value_and_grad": lambda x: tfun.vmap(tfun.value_and_grad(_smooth))(torch.stack([x, _U3])),
}


@pytest.mark.parametrize(
    ("name", "backend"),
    [(name, "aot_eager") for name in sorted(_FUNC_AROUND_GRAD)]
    # Inductor generates the code of a per-example gradient and a Hessian too (CI's torch 2.14.1
    # phase leaves these two cells out: `heavy`)
    + [pytest.param(name, "inductor", marks=pytest.mark.heavy) for name in ("hessian", "vmap_of_grad")],
)
def test_torch_func_transforms_around_a_gradient_compile(name, backend):
    fn = _FUNC_AROUND_GRAD[name]
    x = torch.randn(3, generator=torch.Generator().manual_seed(13), dtype=_D)
    torch.testing.assert_close(tfun.jit(fn, backend=backend)(x), fn(x))


def test_torch_func_transforms_around_a_gradient_of_control_flow_say_to_move_them_out():
    """With a loop inside, torch cannot trace a torch.func transform around its gradient: a
    JitError that names tfun's transforms and the fix, and the fix gives eager's values.
    (`tfun.vmap` of `tfun.grad` alone compiles: `_vmap._per_example_gradients`; a nested
    vmap around it is still such a transform.)"""
    loss = lambda z: lax.scan(lambda c, _: (torch.tanh(c @ _W3), None), z, None, length=4)[0].pow(2).sum()
    xs = torch.stack([_U3, _U3 * 2])
    with pytest.raises(JitError, match="tfun.vmap, tfun.jvp, tfun.jacfwd, tfun.jacrev and tfun.hessian") as e:
        tfun.jit(lambda x: tfun.vmap(tfun.vmap(tfun.grad(loss)))(x), backend="aot_eager")(xs[None])
    assert "tfun.vmap(tfun.jit(tfun.grad(loss)))" in str(e.value)
    want = torch.stack([tfun.grad(loss)(x) for x in xs])
    torch.testing.assert_close(tfun.vmap(tfun.jit(tfun.grad(loss), backend="aot_eager"))(xs), want)
    torch.testing.assert_close(tfun.jit(lambda x: tfun.vmap(tfun.grad(loss))(x), backend="aot_eager")(xs), want)
    torch.testing.assert_close(tfun.hessian(tfun.jit(loss, backend="aot_eager"))(_U3), tfun.hessian(loss)(_U3))


def test_loop_index_into_a_tensor_says_what_to_write_instead():
    """`xs[i]` with a fori_loop/while_loop index is refused by torch under tracing (a
    data-dependent integer): the JitError names the user's line and the idioms that compile,
    and those give eager's values and gradients."""
    xs = torch.randn(5, 3, generator=torch.Generator().manual_seed(3), dtype=_D)
    c0 = torch.zeros(3, dtype=_D)
    bad = {
        "fori_loop": lambda xs, c: lax.fori_loop(0, 5, lambda i, c: c * 0.5 + xs[i], c),
        "while_loop": lambda xs, c: lax.while_loop(lambda s: s[0] < 5, lambda s: (s[0] + 1, s[1] * 0.5 + xs[s[0]]), (0, c))[1],
    }
    for fn in bad.values():
        with pytest.raises(JitError, match=r"tfun\.at\(xs\)\[i\]\.get\(\)") as e:
            tfun.jit(fn, backend="aot_eager")(xs, c0)
        assert "test_jit.py:" in str(e.value)
    good = {
        "at": lambda xs, c: lax.fori_loop(0, 5, lambda i, c: c * 0.5 + tfun.at(xs)[i].get(), c),
        "index_select": lambda xs, c: lax.fori_loop(0, 5, lambda i, c: c * 0.5 + torch.index_select(xs, 0, i.reshape(1))[0], c),
    }
    want = bad["fori_loop"](xs, c0)
    want_g = tfun.grad(lambda xs: bad["fori_loop"](xs, c0).pow(2).sum())(xs)
    for fn in good.values():
        torch.testing.assert_close(tfun.jit(fn, backend="aot_eager")(xs, c0), want)
        g = tfun.jit(tfun.grad(lambda xs: fn(xs, c0).pow(2).sum()), backend="aot_eager")(xs)
        torch.testing.assert_close(g, want_g)


def test_a_failed_compile_inside_a_jvp_leaves_forward_mode_usable():
    """Dynamo stopping inside a forward-mode transform (a jvp in a while_loop body under a
    gradient, which torch cannot compile) left torch's dual level open: every later jvp in
    the process raised "Nested forward mode AD is not supported". tfun.jit closes it."""
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(5), dtype=_D)

    def fn(x):
        body = lambda s: (s[0] + tfun.jvp(torch.sin, (s[0],), (torch.ones_like(s[0]),))[1] * 0.1, s[1] + 1)
        return lax.while_loop(lambda s: s[1] < 3, body, (x, 0))[0].pow(2).sum()

    with pytest.raises(JitError):
        tfun.jit(tfun.grad(fn), backend="aot_eager")(x)
    torch.testing.assert_close(tfun.jvp(torch.sin, (x,), (x,))[1], torch.cos(x) * x)
    torch.testing.assert_close(torch.func.jvp(torch.sin, (x,), (x,))[1], torch.cos(x) * x)
    torch.testing.assert_close(tfun.grad(fn)(x), tfun.grad(fn)(x))  # eagerly fine


def test_jit_sets_dynamo_tracing_settings_only_while_it_traces():
    """tfun.jit lets Dynamo trace `torch.autograd.grad` (one graph for jit(grad(f))) by
    setting `trace_autograd_ops` from inside the trace, and puts it back when the call
    returns, after a compile, a cached call, a failed compile and a nested call alike: a plain
    torch.compile in the same process sees torch's own setting."""
    import torch._dynamo.config as dynamo_config

    if not hasattr(dynamo_config, "trace_autograd_ops"):
        pytest.skip("this torch has no trace_autograd_ops")
    before = dynamo_config.trace_autograd_ops
    x = torch.randn(3, dtype=_D)
    f = tfun.jit(tfun.grad(lambda x: (x**3).sum()), backend="aot_eager")
    for _ in range(2):  # compiled, then cached
        torch.testing.assert_close(f(x), 3 * x**2)
        assert dynamo_config.trace_autograd_ops == before
    graphs = tfun.jit(tfun.grad(lambda x: (x.sin() ** 2).sum())).lower(x).graphs
    assert len(graphs) == 1  # no graph break at the autograd.grad call
    assert dynamo_config.trace_autograd_ops == before

    def bad(x):
        return lax.cond(x.sum() > 0, lambda x: x, lambda x: (x, x), x)

    with pytest.raises(TfunError):
        tfun.jit(bad, backend="aot_eager")(x)
    assert dynamo_config.trace_autograd_ops == before

    inner = tfun.jit(tfun.grad(lambda x: (x**2).sum()), backend="aot_eager")
    outer = tfun.jit(lambda x: inner(x) * 2, backend="aot_eager", fullgraph=False)
    torch.testing.assert_close(outer(x), 4 * x)
    assert dynamo_config.trace_autograd_ops == before


def _cf_loss(params, xs):
    W = params["W"]
    h, ys = lax.scan(lambda h, x: (torch.tanh(h @ W + x),) * 2, torch.zeros(W.shape[0], dtype=W.dtype), xs)
    z = lax.cond(h.sum() > 0, lambda a: a * 2, lambda a: a.sin(), h)
    return ys.sum() + z.sum() + lax.map(lambda r: (r @ W).sin(), xs).sum(), {"h": h}


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])  # heavy: pyproject.toml
def test_jit_of_tfun_grad_with_control_flow_is_one_graph(backend):
    # JAX's training-step form: jit(grad(loss)) with scan, cond and map inside the loss.
    torch.manual_seed(0)
    params = {"W": torch.randn(4, 4, dtype=torch.float64) * 0.3}
    xs = torch.randn(5, 4, dtype=torch.float64)
    (ref_val, ref_aux), ref_g = tfun.value_and_grad(_cf_loss, has_aux=True)(params, xs)
    step = tfun.value_and_grad(_cf_loss, has_aux=True)
    grad = tfun.grad(lambda p, x: _cf_loss(p, x)[0])
    # (one compile of both transforms, each result checked)
    ((val, aux), g), g_only = tfun.jit(lambda p, x: (step(p, x), grad(p, x)), backend=backend)(params, xs)
    torch.testing.assert_close(val, ref_val)
    torch.testing.assert_close(aux["h"], ref_aux["h"])
    torch.testing.assert_close(g["W"], ref_g["W"])
    torch.testing.assert_close(g_only["W"], ref_g["W"])
    low = tfun.jit(tfun.grad(lambda p, x: _cf_loss(p, x)[0])).lower(params, xs)
    assert low.graph_breaks == 0 and len(low.graphs) == 1
    assert low.count("higher_order.scan") == 1 and low.count("higher_order.cond") == 1


def test_lower_introspection():
    W = torch.randn(4, 4) * 0.3
    low = tfun.jit(_loss).lower(W, torch.randn(7, 4))
    assert low.graph_breaks == 0
    assert low.count("higher_order.scan") == 1
    assert "torch.ops.higher_order.scan" in low.as_text()
    assert isinstance(low.graph, torch.fx.Graph)

    def broken(x):
        y = x * 2
        print("side effect")  # noqa: T201 - a graph break
        return y + 1

    low = tfun.jit(broken).lower(torch.ones(1))
    assert low.graph_breaks == 1


def test_donate_argnums_is_accepted():
    j = tfun.jit(lambda x: x + 1, donate_argnums=0, backend="eager")
    assert j(torch.ones(1)).item() == 2.0


def test_compile_options_pass_through():
    j = tfun.jit(lambda x: x.sin(), backend="eager", dynamic=True)
    for n in (2, 3, 5):
        assert torch.allclose(j(torch.ones(n)), torch.ones(n).sin())


# ----------------------------------------------------------------------------------------
# A gradient that depends on closed-over tensors requiring grad (a gradient penalty)
# ----------------------------------------------------------------------------------------


def _penalty_case(with_control_flow, unroll=1):
    torch.manual_seed(1)
    W = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def loss(x):
        if with_control_flow:
            h, ys = lax.scan(lambda h, xt: (torch.tanh(h @ W + xt),) * 2, torch.zeros(3, dtype=x.dtype), x, unroll=unroll)
            return ys.sum()
        return torch.tanh(x @ W).sum()

    def step(x):
        g = tfun.grad(loss)(x)
        return (g**2).sum()

    return W, loss, step, torch.randn(5, 3, dtype=torch.float64)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("with_control_flow", [False, True], ids=["plain", "scan"])
def test_gradient_penalty_through_closed_over_parameters_matches_eager(backend, with_control_flow):
    # The gradient w.r.t. x depends on the closed-over W, which requires grad: a penalty on
    # it must send its second-order term to W.grad, as eagerly (it used to be dropped). With a
    # scan inside, torch's HOPs have no double backward: with `unroll=True` the scan is
    # unrolled in the graph and the penalty is exact; without, the gradient is computed
    # first-order (the scan stays a loop op) and the penalty's backward is a JitError.
    W, loss, step, x = _penalty_case(with_control_flow=with_control_flow, unroll=True)
    (step(x) + (W**2).sum()).backward()
    want = W.grad.clone()
    W.grad = None
    got = tfun.jit(step, backend=backend)(x)
    assert got.requires_grad
    (got + (W**2).sum()).backward()
    torch.testing.assert_close(W.grad, want)
    if not with_control_flow:
        return
    W, loss, step, x = _penalty_case(with_control_flow=True)
    got = tfun.jit(step, backend=backend)(x)
    torch.testing.assert_close(got.detach(), step(x).detach())
    with pytest.raises(JitError, match=r"^tfun\.grad: under tfun\.jit, this gradient was computed first-order") as info:
        (got + (W**2).sum()).backward()
    assert "loss at " in str(info.value) and "tests/test_jit.py:" in str(info.value)

    if backend != "aot_eager":
        return  # (the check below compiles with aot_eager in every cell: once is enough)

    # A first-order gradient under torch.no_grad() (the loop stays a HOP) equals eager's.
    def first_order(x):
        with torch.no_grad():
            return tfun.grad(loss)(x)

    torch.testing.assert_close(tfun.jit(first_order, backend="aot_eager")(x), tfun.grad(loss)(x))


def test_gradient_penalty_through_a_while_loop_and_closed_over_parameters_is_refused():
    # A while_loop has no static trip count to unroll: the gradient is first-order (eager's
    # value) and the penalty's backward is refused, never silently dropped, naming the user's
    # function.
    W = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)

    def loss(x):
        return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.tanh(c[1] @ W)), (0, x))[1].sum()

    step = lambda x: (tfun.grad(loss)(x) ** 2).sum()
    x = torch.randn(5, 3, dtype=torch.float64)
    got = tfun.jit(step, backend="aot_eager")(x)
    torch.testing.assert_close(got.detach(), step(x).detach())
    with pytest.raises(JitError, match=r"^tfun\.grad: under tfun\.jit, this gradient was computed first-order") as info:
        got.backward()
    assert "loss at " in str(info.value) and "tests/test_jit.py:" in str(info.value)
    assert "outside tfun.jit" in str(info.value)


def test_probe_for_closed_over_parameters_adds_nothing_to_the_graph():
    # The probe evaluates the function a second time at trace time; its ops feed nothing.
    W = torch.randn(4, 4) * 0.3
    low = tfun.jit(tfun.grad(lambda W, xs: _loss(W, xs))).lower(W, torch.randn(7, 4))
    assert low.graph_breaks == 0 and low.count("higher_order.scan") == 1


def test_closed_over_size_from_a_dynamic_shape_is_a_jit_error_that_says_what_to_do():
    # torch's scan takes a closed-over size only as a plain symbol; `W.shape[0] // 2` becomes
    # a SymInt expression once tfun.jit makes sizes dynamic (the second distinct shape)
    def loss(W, xs):
        n = W.shape[0] // 2

        def body(h, x):
            h = torch.tanh(h @ W + x)
            return h, h[:, :n].sum()

        return lax.scan(body, torch.zeros(1, W.shape[0]), xs)[1].sum()

    # dynamic=True: sizes are symbolic from the first call (by default they become so at the
    # second distinct shape, or at the first where Dynamo already saw other shapes for
    # tfun.jit's frame earlier in the process)
    f = tfun.jit(tfun.grad(loss), backend="aot_eager", dynamic=True)
    with pytest.raises(JitError, match=r"closes over a size computed from a dynamic shape") as info:
        f(torch.randn(6, 6), torch.randn(5, 1, 6))
    assert "dynamic=False" in str(info.value)
    # the fix it names: one compile per shape
    g = tfun.jit(tfun.grad(loss), backend="aot_eager", dynamic=False)
    for H in (4, 6):
        W, xs = torch.randn(H, H), torch.randn(5, 1, H)
        torch.testing.assert_close(g(W, xs), tfun.grad(loss)(W, xs))


def test_jit_created_inside_traced_code_is_inlined():
    """`tfun.jit(f)(x)` inside a function tfun.jit traces (here in a scan body, as JAX's
    `jax.jit(f)` in a loop body) runs `f` in the outer graph: values and gradients equal
    eager float64."""

    def outer(w, xs, wrap=tfun.jit):
        def step(c, x):
            inner = wrap(lambda c, x: torch.tanh(c * w + x))
            return inner(c, x), None

        return lax.scan(step, torch.zeros((), dtype=xs.dtype), xs)[0]

    w, xs = torch.tensor(0.7, dtype=torch.float64), torch.linspace(-1, 1, 5, dtype=torch.float64)
    wr = w.clone().requires_grad_()
    ref = outer(wr, xs, wrap=lambda f: f)  # the oracle: eager, no jit
    (g_ref,) = torch.autograd.grad(ref, wr)
    wj = w.clone().requires_grad_()
    out = tfun.jit(outer, backend="aot_eager")(wj, xs)
    (g,) = torch.autograd.grad(out, wj)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(g, g_ref)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_jit_of_jit_of_a_custom_function_is_jit(backend):
    # jit(jit(f)) compiles f once (the inner jit is the outer's function); torch 2.11's
    # Dynamo could not read the inner Jitted's attributes when f is a custom_jvp function
    @tfun.custom_jvp
    def f(x):
        return torch.sin(x)

    f.defjvp(lambda p, t: (f(p[0]), 3 * torch.cos(p[0]) * t[0]))  # not the true derivative
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    jj = tfun.jit(tfun.jit(f, backend=backend), backend=backend)
    torch.testing.assert_close(jj(x), torch.sin(x), rtol=0, atol=0)
    torch.testing.assert_close(tfun.grad(lambda x: jj(x).sum())(x), 3 * torch.cos(x))
    # an inner jit with static arguments stays a jit of its own, inlined when traced
    inner = tfun.jit(lambda x, n: x * n, static_argnums=1, backend=backend)
    torch.testing.assert_close(tfun.jit(lambda x: inner(x, 3), backend=backend)(x), 3 * x)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_custom_vjp_defined_inside_jit(backend):
    # a custom function made in traced code (torch 2.11's Dynamo cannot trace the copy of
    # the function's __dict__ that functools.update_wrapper makes)
    def g(x):
        @tfun.custom_vjp
        def f(x):
            return torch.sin(x)

        f.defvjp(lambda x: (torch.sin(x), torch.cos(x)), lambda c, ct: (2 * c * ct,))  # 2x the true rule
        return f(x).sum()

    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    torch.testing.assert_close(tfun.jit(g, backend=backend)(x), torch.sin(x).sum())
    torch.testing.assert_close(tfun.jit(tfun.grad(g), backend=backend)(x), 2 * torch.cos(x))


@pytest.mark.filterwarnings("ignore:There is a performance drop because we have not yet implemented the batching rule")
def test_refusals_of_torch_name_the_cause_and_the_fix():
    """Programs torch cannot compile, each a JitError that says why and what to write instead
    (before, Dynamo's message came with the generic advice about Python control flow)."""
    x = torch.randn(4, 3, dtype=_D, generator=torch.Generator().manual_seed(5))

    def complex_carry(p):  # a differentiated scan with a complex carry
        lam = torch.complex(p[0], p[1])
        c, _ = lax.scan(lambda c, xt: (c * lam + xt, c.real), torch.zeros(2, dtype=torch.complex128), x[:, :2])
        return c.abs().sum()

    p = torch.tensor([[0.5, 0.2], [0.1, -0.3]], dtype=_D)
    torch._dynamo.reset()
    with pytest.raises(JitError, match="computes with complex tensors in its body") as info:
        tfun.jit(tfun.grad(complex_carry), backend="aot_eager")(p)
    assert "a complex carry" in str(info.value) and "real and imaginary parts" in str(info.value)

    def complex_intermediate(p):  # a real carry, a complex value inside the step (hunt 24,
        # finding 10: the message said that a complex tensor was carried, and advised what fails too)
        def step(h, xt):
            c = torch.view_as_complex(torch.stack([h * p[0, 0], xt], -1))
            v = torch.view_as_real(c * c)[:, 0]
            return torch.tanh(v), v.sum()

        return lax.scan(step, x[0, :2], x[:, :2])[1].sum()

    torch._dynamo.reset()
    with pytest.raises(JitError, match="computes with complex tensors in its body") as info:
        tfun.jit(tfun.grad(complex_intermediate), backend="aot_eager")(p)
    assert "`view_as_complex_copy`" in str(info.value) and "test_jit.py" in str(info.value)

    def python_loop(p):  # eagerly it runs, with a plain loop's gradient
        h, total = x[0, :2], 0
        for xt in x[:, :2]:
            v = torch.view_as_real(torch.view_as_complex(torch.stack([h * p[0, 0], xt], -1)) ** 2)[:, 0]
            h, total = torch.tanh(v), total + v.sum()
        return total

    torch.testing.assert_close(tfun.grad(complex_intermediate)(p), torch.func.grad(python_loop)(p))

    def one_branch_reads_x(x, i):  # the operand is unbatched, one branch closes over batched x
        return lax.cond(i > 0, lambda h: h * 0.5, lambda h: h + x, torch.zeros(3, dtype=x.dtype))

    # refused by torch's vmap rule for torch.cond ("Make the operands batched"), which
    # `_compat.cond_vmap_fixes` replaces: it compiles, with eager's values, as does the form
    # the old message said to write
    fixed = lambda x, i: lax.cond(i > 0, lambda h: h * 0.5, lambda h: h + x, torch.zeros_like(x))
    for f in (one_branch_reads_x, fixed):
        torch._dynamo.reset()
        for i in (0, 1):
            got = tfun.jit(tfun.vmap(f, in_axes=(0, None)), backend="aot_eager")(x, torch.tensor(i))
            torch.testing.assert_close(got, tfun.vmap(one_branch_reads_x, in_axes=(0, None))(x, torch.tensor(i)))


def test_dual_tensors_of_forward_ad_through_a_jitted_loop():
    """Hunt 27: under `torch.autograd.forward_ad.dual_level()`, a jitted function holding a
    loop returned its output without a tangent (`unpack_dual(y).tangent` None, no error;
    torch's loop ops dropped it). Under an open dual level the function runs uncompiled: the
    tangent is torch.func.jvp's, in float64; outside the level it compiles as before."""
    import torch.autograd.forward_ad as fwAD

    g = torch.Generator().manual_seed(3)
    x, v = torch.randn(6, 4, dtype=torch.float64, generator=g), torch.randn(6, 4, dtype=torch.float64, generator=g)

    def f(x):
        ys = lax.scan(lambda c, xt: (torch.tanh(c + xt), c), x[0], x)[1]
        return lax.linear_scan(torch.sigmoid(x), ys)

    want_y, want_t = torch.func.jvp(f, (x,), (v,))
    jf = tfun.jit(f, backend="aot_eager")
    with fwAD.dual_level():
        y, t = fwAD.unpack_dual(jf(fwAD.make_dual(x, v)))
    assert t is not None
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(t, want_t)
    torch.testing.assert_close(jf(x), want_y)  # compiled outside the level


def test_retained_backward_after_a_compiled_backward_with_donated_buffers_off():
    """docs/faq.md: a compiled backward frees its saved tensors (torch's donated buffers), so
    a later `.backward(retain_graph=True)` through the jitted function needs
    `torch._functorch.config.donated_buffer = False` set before the first call; with it, two
    backwards through one forward accumulate twice eager float64's gradient."""
    import torch._functorch.config as functorch_config

    # torch's own `patch`, not pytest's monkeypatch: pytest 9 reads the old value from the
    # module's `__dict__`, finds none (torch's config lives elsewhere) and, undoing, deletes
    # the setting, which failed every later compile in the process
    f = lambda x: (lax.scan(lambda h, xt: (torch.tanh(h * 0.5 + xt), h.sum()), torch.zeros(3, dtype=x.dtype), x)[1] ** 2).sum()  # noqa: E731
    torch._dynamo.reset()
    x = torch.randn(5, 3, generator=torch.Generator().manual_seed(0), requires_grad=True)
    with functorch_config.patch(donated_buffer=False):
        jf = tfun.jit(f, backend="aot_eager")
        jf(x).backward()  # a training step compiles the backward
        x.grad = None
        v = jf(x)
        v.backward(retain_graph=True)
        v.backward()
    x64 = x.detach().double().requires_grad_()
    (g,) = torch.autograd.grad(f(x64), x64)
    torch.testing.assert_close(x.grad.double(), 2 * g, rtol=1e-5, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex operators")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
def test_a_differentiated_while_loop_with_a_complex_carry_is_a_jit_error_that_says_so(backend):
    """Hunt 28 (F5): torch's while_loop autograd under tfun.jit fails on a complex carry
    ("outs_to_grad length (1) != tangents length (0)"); the JitError said the backend had
    failed and advised backend="aot_eager", the backend in use. It now names the complex carry
    and what works; forward only, the jitted loop equals eager."""
    x = torch.randn(6, 3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    a = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(1)) * 0.5
    f = lambda x, a: lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * a + 1), (0, x[0].clone()))  # noqa: E731
    torch._dynamo.reset()
    with pytest.raises(JitError, match="while_loop .*has a complex carry") as info:
        tfun.jit(f, backend=backend)(x.clone().requires_grad_(), a.clone().requires_grad_())
    assert 'backend="aot_eager"' not in str(info.value)
    assert "test_jit.py" in str(info.value) or "<lambda>" in str(info.value)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.testing.assert_close(tfun.jit(f, backend=backend)(x, a), f(x, a))


@pytest.mark.filterwarnings("ignore:Torchinductor does not support code generation for complex operators")
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.heavy)])
def test_arguments_with_a_lazy_negation_or_conjugation_bit_reach_control_flow(backend):
    """Hunt 34 (F2): a tensor with torch's lazy negation bit (`z.conj().imag`, an ordinary
    looking float32 tensor) or conjugation bit (`z.conj()`) as a `cond` operand or read by a
    loop body was a JitError on every torch and backend (torch's control-flow ops have no
    kernel for those dispatch keys), whose advice did not apply. tfun.jit resolves its
    arguments' bits: eager's values and gradients (a complex scan under `torch.no_grad()`: a
    differentiated complex loop is refused under jit, docs/compatibility.md). A loop body
    closing over such a tensor is a JitError that says to resolve it."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 3, dtype=torch.complex128, generator=g)

    def f(x):
        y = lax.cond(x.sum() > 0, lambda a: a * 2, lambda a: a - 1, x)
        h = lax.fori_loop(0, 3, lambda i, c: torch.sin(c) + x[1], torch.zeros(3, dtype=x.dtype))
        return y, h

    def run(jit):
        w = w0.clone().requires_grad_()
        x = w.conj().imag  # the negation bit, on a tensor that requires grad (not a leaf)
        assert x.is_neg()
        outs = (tfun.jit(f, backend=backend) if jit else f)(x)
        sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).reshape(o.shape)).sum() for o in outs).backward()
        return outs, w.grad

    torch._dynamo.reset()
    (got, got_g), (want, want_g) = run(True), run(False)
    assert_tree_allclose(got, want)
    torch.testing.assert_close(got_g, want_g)

    zc = w0.conj()
    assert zc.is_conj()
    s = lambda zc: lax.scan(lambda c, v: (c * 0.5 + v, c), torch.zeros(3, dtype=zc.dtype), zc)  # noqa: E731
    torch._dynamo.reset()
    with torch.no_grad():
        assert_tree_allclose(tfun.jit(s, backend=backend)(zc), s(zc))

    x = w0.conj().imag
    torch._dynamo.reset()
    with pytest.raises(JitError, match=r"resolve_neg"):
        tfun.jit(lambda y: lax.fori_loop(0, 3, lambda i, c: c + x[0], y), backend=backend)(torch.zeros(3, dtype=x.dtype))


_FLOAT_BODIES = {
    "scan": lambda W: lambda x, s: lax.scan(lambda h, _: (torch.tanh(h @ W) * s, None), x, None, length=3)[0],
    "while_loop": lambda W: lambda x, s: lax.while_loop(
        lambda c: c[0] < 3, lambda c: (c[0] + 1, torch.tanh(c[1] @ W) * s), (torch.tensor(0), x)
    )[1],
    "cond": lambda W: lambda x, s: lax.cond(x.sum() > 0, lambda a: torch.tanh(a @ W) * s, lambda a: a * s, x),
    "map": lambda W: lambda x, s: lax.map(lambda r: torch.tanh(r @ W) * s, torch.stack([x, -x])),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("op", list(_FLOAT_BODIES))
def test_a_python_float_a_body_reads_that_changes_between_calls(op, grad):
    """Hunt 34 (F5): under Inductor, a Python float argument that a loop body or branch reads
    becomes a symbolic float on its second value, which torch's control-flow ops refuse
    (torch 2.11-2.14.1: scan and while_loop with gradients, cond always; some cells compile).
    The second call gives eager float64's value, or an error that names the argument and
    says the fixes (before: advice for an unrelated cause); each fix it names gives eager
    float64's values and gradients for every value, the changed one included."""
    W = (torch.eye(3, dtype=torch.float64) * 0.5).requires_grad_(grad)
    f = _FLOAT_BODIES[op](W)
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    torch._dynamo.reset()
    jf = tfun.jit(f)
    with torch.set_grad_enabled(grad):
        torch.testing.assert_close(jf(x, 2.0), f(x, 2.0))
        try:
            torch.testing.assert_close(jf(x, 3.0), f(x, 3.0))
        except JitError as refused:
            text = str(refused)
            assert "a Python float that a loop body or cond branch reads (in this call `s` = 3.0 (argument 1)" in text, text
            assert "torch.tensor(lr)" in text and "static_argnums" in text and "dynamic=False" in text, text
            assert "Python control flow" not in text, text

    def run(fn, s):
        W.grad = None
        with torch.set_grad_enabled(grad):
            out = fn(x, s)
        if grad:
            out.sum().backward()
        return out, W.grad

    # (the tensor takes three values on one compile; each static value is a compile of its own,
    # and the second is the change that made the float symbolic: a third adds no other path)
    for fixed, wrap, values in [
        (tfun.jit(lambda x, s: f(x, s)), lambda s: torch.tensor(s, dtype=torch.float64), [2.0, 3.0, -0.5]),
        (tfun.jit(f, static_argnums=1), lambda s: s, [2.0, 3.0]),
    ]:
        torch._dynamo.reset()  # (Dynamo's per-code state of the failed calls is not the user's next run)
        for s in values:
            (got, got_g), (want, want_g) = run(fixed, wrap(s)), run(f, s)
            torch.testing.assert_close(got, want, msg=f"s={s}")
            torch.testing.assert_close(got_g, want_g, msg=f"s={s}")


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = torch.nn.Parameter(torch.eye(3, dtype=torch.float64) * 0.5)
        self.scale = 2.0

    def forward(self, x):
        return lax.fori_loop(0, 3, lambda i, h: torch.tanh(h @ self.W) * self.scale, x)


def test_a_float_attribute_a_body_reads_that_changes_between_calls_under_gradients():
    """Hunt 34 (F5), the attribute form: a module's float attribute read in a loop body,
    changed between calls, failed in torch's partition of the loop for autograd, and the
    message named transforms the program does not use. It now says what happened."""
    m = _Scaled()
    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    torch._dynamo.reset()
    jm = tfun.jit(m)
    torch.testing.assert_close(jm(x), m(x))
    m.scale = 3.0
    with pytest.raises(JitError) as info:
        jm(x)
    text = str(info.value)
    assert "a Python float that a loop body or cond branch reads (an argument of the jitted function, or an " \
        "attribute such as a module's `self.scale`" in text, text
    assert "tfun.vmap" not in text and "Python control flow" not in text, text


def test_a_loop_whose_length_is_an_expression_of_a_changing_int_says_the_fixes():
    """Hunt 34 (F6): a scan, or a fori_loop with Python-int bounds, whose length is an
    expression of an int argument that changed (`fori_loop(n // 2, n)`) is a failure of
    Inductor's scan decomposition (torch 2.11-2.14.1; `fori_loop(0, n)` compiles, see
    tests/lax/test_loops.py). The error names the argument and the fixes, which work."""
    def f(x, n):
        return lax.fori_loop(n // 2, n, lambda i, h: torch.tanh(h * 0.5) + i, x)

    x = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    torch._dynamo.reset()
    jf = tfun.jit(f)
    torch.testing.assert_close(jf(x, 3), f(x, 3))
    with pytest.raises(JitError) as info:
        jf(x, 4)
    text = str(info.value)
    assert "an int argument (in this call `n` = 4 (argument 1))" in text, text
    assert "static_argnums" in text and "dynamic=False" in text, text
    for fixed in [tfun.jit(f, static_argnums=1), tfun.jit(f, dynamic=False)]:
        for n in [3, 4]:  # (one compile per value: the changed one is the case; a third adds none)
            torch.testing.assert_close(fixed(x, n), f(x, n), msg=f"n={n}")


def test_torch_autograd_grad_in_a_loop_body_points_to_tfun_grad():
    """Hunt 34 (F4): `torch.autograd.grad` under `enable_grad` in a loop body (an energy
    gradient in a Langevin step) runs eagerly but cannot under tfun.jit, where torch traces
    bodies with autograd off; the message advised Python control flow. It now names
    tfun.grad, and that rewrite gives eager float64's values in every grad mode."""
    W = torch.linspace(-0.5, 0.5, 16, dtype=torch.float64).reshape(4, 4)

    def energy(x):
        return (torch.tanh(x @ W) ** 2).sum()

    def with_autograd(x0):
        def body(i, x):
            with torch.enable_grad():
                xx = x.detach().requires_grad_()
                (g,) = torch.autograd.grad(energy(xx), xx)
            return x - 0.1 * g

        return lax.fori_loop(0, 5, body, x0)

    def with_tfun_grad(x0):
        return lax.fori_loop(0, 5, lambda i, x: x - 0.1 * tfun.grad(energy)(x), x0)

    x0 = torch.linspace(-1, 1, 4, dtype=torch.float64)
    with torch.no_grad():
        want = with_autograd(x0)
        with pytest.raises(JitError) as info:
            tfun.jit(with_autograd, backend="aot_eager")(x0)
    text = str(info.value)
    assert "`tfun.grad(energy)(x)`" in text and "Python control flow" not in text, text
    for mode in [torch.no_grad, torch.enable_grad, torch.inference_mode]:
        with mode():
            torch.testing.assert_close(tfun.jit(with_tfun_grad, backend="aot_eager")(x0), want)


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad], ids=["grad", "no_grad"])
def test_a_jitted_jvp_around_a_cond_is_refused_with_the_transform_message_in_every_grad_mode(grad_mode):
    """Hunt 34 (F1): under `no_grad`, torch 2.13 fails a traced jvp of a cond in cond's
    functorch dispatch (a `KeyError` of the transform type), which was reported with advice
    about Python control flow; it is the documented refusal of a torch.func transform around
    a control-flow op, as with grad mode on."""
    W = torch.linspace(-0.5, 0.5, 9).reshape(3, 3)
    f = lambda x: lax.cond(x.sum() > 0, lambda a: (a @ W).sin(), lambda a: (a @ W).cos(), x).sum()  # noqa: E731
    h = lambda x: tfun.jvp(f, (x,), (torch.ones_like(x),))[1]  # noqa: E731
    torch._dynamo.reset()
    with grad_mode(), pytest.raises(JitError) as info:
        tfun.jit(h, backend="aot_eager")(torch.ones(3))
    text = str(info.value)
    assert "cannot trace a torch.func transform" in text and "Python control flow" not in text, text
    with grad_mode():  # the advised placement: the transform outside tfun.jit
        torch.testing.assert_close(tfun.jvp(tfun.jit(f, backend="aot_eager"), (torch.ones(3),), (torch.ones(3),))[1], h(torch.ones(3)))
