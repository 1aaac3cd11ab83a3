"""Composition matrix: every `tfun.lax` op under every transform.

Each op is a function `f(x) -> tensor` of one float64 vector `x`, paired with the same
computation written as a plain Python loop / `if` (`ref`). Every cell (op, transform)
computes the transform of `f` and checks it against plain `torch.autograd` applied to
`ref` (per example, for the vmapped cells). Predicates and trip counts depend on `x`,
so under `vmap` the batched-predicate paths of `tfun.lax._batching` are exercised, and
the batch is chosen so that different examples take different branches / trip counts.
"""

from __future__ import annotations

import pytest
import torch
import torch.func

import tfun

lax = tfun.lax
D = torch.float64
N = 4  # length of x


def _t(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=D)


W = _t(N, N, seed=100) / N**0.5
W2 = _t(2, 2, seed=101)


# --------------------------------------------------------------------------------------
# ops: (tfun version, plain-Python reference)
# --------------------------------------------------------------------------------------


def _t_branch(x):
    return torch.sin(x) * x.sum()


def _f_branch(x):
    return torch.cos(x) + x**2


def cond_f(x):
    return lax.cond(x.sum() > 0, _t_branch, _f_branch, x)


def cond_ref(x):
    if x.sum() > 0:
        return _t_branch(x)
    return _f_branch(x)


_BRANCHES = [
    lambda x: torch.sin(x) * 2.0,
    lambda x: x**3 - x,
    lambda x: torch.tanh(W @ x),
]


def _switch_index(x):
    # 0, 1 or 2 depending on the data; -1 / 5 exercise clamping
    s = x.sum()
    return (s > -1).long() * 2 + (s > 1).long() * 4 - 1


def switch_f(x):
    return lax.switch(_switch_index(x), _BRANCHES, x)


def switch_ref(x):
    i = int(_switch_index(x))
    i = min(max(i, 0), len(_BRANCHES) - 1)
    return _BRANCHES[i](x)


def _wl_cond(c):
    i, y = c
    return (i < 6) & (y.abs().sum() < 8.0)


def _wl_body(c):
    i, y = c
    return i + 1, y * 1.3 + 0.2 * torch.sin(y)


def while_f(x):
    return lax.while_loop(_wl_cond, _wl_body, (torch.tensor(0), x))[1]


def while_ref(x):
    i, y = 0, x
    while i < 6 and y.abs().sum() < 8.0:
        i, y = i + 1, y * 1.3 + 0.2 * torch.sin(y)
    return y


def _fori_body(i, y):
    return torch.tanh(W @ y) + y * i.to(y.dtype) * 0.1


def fori_f(x):
    return lax.fori_loop(0, 3, _fori_body, x)


def fori_tensor_f(x):
    return lax.fori_loop(torch.tensor(0), torch.tensor(3), _fori_body, x)


def fori_ref(x):
    y = x
    for i in range(3):
        y = torch.tanh(W @ y) + y * i * 0.1
    return y


def _data_upper(x):
    # a tensor bound that depends on the data: batched under vmap
    return (x.sum() > 0).long() + 2


def fori_data_bound_f(x):
    return lax.fori_loop(0, _data_upper(x), _fori_body, x)


def fori_data_bound_ref(x):
    y = x
    for i in range(int(_data_upper(x))):
        y = torch.tanh(W @ y) + y * i * 0.1
    return y


T = 3


def _scan_xs(x):
    return x[None, :] * torch.arange(1, T + 1, dtype=D)[:, None] * 0.5


def scan_f(x):
    def step(h, xt):
        h = torch.tanh(W @ h + xt)
        return h, (h**2).sum()

    h, ys = lax.scan(step, x, _scan_xs(x))
    return torch.cat([h, ys])


def scan_ref(x):
    h, ys = x, []
    for xt in _scan_xs(x):
        h = torch.tanh(W @ h + xt)
        ys.append((h**2).sum())
    return torch.cat([h, torch.stack(ys)])


def _lin_combine(e1, e2):
    a1, b1 = e1
    a2, b2 = e2
    return a1 * a2, a2 * b1 + b2


def assoc_f(x):
    # h_t = a_t * h_{t-1} + b_t, as a parallel scan; odd length exercises the remainder
    e = torch.cat([x, x[:1] * 0.5])  # length 5
    a, b = torch.tanh(e), e**2 + torch.sin(e)
    return lax.associative_scan(_lin_combine, (a, b))[1]


def assoc_ref(x):
    e = torch.cat([x, x[:1] * 0.5])
    a, b = torch.tanh(e), e**2 + torch.sin(e)
    h, out = torch.zeros((), dtype=D), []
    for t in range(e.shape[0]):
        h = a[t] * h + b[t]
        out.append(h)
    return torch.stack(out)


def _map_row(r):
    return torch.tanh(W2 @ r) * r.sum()


def map_f(x):
    return lax.map(_map_row, x.reshape(2, 2)).reshape(-1)


def map_batched_f(x):
    return lax.map(_map_row, x.reshape(2, 2), batch_size=2).reshape(-1)


def map_ref(x):
    return torch.stack([_map_row(r) for r in x.reshape(2, 2)]).reshape(-1)


def select_f(x):
    return lax.select(x > 0, torch.sin(x) * x, x**3)


def select_ref(x):
    return torch.stack([torch.sin(v) * v if v > 0 else v**3 for v in x])


OPS = {
    "cond": (cond_f, cond_ref),
    "switch": (switch_f, switch_ref),
    "while_loop": (while_f, while_ref),
    "fori_loop_static": (fori_f, fori_ref),
    "fori_loop_tensor": (fori_tensor_f, fori_ref),
    "fori_loop_data_bound": (fori_data_bound_f, fori_data_bound_ref),
    "scan": (scan_f, scan_ref),
    "associative_scan": (assoc_f, assoc_ref),
    "map": (map_f, map_ref),
    "map_batch_size": (map_batched_f, map_ref),
    "select": (select_f, select_ref),
}

# a batch whose examples take different branches / trip counts
XB = torch.stack(
    [
        torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=D),  # sum 0.7: cond true, switch 1
        torch.tensor([-0.9, 0.2, -0.4, -0.3], dtype=D),  # sum -1.4: cond false, switch clamp 0
        torch.tensor([1.1, 0.7, -0.2, 0.6], dtype=D),  # sum 2.2: switch clamp 2
        torch.tensor([-0.1, -0.3, 0.2, -0.1], dtype=D),  # sum -0.3: cond false, switch 1
    ]
)
X = XB[0]
V = _t(N, seed=7)


# --------------------------------------------------------------------------------------
# references: plain autograd on the plain-Python ref
# --------------------------------------------------------------------------------------


def _ref_grad(ref, x):
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ref(x).sum(), x)
    return g


def _ref_jac(ref, x):
    return torch.autograd.functional.jacobian(ref, x.detach().clone())


def _ref_gradgrad(ref, x):
    # d/dx sum(grad(sum ref)(x)) = H @ 1
    x = x.detach().clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ref(x).sum(), x, create_graph=True)
    (gg,) = torch.autograd.grad(g.sum(), x)
    return gg


def _sumf(f):
    return lambda x: f(x).sum()


def _backward(f, ref):
    x = X.clone().requires_grad_(True)
    f(x).sum().backward()
    return x.grad, _ref_grad(ref, X)


CELLS = {
    "backward": _backward,
    "torch.func.grad": lambda f, ref: (torch.func.grad(_sumf(f))(X), _ref_grad(ref, X)),
    "tfun.grad": lambda f, ref: (tfun.grad(_sumf(f))(X), _ref_grad(ref, X)),
    "torch.func.vmap": lambda f, ref: (torch.func.vmap(f)(XB), torch.stack([ref(x) for x in XB])),
    "tfun.vmap": lambda f, ref: (tfun.vmap(f)(XB), torch.stack([ref(x) for x in XB])),
    "tfun.jvp": lambda f, ref: (tfun.jvp(f, (X,), (V,)), (ref(X), _ref_jac(ref, X) @ V)),
    "torch.func.jvp": lambda f, ref: (torch.func.jvp(f, (X,), (V,)), (ref(X), _ref_jac(ref, X) @ V)),
    "tfun.jacrev": lambda f, ref: (tfun.jacrev(f)(X), _ref_jac(ref, X)),
    "tfun.jacfwd": lambda f, ref: (tfun.jacfwd(f)(X), _ref_jac(ref, X)),
    "vmap(grad)": lambda f, ref: (
        tfun.vmap(tfun.grad(_sumf(f)))(XB),
        torch.stack([_ref_grad(ref, x) for x in XB]),
    ),
    "tfun.hessian": lambda f, ref: (
        tfun.hessian(_sumf(f))(X),
        torch.autograd.functional.hessian(_sumf(ref), X.detach().clone()),
    ),
    "grad(grad)": lambda f, ref: (
        tfun.grad(lambda x: tfun.grad(_sumf(f))(x).sum())(X),
        _ref_gradgrad(ref, X),
    ),
}

# Cells that genuinely fail: (op, transform) -> reason (exact error). strict=True, so a
# fix turns them into XPASS failures and they must be removed from here.
XFAIL: dict[tuple[str, str], str] = {}


def _params():
    for op in OPS:
        for tr in CELLS:
            marks = []
            if (op, tr) in XFAIL:
                marks.append(pytest.mark.xfail(strict=True, raises=RuntimeError, reason=XFAIL[(op, tr)]))
            yield pytest.param(op, tr, marks=marks, id=f"{op}-{tr}")


@pytest.mark.parametrize("op,transform", list(_params()))
def test_matrix(op, transform):
    f, ref = OPS[op]
    got, want = CELLS[transform](f, ref)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_batch_covers_branches():
    """The vmap cells are only meaningful if the batch splits the data-dependent choices."""
    assert len({bool(x.sum() > 0) for x in XB}) == 2
    assert len({min(max(int(_switch_index(x)), 0), 2) for x in XB}) == 3
    trips = set()
    for x in XB:
        i, y = 0, x
        while i < 6 and y.abs().sum() < 8.0:
            i, y = i + 1, y * 1.3 + 0.2 * torch.sin(y)
        trips.add(i)
    assert len(trips) >= 2


# --------------------------------------------------------------------------------------
# gradcheck / gradgradcheck per op (float64)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", list(OPS))
def test_gradcheck(op):
    f, _ = OPS[op]
    x = X.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize("op", list(OPS))
def test_gradgradcheck(op):
    f, _ = OPS[op]
    x = X.clone().requires_grad_(True)
    assert torch.autograd.gradgradcheck(f, (x,))
