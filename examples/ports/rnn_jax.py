"""An Elman RNN trained with `lax.scan` + `jax.grad` (JAX side of the port).

Run: python examples/ports/rnn_jax.py
"""

import jax
import jax.numpy as jnp
from jax import lax

T, H = 40, 16  # sequence length, hidden size

# Deterministic data and parameters (no RNG, so both sides see the same numbers).
t = jnp.arange(T + 1, dtype=jnp.float32)
wave = jnp.sin(0.3 * t)
xs, targets = wave[:-1, None], wave[1:]  # predict the next sample
k = jnp.arange(H * H, dtype=jnp.float32).reshape(H, H)
params = {
    "W": 0.3 * jnp.cos(k) / jnp.sqrt(H),
    "U": 0.5 * jnp.sin(jnp.arange(H, dtype=jnp.float32))[None, :],
    "b": jnp.zeros(H),
    "v": 0.1 * jnp.cos(jnp.arange(H, dtype=jnp.float32)),
}


def loss_fn(params, xs, targets):
    def step(h, x):
        h = jnp.tanh(h @ params["W"] + x @ params["U"] + params["b"])
        return h, h @ params["v"]

    _, preds = lax.scan(step, jnp.zeros(H), xs)
    return jnp.mean((preds - targets) ** 2)


grad_fn = jax.jit(jax.value_and_grad(loss_fn))
lr = 0.2
for it in range(201):
    loss, g = grad_fn(params, xs, targets)
    params = jax.tree_util.tree_map(lambda p, gp: p - lr * gp, params, g)
    if it % 50 == 0:
        print(f"step {it:3d}  loss {float(loss):.6f}")
