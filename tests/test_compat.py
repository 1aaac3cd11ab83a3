"""tfun/_compat.py: the answers its helpers give in code that Dynamo traces match plain Python's."""

from __future__ import annotations

import collections

import pytest
import torch

import tfun
from tfun import _compat
from tfun._tree import tree_structure

_Pair = collections.namedtuple("_Pair", "a b")


def _trees(x: torch.Tensor) -> list[object]:
    return [
        x,
        (x, x),
        [x, x],
        {"a": x, "b": (x, None)},
        {"a": x, "c": (x, None)},
        {"a": x, "b": [x, None]},
        _Pair(x, {"h": x}),
        _Pair(x, {"h": (x,)}),
        (x, {"a": x, "b": [x, None]}, _Pair(x, x)),
    ]


def test_same_treedef_under_dynamo_answers_as_eq_does():
    # Dynamo 2.11 cannot trace `==` between two treedefs (a polyfill for the functions its
    # stand-in treedef holds); `same_treedef` must answer as `==` does, traced or not
    n = len(_trees(torch.ones(1)))

    def table(x: torch.Tensor) -> list[bool]:
        specs = [tree_structure(t) for t in _trees(x)]
        return [_compat.same_treedef(a, b) for a in specs for b in specs]

    expected = [a == b for a in map(tree_structure, _trees(torch.ones(1))) for b in map(tree_structure, _trees(torch.ones(1)))]
    assert expected.count(True) == n  # the trees are pairwise different
    traced = torch.compile(table, backend="eager", fullgraph=True)(torch.ones(1))
    assert traced == expected
    assert table(torch.ones(1)) == expected


def test_one_jit_functions_shapes_do_not_make_anothers_sizes_symbolic():
    # torch 2.11 kept Dynamo's automatic-dynamic state per (file, line, name) of tfun.jit's
    # frame, shared by every tfun.jit function: after `a` saw (3,), `b`'s first compile at (2,)
    # had symbolic sizes and its carry mismatch failed to compile instead of raising tfun's
    # error (see `Jitted._runner`)
    import tfun
    from tfun import lax
    from tfun.errors import StructureMismatchError

    def a(x):
        return lax.scan(lambda c, x: (c + x, x), x[0], x)

    def b(x):
        return lax.while_loop(lambda c: c.sum() < 10, lambda c: (c, c), x)

    tfun.jit(a, backend="eager")(torch.ones(3))
    with pytest.raises(StructureMismatchError, match=r"carry: input is a leaf, output is a tuple of 2"):
        tfun.jit(b, backend="eager")(torch.ones(2))


@pytest.mark.parametrize("make", ["grad", "checkpoint", "module", "same_code"])
def test_jit_functions_of_one_code_object_keep_their_own_dynamic_state(make):
    """Two tfun.jit functions whose wrapped callables share a code object (two `tfun.grad` or
    `tfun.checkpoint` results, two modules, two closures of one `def`): after the first ran at
    one shape, the second's first compile at another shape has static sizes. torch 2.13's
    Dynamo keys its automatic-dynamic state by a hash of the closure's code objects only, so
    before each tfun.jit frame got a name of its own the second compile was symbolic (and on
    torch 2.12 a checkpointed dropout then failed to compile in Inductor)."""
    import tfun

    def scale(k):
        return lambda x: (torch.sin(x) * k).sum()

    if make == "grad":
        f1, f2 = tfun.grad(scale(2.0)), tfun.grad(scale(3.0))
    elif make == "checkpoint":
        f1, f2 = tfun.checkpoint(scale(2.0)), tfun.checkpoint(scale(3.0))
    elif make == "module":
        f1, f2 = torch.nn.Linear(3, 2).double(), torch.nn.Linear(4, 2).double()
    else:
        f1, f2 = scale(2.0), scale(3.0)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append([n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    x1 = torch.randn(5, 3, dtype=torch.float64)
    x2 = torch.randn(7, 4, dtype=torch.float64)
    tfun.jit(f1, backend=backend)(x1)
    tfun.jit(f2, backend=backend)(x2)
    assert len(graphs) == 2
    for value in graphs[1]:
        if isinstance(value, torch.Tensor):
            assert all(isinstance(s, int) for s in value.shape), f"symbolic sizes in the second compile: {value.shape}"
        else:
            assert not isinstance(value, torch.SymInt), "a symbolic size in the second compile"


def test_cond_autograd_fixes_is_idempotent_and_keeps_values():
    """The wrapped `CondAutogradOp.backward` is installed once, and eager cond gradients are
    unchanged by it (the branch gradients are only made contiguous)."""
    from torch._higher_order_ops.cond import CondAutogradOp

    _compat.cond_autograd_fixes()
    first = CondAutogradOp.backward
    _compat.cond_autograd_fixes()
    assert CondAutogradOp.backward is first
    x = torch.tensor([0.5, -1.0], dtype=torch.float64, requires_grad=True)
    w = torch.tensor([2.0, 3.0], dtype=torch.float64, requires_grad=True)
    y = torch.cond(torch.tensor(False), lambda x, w: torch.sin(x), lambda x, w: x * w.sum(), (x, w))
    gx, gw = torch.autograd.grad((y * torch.tensor([1.0, 2.0], dtype=y.dtype)).sum(), (x, w))
    torch.testing.assert_close(gx, torch.tensor([5.0, 10.0], dtype=torch.float64))
    torch.testing.assert_close(gw, torch.full((2,), 0.5 * 1 + -1.0 * 2, dtype=torch.float64))


def test_wrap_backward_once_wraps_once_and_only_where_torch_lacks_the_fix(monkeypatch):
    """`_wrap_backward_once`, which installs the while_loop and cond backward fixes: it wraps
    a HOP's backward once per process, and not at all where `fixed` says torch already does
    the work (the feature detection) or where the class is missing."""
    import types

    class Op:
        @staticmethod
        def backward(ctx, *grads):
            return tuple(g.is_contiguous() for g in grads)

    module = types.ModuleType("tfun_test_fake_hop")
    module.Op = Op
    monkeypatch.setitem(__import__("sys").modules, "tfun_test_fake_hop", module)
    monkeypatch.setattr(_compat, "_PATCHED", set())
    original = Op.backward
    assert not _compat._wrap_backward_once("tfun_test_fake_hop", "Op", _compat._dense_grads, lambda b: True)
    assert Op.backward is original  # torch already has the fix: nothing is wrapped
    monkeypatch.setattr(_compat, "_PATCHED", set())
    assert _compat._wrap_backward_once("tfun_test_fake_hop", "Op", _compat._dense_grads, lambda b: False)
    wrapped = Op.backward
    assert not _compat._wrap_backward_once("tfun_test_fake_hop", "Op", _compat._dense_grads, lambda b: False)
    assert Op.backward is wrapped  # once
    g = torch.ones(3).expand(2, 3)  # stride 0, as the gradient of `out.sum()`
    assert Op.backward(None, g) == (True,)  # the wrapped backward sees dense gradients
    assert original(None, g) == (False,)
    assert not _compat._wrap_backward_once("tfun_test_fake_hop", "Missing", _compat._dense_grads, lambda b: False)


def test_the_backward_fixes_detect_whether_torch_makes_gradients_contiguous():
    """The detection `while_loop_autograd_fixes` and `cond_autograd_fixes` use: a backward whose
    code names `contiguous`/`contiguous_format` already densifies and is left alone."""

    def densifies(ctx, g):
        return g.clone(memory_format=torch.contiguous_format)

    def does_not(ctx, g):
        return g

    assert _compat._names_contiguous(densifies)
    assert not _compat._names_contiguous(does_not)


def test_every_private_functorch_name_resolves_on_this_torch():
    """The private functorch entry points tfun uses are bound once, in `_compat`, by feature
    detection: every supported torch has each of them."""
    assert _compat.functorch_missing(*_compat._FUNCTORCH_WHERE) == ()
    for name in _compat._FUNCTORCH_WHERE:
        assert callable(getattr(_compat, name)), name


def test_no_private_functorch_import_outside_compat_and_context():
    """torch's private functorch modules are named only in `_compat` and `_context`."""
    import pathlib
    import re

    import tfun

    root = pathlib.Path(tfun.__file__).parent
    pattern = re.compile(r"torch\._C\._functorch|torch\._functorch|from torch\._C import _functorch")
    offenders = [
        f"{p.relative_to(root)}:{i}"
        for p in sorted(root.rglob("*.py"))
        if p.name not in ("_compat.py", "_context.py")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == []


def _without(monkeypatch, name):
    """This torch as if it lacked `_compat.<name>`."""
    monkeypatch.setattr(_compat, name, None)
    monkeypatch.setitem(_compat._FUNCTORCH_BOUND, name, None)


def test_a_torch_without_the_interpreter_stack_reader_is_a_tfun_error(monkeypatch):
    from tfun import _context
    from tfun.errors import TfunError

    _without(monkeypatch, "functorch_interpreters")
    assert _context.transform_stack() == ()  # no transform active: nothing to read
    with pytest.raises(TfunError, match=r"retrieve_all_functorch_interpreters.*\n.*Install a torch release"):
        torch.func.jvp(lambda x: (_context.forward_mode_active(), x)[1], (torch.ones(2),), (torch.ones(2),))


def _twice_sin_jvp():
    import tfun

    @tfun.custom_jvp
    def f(x):
        return torch.sin(x)

    @f.defjvp
    def f_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return f(x), 2 * torch.cos(x) * t

    return f


@pytest.mark.parametrize("missing", ["unwrap_batched", "unwrap_for_grad", "add_batch_dim"])
def test_a_torch_without_what_a_traced_custom_jvp_needs_is_a_jit_error(monkeypatch, missing):
    """tfun.jit of tfun.jvp through a custom_jvp function unwraps functorch tensors with
    private torch functions; where this torch lacks one, a JitError names it and the fix."""
    import tfun
    from tfun.errors import JitError

    f = _twice_sin_jvp()
    x, t = torch.randn(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    want = tfun.jvp(f, (x,), (t,))
    torch.testing.assert_close(want[1], 2 * torch.cos(x) * t)
    _without(monkeypatch, missing)
    with pytest.raises(JitError, match=rf"custom_jvp.*{_compat._FUNCTORCH_WHERE[missing]}(.|\n)*outside tfun.jit"):
        tfun.jit(lambda x, t: tfun.jvp(f, (x,), (t,)), backend="aot_eager")(x, t)
    got = tfun.jvp(f, (x,), (t,))  # eagerly it needs none of them
    torch.testing.assert_close(got, want)


def test_a_torch_without_what_custom_vjp_under_a_transform_reads_is_a_tfun_error(monkeypatch):
    import tfun
    from tfun.errors import TfunError

    @tfun.custom_vjp
    def f(x):
        return torch.sin(x)

    f.defvjp(lambda x: (torch.sin(x), x), lambda x, g: (torch.cos(x) * g,))
    xs = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(tfun.vmap(f)(xs), torch.sin(xs))
    _without(monkeypatch, "get_unwrapped")
    with pytest.raises(TfunError, match=r"custom_vjp.*torch\._C\._functorch\.get_unwrapped(.|\n)*install a torch release"):
        tfun.vmap(f)(xs)


def test_tensors_are_real_outside_the_fake_mode():
    # a fake kernel asks a real kernel for a size oneDNN decides (tfun.nn._rnn_fused)
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    with FakeTensorMode():
        assert isinstance(torch.zeros(2), FakeTensor)
        with _compat.outside_fake_mode():
            real = torch.arange(3.0) * 2
        assert isinstance(torch.zeros(2), FakeTensor)
    assert not isinstance(real, FakeTensor) and real.tolist() == [0.0, 2.0, 4.0]


def test_inductor_checks_no_subgraph_input_layouts_per_step():
    # a lowered scan's body is an Inductor subgraph run once per step; its input asserts
    # repeat the layout checks Inductor made when it compiled the loop
    from torch._inductor.utils import run_and_get_code

    import tfun

    W = torch.randn(5, 5, dtype=torch.float64)
    xs = torch.randn(9, 2, 5, dtype=torch.float64)

    def f(W, xs):
        return tfun.lax.scan(lambda h, x: (torch.tanh(h @ W + x),) * 2, torch.zeros(2, 5, dtype=W.dtype), xs)[1]

    out, codes = run_and_get_code(tfun.jit(f), W, xs)
    torch.testing.assert_close(out, f(W, xs))
    code = "\n".join(codes)
    body = code[code.index("def while_loop_body_graph") :]
    body = body[: body.index("\n\n")]
    assert "assert_size_stride" not in body
    assert "assert_size_stride" in code[code.index("def call(") :]  # the graph's own inputs: checked


def test_expm1_is_accurate_eagerly_and_under_inductor():
    """`_compat.expm1` against float64 `torch.expm1`, values and gradients, over tiny to large
    arguments of both signs: eagerly and compiled by Inductor (whose own CPU `expm1` is
    `exp(x) - 1` in torch 2.11 and 2.13: a relative error of 0.19 at 1e-7)."""
    x64 = torch.tensor([-80.0, -5.0, -0.6, -0.5, -0.49, -1e-3, -1e-7, -1e-30, 0.0, 1e-30, 3e-8, 1e-5, 0.25, 0.5, 2.0, 20.0],
                       dtype=torch.float64)
    want = torch.expm1(x64)
    for path, fn in (("eager", _compat.expm1), ("inductor", torch.compile(_compat.expm1, fullgraph=True))):
        x = x64.float().requires_grad_()
        y = fn(x)
        (g,) = torch.autograd.grad(y.sum(), x)
        rel = ((y.double() - want).abs() / want.abs().clamp_min(1e-300))
        assert rel.max().item() < 1e-6, (path, rel)
        grad_rel = ((g.double() - torch.exp(x64)).abs() / torch.exp(x64))
        assert grad_rel.max().item() < 1e-6, (path, grad_rel)


@pytest.mark.parametrize("transform", ["vmap", "grad", "jacrev", "checkpoint"])
def test_a_transform_of_a_builtin_made_inside_jit(transform):
    """`tfun.vmap(torch.linalg.det)` and the like, made inside `tfun.jit`: torch 2.11's Dynamo
    failed on `functools.wraps` of a builtin (its missing `__annotations__`; `_compat.wraps`).
    Against the eager result."""
    x = torch.randn(4, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    make = {
        "vmap": lambda: tfun.vmap(torch.linalg.det, (0,)),
        "grad": lambda: tfun.vmap(tfun.grad(torch.linalg.det)),
        "jacrev": lambda: tfun.jacrev(torch.sin),
        "checkpoint": lambda: tfun.checkpoint(torch.sin),
    }[transform]
    want = make()(x)
    torch._dynamo.reset()
    torch.testing.assert_close(tfun.jit(lambda x: make()(x), backend="aot_eager")(x), want)
    assert make().__wrapped__ is not None


def test_transforms_made_inside_jit_use_the_wraps_form_dynamo_recognizes(monkeypatch):
    """`tfun.grad(f)` made inside `tfun.jit`, for a nested, a global and a nested-in-nested
    function: `_compat.wraps` must call `functools.wraps(f)` with one argument, the form
    Dynamo recognizes; with `updated=` spelled out, Dynamo traced `functools.update_wrapper`,
    whose `__dict__.update` torch 2.11 cannot trace (every such call was a JitError there).
    The spy fails on every torch if the form changes; the values are checked against eager."""
    import functools

    forms = []
    real_wraps = functools.wraps

    def spy(wrapped, *args, **kwargs):
        forms.append((args, tuple(sorted(kwargs))))
        return real_wraps(wrapped, *args, **kwargs)

    monkeypatch.setattr(functools, "wraps", spy)
    tfun.grad(lambda z: z.sum())
    tfun.value_and_grad(lambda z: z.sum())
    assert forms == [((), ()), ((), ())]
    monkeypatch.undo()

    total = lambda z: (z**2).sum()  # noqa: E731
    x = torch.randn(3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    programs = {
        "nested": lambda y: tfun.grad(lambda z: (z**3).sum())(y),
        "global": lambda y: tfun.grad(total)(y),
        "nested_in_nested": lambda y: tfun.grad(lambda u: (tfun.grad(total)(u) ** 2).sum())(y),
    }
    for name, f in programs.items():
        torch._dynamo.reset()
        torch.testing.assert_close(tfun.jit(f, backend="aot_eager")(x), f(x), msg=name)
