"""`tfun.random`: JAX's explicit-key PRNG on torch tensors.

Keys are `torch.uint32` tensors of shape `(2,)` holding a Threefry-2x32 key, exactly the
raw keys of `jax.random.PRNGKey`. Every function takes the key explicitly and is pure:
the same key gives the same numbers, eagerly, under `tfun.jit`, `tfun.vmap` (map over a
batch of keys) and inside `scan`/`fori_loop` carries.

Against `jax.random` (default configuration, CPU), same seed, shape and dtype, every
function here is bit-identical in float32 (and in float16/bfloat16, except float16
`gumbel`): Threefry and the counters are JAX's, and the float steps replay XLA's CPU
kernels (`log`, `log1p`, `erf`, `erf_inv`) op for op, fused multiply-adds included. Each
docstring states its guarantee for other dtypes. `tfun.jit(backend="aot_eager")`
reproduces eager exactly (tested); the default Inductor backend gave identical
`normal`/`gumbel`/`uniform` draws in a manual check on CPU, but is not pinned by tests.
"""

from ._keys import PRNGKey as PRNGKey
from ._keys import bits as bits
from ._keys import fold_in as fold_in
from ._keys import key as key
from ._keys import key_data as key_data
from ._keys import split as split
from ._samplers import bernoulli as bernoulli
from ._samplers import categorical as categorical
from ._samplers import gumbel as gumbel
from ._samplers import normal as normal
from ._samplers import permutation as permutation
from ._samplers import randint as randint
from ._samplers import truncated_normal as truncated_normal
from ._samplers import uniform as uniform

__all__ = [
    "PRNGKey",
    "key",
    "key_data",
    "split",
    "fold_in",
    "bits",
    "uniform",
    "normal",
    "truncated_normal",
    "bernoulli",
    "gumbel",
    "categorical",
    "randint",
    "permutation",
]
