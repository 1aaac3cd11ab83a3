"""Newton's method and bisection with `lax.while_loop` (JAX side of the port).

Run: python examples/ports/solver_jax.py
"""

import jax
import jax.numpy as jnp
from jax import lax

# Newton's method for a batch of equations f(x) = x**3 - 2x - a = 0; f' comes from jax.grad.
a = jnp.array([1.0, 5.0, 10.0, 30.0])


def f(x, a):
    return x**3 - 2.0 * x - a


df = jax.vmap(jax.grad(f))  # elementwise derivative


def newton(a, x0, tol=1e-6, max_iter=50):
    def cond_fun(state):
        i, x, err = state
        return (err > tol) & (i < max_iter)

    def body_fun(state):
        i, x, _ = state
        x_new = x - f(x, a) / df(x, a)
        return i + 1, x_new, jnp.max(jnp.abs(x_new - x))

    return lax.while_loop(cond_fun, body_fun, (0, x0, jnp.inf))


i, x, err = newton(a, jnp.full_like(a, 2.0))
print("newton iterations", int(i))
print("roots", " ".join(f"{float(v):.6f}" for v in x))
print("max residual below 1e-5:", bool(jnp.max(jnp.abs(f(x, a))) < 1e-5))


# Bisection for cos(x) = x on [0, 1]: a fixed number of halvings with fori_loop.
def bisect(g, lo, hi, n):
    def body(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) / 2
        left = jnp.sign(g(mid)) == jnp.sign(g(lo))
        return jnp.where(left, mid, lo), jnp.where(left, hi, mid)

    return lax.fori_loop(0, n, body, (lo, hi))


lo, hi = bisect(lambda x: jnp.cos(x) - x, jnp.array(0.0), jnp.array(1.0), 30)
print(f"bisection root {float((lo + hi) / 2):.6f}")
