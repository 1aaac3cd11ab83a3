"""tfun/_hoist_constants.py: tensor constants inside loop bodies and branches under Inductor.

torch 2.11 and 2.13 compile a body holding a tensor literal (`torch.tensor([[1., 2.], [3.,
4.]])` in a scan body) into code that fails when it runs ("_torchinductor_pyobject_tensor_data_ptr:
non-tensor input"; found by a correctness hunt, session 20). tfun's post-grad pass moves each
such constant out to the graph around the HOP. Values and gradients against eager, in every
op that lowers to a HOP with a body, nested too.
"""

from __future__ import annotations

import pytest
import torch

import tfun
from tfun import lax

from .helpers import assert_tree_allclose

DT = torch.float64


def _table() -> torch.Tensor:
    return torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]], dtype=DT)


def _programs():
    def scan(x, w):
        def body(c, xt):
            c = torch.tanh(c * w + xt @ _table().T)  # (2,)
            return c, c * torch.tensor([[0.5, 2.0]], dtype=DT)

        c, ys = lax.scan(body, torch.zeros(2, dtype=DT), x)
        return c.sum() + ys.pow(2).sum()

    def while_loop(x, w):
        def body(s):
            i, h = s
            return i + 1, torch.sin(h * w) + _table()[:, : h.shape[-1]]

        return lax.while_loop(lambda s: s[0] < 3, body, (0, x[0, :2].reshape(1, 2).expand(2, 2).contiguous()))[1].sum()

    def fori_loop(x, w):
        return lax.fori_loop(0, 4, lambda i, h: torch.tanh(h * w + _table()), torch.zeros(2, 3, dtype=DT) + x[0]).sum()

    def cond(x, w):
        out = lax.cond(x.sum() > 0, lambda u: (u * w) @ _table().T, lambda u: u[:, :2] * w - torch.tensor([[9.0, 8.0]], dtype=DT), x)
        return out.pow(2).sum()

    def map(x, w):
        return lax.map(lambda r: (r * w) @ _table().T, x).sin().sum()

    def nested(x, w):
        def branch(u):
            return lax.scan(lambda c, xt: (c + xt @ _table().T * w, c), torch.zeros(2, dtype=DT), u)[1]

        return lax.cond(x.sum() > -100, branch, lambda u: u[:, :2] * w, x).pow(2).sum()

    return {"scan": scan, "while_loop": while_loop, "fori_loop": fori_loop, "cond": cond, "map": map, "nested": nested}


@pytest.mark.parametrize("name", sorted(_programs()))
def test_constants_in_bodies_under_inductor(name):
    f = _programs()[name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, dtype=DT, generator=g)
    w = torch.tensor(0.8, dtype=DT)
    want = tfun.value_and_grad(f, argnums=(0, 1))(x, w)
    torch._dynamo.reset()
    # one compiled program holding both the differentiated bodies and the plain forward's
    got_vg, got_v = tfun.jit(lambda x, w: (tfun.value_and_grad(f, argnums=(0, 1))(x, w), f(x, w)))(x, w)
    assert_tree_allclose(got_vg, want)
    assert_tree_allclose(got_v, want[0])


def test_the_rewrite_moves_the_constant_out_of_the_body():
    """The body's subgraph holds no tensor constant after the pass; the graph around it does,
    and the HOP takes it as an operand."""
    from tfun import _hoist_constants

    seen = []

    def capture(gm, example_inputs):
        from torch._functorch.aot_autograd import aot_module_simplified

        def fw(g, _):
            _hoist_constants.rewrite(g.graph)
            seen.append(g)
            return g

        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    def f(x):
        return lax.scan(lambda c, xt: (c, xt @ _table().T), torch.zeros(()), x)[1]

    x = torch.randn(4, 3, dtype=DT)
    torch._dynamo.reset()
    out = torch.compile(f, backend=capture, fullgraph=True)(x)
    torch.testing.assert_close(out, f(x))
    (gm,) = seen
    (scan,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.scan]
    body = getattr(gm, scan.args[0].target)
    assert not _hoist_constants._tensor_constants(body)
    assert [n.op for n in scan.args[3]] == ["get_attr"]
    torch.testing.assert_close(getattr(gm, scan.args[3][0].target), _table())
