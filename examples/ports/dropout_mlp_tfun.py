"""The same MLP in tfun: `tfun.random` keys give JAX's initial parameters and dropout masks."""

import math

import torch

import tfun
import tfun.random as jr  # the JAX spelling: jax.random -> tfun.random


def init(key, sizes):
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, kw, kb = jr.split(key, 3)
        bound = 1.0 / math.sqrt(n_in)
        params.append({"w": jr.uniform(kw, (n_in, n_out), minval=-bound, maxval=bound),
                       "b": jr.uniform(kb, (n_out,), minval=-bound, maxval=bound)})
    return params


def loss_fn(params, x, y, key, rate=0.25):
    h = torch.tanh(x @ params[0]["w"] + params[0]["b"])
    keep = jr.bernoulli(key, 1.0 - rate, h.shape)
    h = torch.where(keep, h / (1.0 - rate), 0.0)
    out = h @ params[1]["w"] + params[1]["b"]
    return torch.mean((out - y) ** 2)


key = jr.PRNGKey(0)
key, k_init, k_x, k_perm = jr.split(key, 4)
params = init(k_init, [8, 32, 1])
x = jr.normal(k_x, (64, 8))
y = torch.sin(x.sum(dim=1, keepdim=True))
order = jr.permutation(k_perm, 64)
x, y = x[order], y[order]

leaves = tfun.tree.tree_leaves(params)
print("init bits:", " ".join(f"{v & 0xFFFFFFFF:08x}" for v in leaves[1].view(torch.int32).ravel()[:4].tolist()))
print("init sum:", f"{float(sum(leaf.double().sum() for leaf in leaves)):.9f}")
print("first batch order:", order[:8].tolist())
key, k_drop = jr.split(key)
loss, grads = tfun.value_and_grad(loss_fn)(params, x, y, k_drop)
print("dropout mask kept:", int(jr.bernoulli(k_drop, 0.75, (64, 32)).sum()))
print(f"step 0 loss: {float(loss):.6f}")
params = tfun.tree.tree_map(lambda p, g: p - 0.1 * g, params, grads)
key, k_drop = jr.split(key)
print(f"step 1 loss: {float(loss_fn(params, x, y, k_drop)):.6f}")
