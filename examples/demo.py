"""tfun in one page: every tfun.lax op on torch tensors, with what it prints.

Run: python examples/demo.py
"""

import torch

import tfun
from tfun import lax

torch.manual_seed(0)


def show(title, value):
    print(f"{title:<34} {value}")


# cond: a data-dependent branch (here the paper's NaN/Inf clamping).
x = torch.tensor([1.0, float("inf"), -3.0])
clamped = lax.cond(
    torch.isinf(x).any() | torch.isnan(x).any(),
    lambda v: v.clamp(-10.0, 10.0),
    lambda v: v.clone(),
    x,
)
show("cond (clamp inf):", clamped)

# switch: the index is clamped into range, as in JAX.
branches = [lambda v: v + 1, lambda v: v * 10, lambda v: -v]
show("switch(index=7) -> last branch:", lax.switch(7, branches, torch.tensor(2.0)))

# select: elementwise choice over pytrees.
show("select:", lax.select(torch.tensor([True, False, True]), torch.ones(3), torch.zeros(3)))

# while_loop: the trip count depends on data; Python ints in the carry become tensors.
i, v = lax.while_loop(lambda c: c[1] < 1000.0, lambda c: (c[0] + 1, c[1] * 3.0), (0, 1.0))
show("while_loop (3^i >= 1000):", (int(i), float(v)))

# fori_loop: i arrives as a 0-d integer tensor.
show("fori_loop (sum of squares 0..9):", lax.fori_loop(0, 10, lambda i, acc: acc + i * i, 0))


# scan: an RNN over a sequence, carry = hidden state, y = per-step output.
W = torch.randn(4, 4) * 0.5
U = torch.randn(3, 4)


def rnn_step(h, x_t):
    h = torch.tanh(h @ W + x_t @ U)
    return h, h.sum()


h_T, ys = lax.scan(rnn_step, torch.zeros(4), torch.randn(6, 3))
show("scan RNN: final h shape, ys shape:", (tuple(h_T.shape), tuple(ys.shape)))

# scan with pytrees, reverse, and no xs.
carry, ys = lax.scan(lambda c, _: ({"n": c["n"] + 1, "fib": (c["fib"][1], c["fib"][0] + c["fib"][1])}, c["fib"][0]),
                     {"n": 0, "fib": (0, 1)}, None, length=10)
show("scan Fibonacci (xs=None):", ys.tolist())

# associative_scan: prefix sums in log depth, and a non-commutative operator.
show("associative_scan cumsum:", lax.associative_scan(torch.add, torch.arange(1.0, 9.0)))
# composition of affine maps x -> a*x + b: the S5/linear-recurrence operator
a = torch.full((5,), 0.5)
b = torch.arange(5.0)
_, h = lax.associative_scan(lambda l, r: (r[0] * l[0], r[0] * l[1] + r[1]), (a, b))
show("associative_scan h=a*h+b:", h)

# map, with and without batching (batch_size applies torch.func.vmap per batch).
show("map x**2:", lax.map(lambda t: t**2, torch.arange(5.0)))
show("map x**2, batch_size=2:", lax.map(lambda t: t**2, torch.arange(5.0), batch_size=2))

# Gradients flow through every op, as through a hand-written loop.
w = torch.tensor(0.9, requires_grad=True)
final, _ = lax.scan(lambda c, x_t: (c * w + x_t, None), torch.tensor(0.0), torch.ones(5))
(gw,) = torch.autograd.grad(final, w)
show("d/dw of scan(c*w + 1) at w=0.9:", round(float(gw), 4))

# The rules: a body that breaks one gets a JAX-quality error.
try:
    lax.scan(lambda c, x_t: ((c, c), None), torch.tensor(0.0), torch.ones(3))
except tfun.errors.StructureMismatchError as e:
    print("\nA broken body is refused:\n" + str(e))
