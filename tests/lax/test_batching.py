"""vmap over data-dependent predicates, and derivatives through eager control flow."""

import pytest
import torch

from tfun import lax


def test_vmap_cond_batched_predicate_selects_per_example():
    f = lambda x: lax.cond(x.sum() > 0, lambda v: v * 2, lambda v: -v, x)
    xs = torch.tensor([[1.0, 2.0], [-3.0, 1.0], [-1.0, -1.0]])
    expected = torch.stack([f(x) for x in xs])
    torch.testing.assert_close(torch.func.vmap(f)(xs), expected)


def test_vmap_switch_batched_index_clamps_and_selects():
    g = lambda i, x: lax.switch(i, [lambda v: v, lambda v: v * 10, lambda v: -v], x)
    idx = torch.tensor([0, 1, 5, -2])
    xs = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = torch.stack([g(int(i), x) for i, x in zip(idx, xs)])
    torch.testing.assert_close(torch.func.vmap(g)(idx, xs), expected)


def test_vmap_while_loop_runs_until_all_done_and_freezes_finished():
    def w(limit):
        return lax.while_loop(lambda c: c[0] < limit, lambda c: (c[0] + 1.0, c[1] * 2), (torch.tensor(0.0), torch.tensor(1.0)))

    limits = torch.tensor([0.0, 1.0, 3.0, 5.0, 2.5])
    out = torch.func.vmap(w)(limits)
    expected = [w(l) for l in limits]
    torch.testing.assert_close(out[0], torch.stack([e[0] for e in expected]))
    torch.testing.assert_close(out[1], torch.stack([e[1] for e in expected]))


def test_vmap_of_grad_through_cond():
    h = lambda x: lax.cond(x > 0, lambda v: v**2, lambda v: v**3, x)
    xs = torch.tensor([2.0, -2.0, 0.5])
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(h))(xs), torch.tensor([4.0, 12.0, 1.0]))


@pytest.mark.parametrize("x0", [1.1, 0.7, -1.3])
def test_while_loop_second_derivative_is_exact(x0):
    # x**4 through a data-dependent while_loop: d2/dx2 = 12 x**2 (torch 2.13's own while_loop
    # HOP returns a wrong value here without an error).
    f = lambda x: lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] * x, c[1] + 1), (x, 0))[0]
    x = torch.tensor(x0, dtype=torch.float64)
    torch.testing.assert_close(torch.func.grad(torch.func.grad(f))(x), 12 * x**2)
    xr = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(xr), xr, create_graph=True)
    (gg,) = torch.autograd.grad(g, xr)
    torch.testing.assert_close(g, 4 * x**3)
    torch.testing.assert_close(gg, 12 * x**2)
