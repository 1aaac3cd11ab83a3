"""A two-layer MLP with dropout in JAX: key-threaded init, one SGD step, as ported in docs/porting.md."""

import jax
import jax.numpy as jnp
import numpy as np


def init(key, sizes):
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, kw, kb = jax.random.split(key, 3)
        bound = 1.0 / np.sqrt(n_in)
        params.append({"w": jax.random.uniform(kw, (n_in, n_out), minval=-bound, maxval=bound),
                       "b": jax.random.uniform(kb, (n_out,), minval=-bound, maxval=bound)})
    return params


def loss_fn(params, x, y, key, rate=0.25):
    h = jnp.tanh(x @ params[0]["w"] + params[0]["b"])
    keep = jax.random.bernoulli(key, 1.0 - rate, h.shape)
    h = jnp.where(keep, h / (1.0 - rate), 0.0)
    out = h @ params[1]["w"] + params[1]["b"]
    return jnp.mean((out - y) ** 2)


key = jax.random.PRNGKey(0)
key, k_init, k_x, k_perm = jax.random.split(key, 4)
params = init(k_init, [8, 32, 1])
x = jax.random.normal(k_x, (64, 8))
y = jnp.sin(x.sum(axis=1, keepdims=True))
order = jax.random.permutation(k_perm, 64)
x, y = x[order], y[order]

leaves = jax.tree_util.tree_leaves(params)
print("init bits:", " ".join(f"{int(v):08x}" for v in np.asarray(leaves[1]).view(np.uint32).ravel()[:4]))
print("init sum:", f"{float(sum(np.asarray(l, np.float64).sum() for l in leaves)):.9f}")
print("first batch order:", np.asarray(order[:8]).tolist())
key, k_drop = jax.random.split(key)
loss, grads = jax.value_and_grad(loss_fn)(params, x, y, k_drop)
print("dropout mask kept:", int(jax.random.bernoulli(k_drop, 0.75, (64, 32)).sum()))
print(f"step 0 loss: {float(loss):.6f}")
params = jax.tree_util.tree_map(lambda p, g: p - 0.1 * g, params, grads)
key, k_drop = jax.random.split(key)
print(f"step 1 loss: {float(loss_fn(params, x, y, k_drop)):.6f}")
