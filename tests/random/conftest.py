"""JAX is the oracle in JAX's default configuration: other test modules turn on
`jax_enable_x64` globally, so each test here runs with it off."""

import importlib.util

import pytest

if importlib.util.find_spec("jax") is not None:
    import jax

    @pytest.fixture(autouse=True)
    def _jax_default_32_bit_mode():
        with jax.enable_x64(False):
            yield
