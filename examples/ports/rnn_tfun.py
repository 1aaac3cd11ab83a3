"""An Elman RNN trained with `lax.scan` + `tfun.grad` (tfun side of the port).

Run: python examples/ports/rnn_tfun.py
"""

import math

import torch

import tfun
from tfun import lax

T, H = 40, 16  # sequence length, hidden size

# Deterministic data and parameters (no RNG, so both sides see the same numbers).
t = torch.arange(T + 1, dtype=torch.float32)
wave = torch.sin(0.3 * t)
xs, targets = wave[:-1, None], wave[1:]  # predict the next sample
k = torch.arange(H * H, dtype=torch.float32).reshape(H, H)
params = {
    "W": 0.3 * torch.cos(k) / math.sqrt(H),
    "U": 0.5 * torch.sin(torch.arange(H, dtype=torch.float32))[None, :],
    "b": torch.zeros(H),
    "v": 0.1 * torch.cos(torch.arange(H, dtype=torch.float32)),
}


def loss_fn(params, xs, targets):
    def step(h, x):
        h = torch.tanh(h @ params["W"] + x @ params["U"] + params["b"])
        return h, h @ params["v"]

    _, preds = lax.scan(step, torch.zeros(H), xs)
    return torch.mean((preds - targets) ** 2)


grad_fn = tfun.value_and_grad(loss_fn)  # no jit needed: eager is as fast as the loop
lr = 0.2
for it in range(201):
    loss, g = grad_fn(params, xs, targets)
    params = tfun.tree.tree_map(lambda p, gp: p - lr * gp, params, g)
    if it % 50 == 0:
        print(f"step {it:3d}  loss {float(loss):.6f}")
