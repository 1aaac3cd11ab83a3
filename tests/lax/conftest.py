import pytest


@pytest.fixture(scope="module")
def jax():
    """JAX as a differential oracle, with x64 on so float64/int64 compare exactly; skips without it."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)  # float64/int64 compare exactly
    return jax
