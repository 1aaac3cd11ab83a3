"""tfun.random against jax.random (the oracle, computed in the test): bit for bit where promised."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tfun
import tfun.random as tr
from tfun.errors import ArgumentTypeError, ArgumentValueError, TfunError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is the oracle")

if importlib.util.find_spec("jax") is not None:
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_platforms", "cpu")

SEEDS = [0, 1, 42, 2**31 + 7, 2**32 - 1]
SHAPES = [(), (1,), (7,), (3, 5), (2, 3, 4), (1001,)]


def _np(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.uint32:
        return t.to(torch.int64).numpy().astype(np.uint32)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # compare bit patterns
    return t.numpy()


def _jnp(a) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype == jnp.bfloat16:
        return a.view(np.uint16)
    return a


def _same_bits(ours: torch.Tensor, theirs) -> None:
    a, b = _np(ours), _jnp(theirs)
    assert a.shape == b.shape, (a.shape, b.shape)
    if a.dtype.kind == "f":
        assert np.array_equal(a.view(f"u{a.itemsize}"), b.view(f"u{b.itemsize}")), (a, b)
    else:
        assert np.array_equal(a.astype(np.int64), b.astype(np.int64)), (a, b)


def _max_ulp(ours: torch.Tensor, theirs) -> int:
    a = ours.numpy().astype(np.float32).view(np.int32).astype(np.int64)
    b = np.asarray(theirs).astype(np.float32).view(np.int32).astype(np.int64)
    return int(np.abs(a - b).max()) if a.size else 0


# --- exact: keys, bits and the samplers with no transcendental step ------------------------------

EXACT = {
    "bits": (lambda k, s: tr.bits(k, s), lambda k, s: jax.random.bits(k, s)),
    "bits_u8": (lambda k, s: tr.bits(k, s, torch.uint8), lambda k, s: jax.random.bits(k, s, jnp.uint8)),
    "uniform": (lambda k, s: tr.uniform(k, s), lambda k, s: jax.random.uniform(k, s)),
    "uniform_range": (lambda k, s: tr.uniform(k, s, minval=-3.0, maxval=0.5),
                      lambda k, s: jax.random.uniform(k, s, minval=-3.0, maxval=0.5)),
    "uniform_bf16": (lambda k, s: tr.uniform(k, s, torch.bfloat16, -2.0, 3.0),
                     lambda k, s: jax.random.uniform(k, s, jnp.bfloat16, -2.0, 3.0)),
    "uniform_f16": (lambda k, s: tr.uniform(k, s, torch.float16), lambda k, s: jax.random.uniform(k, s, jnp.float16)),
    "normal_bf16": (lambda k, s: tr.normal(k, s, torch.bfloat16), lambda k, s: jax.random.normal(k, s, jnp.bfloat16)),
    "normal_f16": (lambda k, s: tr.normal(k, s, torch.float16), lambda k, s: jax.random.normal(k, s, jnp.float16)),
    "bernoulli": (lambda k, s: tr.bernoulli(k, 0.3, s), lambda k, s: jax.random.bernoulli(k, 0.3, s)),
    "bernoulli_high": (lambda k, s: tr.bernoulli(k, 0.7, s, mode="high"),
                       lambda k, s: jax.random.bernoulli(k, 0.7, s, mode="high")),
    "randint": (lambda k, s: tr.randint(k, s, -5, 1000), lambda k, s: jax.random.randint(k, s, -5, 1000)),
    "randint_full": (lambda k, s: tr.randint(k, s, -(2**31), 2**31 - 1),
                     lambda k, s: jax.random.randint(k, s, -(2**31), 2**31 - 1)),
    "randint_int8": (lambda k, s: tr.randint(k, s, -100, 100, torch.int8),
                     lambda k, s: jax.random.randint(k, s, -100, 100, jnp.int8)),
    "randint_empty": (lambda k, s: tr.randint(k, s, 3, 3), lambda k, s: jax.random.randint(k, s, 3, 3)),
    "categorical": (lambda k, s: tr.categorical(k, torch.log(torch.arange(1.0, 8.0)), shape=(*s, )),
                    lambda k, s: jax.random.categorical(k, jnp.log(jnp.arange(1.0, 8.0)), shape=(*s,))),
}


@pytest.mark.parametrize("seed", SEEDS)
def test_keys_split_fold_in_match_jax(seed: int) -> None:
    k, jk = tr.PRNGKey(seed), jax.random.PRNGKey(seed)
    _same_bits(k, jk)
    _same_bits(tr.key(seed), jax.random.key_data(jax.random.key(seed)))
    _same_bits(tr.split(k), jax.random.split(jk))
    _same_bits(tr.split(k, 5), jax.random.split(jk, 5))
    _same_bits(tr.split(k, (2, 3)), jax.random.split(jk, (2, 3)))
    for d in (0, 1, 12345, 2**31, 2**32 - 1):
        _same_bits(tr.fold_in(k, d), jax.random.fold_in(jk, d))
    _same_bits(tr.fold_in(k, torch.tensor(-3, dtype=torch.int32)), jax.random.fold_in(jk, jnp.int32(-3)))
    # a chain: split, fold, split
    a, b = tr.split(tr.fold_in(tr.split(k)[1], 7), 2)
    ja, jb = jax.random.split(jax.random.fold_in(jax.random.split(jk)[1], 7), 2)
    _same_bits(a, ja)
    _same_bits(b, jb)


@pytest.mark.parametrize("name", sorted(EXACT))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_exact_samplers_match_jax_bit_for_bit(name: str, shape: tuple[int, ...]) -> None:
    ours, theirs = EXACT[name]
    for seed in (0, 2**32 - 1):
        _same_bits(ours(tr.PRNGKey(seed), shape), theirs(jax.random.PRNGKey(seed), shape))


@pytest.mark.parametrize("n", [1, 2, 17, 1625, 1700])  # 1700 > 1625: JAX sorts twice
def test_permutation_matches_jax(n: int) -> None:
    k, jk = tr.PRNGKey(3), jax.random.PRNGKey(3)
    _same_bits(tr.permutation(k, n), jax.random.permutation(jk, n))


def test_permutation_of_arrays_matches_jax() -> None:
    k, jk = tr.PRNGKey(5), jax.random.PRNGKey(5)
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    _same_bits(tr.permutation(k, torch.from_numpy(x)), jax.random.permutation(jk, x))
    _same_bits(tr.permutation(k, torch.from_numpy(x), axis=1), jax.random.permutation(jk, x, axis=1))
    _same_bits(tr.permutation(k, torch.from_numpy(x), axis=1, independent=True),
               jax.random.permutation(jk, x, axis=1, independent=True))


def test_categorical_without_replacement_and_axis_match_jax() -> None:
    k, jk = tr.PRNGKey(9), jax.random.PRNGKey(9)
    logits = np.random.RandomState(0).randn(3, 10).astype(np.float32)
    _same_bits(tr.categorical(k, torch.from_numpy(logits), axis=0), jax.random.categorical(jk, logits, axis=0))
    _same_bits(tr.categorical(k, torch.from_numpy(logits), shape=(4, 3)),
               jax.random.categorical(jk, logits, shape=(4, 3)))
    _same_bits(tr.categorical(k, torch.from_numpy(logits), shape=(5, 3), replace=False),
               jax.random.categorical(jk, logits, shape=(5, 3), replace=False))


def test_float64_uniform_matches_jax_x64() -> None:
    with jax.enable_x64(True):
        jk = jax.random.PRNGKey(11)
        theirs = np.asarray(jax.random.uniform(jk, (101,), jnp.float64))
        tn = np.asarray(jax.random.normal(jk, (101,), jnp.float64))
    assert theirs.dtype == np.float64
    _same_bits(tr.uniform(tr.PRNGKey(11), (101,), torch.float64), theirs)
    np.testing.assert_allclose(tr.normal(tr.PRNGKey(11), (101,), torch.float64).numpy(), tn, rtol=1e-13, atol=1e-15)


# --- the transcendental samplers: XLA's log / log1p / erf_inv / erf reproduced -----------------

TRANSCENDENTAL = {
    "normal": (lambda k, s: tr.normal(k, s), lambda k, s: jax.random.normal(k, s)),
    "truncated_normal": (lambda k, s: tr.truncated_normal(k, -1.3, 2.1, s),
                         lambda k, s: jax.random.truncated_normal(k, -1.3, 2.1, s)),
    "truncated_normal_bf16": (lambda k, s: tr.truncated_normal(k, -0.7, 3.3, s, torch.bfloat16),
                              lambda k, s: jax.random.truncated_normal(k, -0.7, 3.3, s, jnp.bfloat16)),
    "gumbel": (lambda k, s: tr.gumbel(k, s), lambda k, s: jax.random.gumbel(k, s)),
    "gumbel_high": (lambda k, s: tr.gumbel(k, s, mode="high"), lambda k, s: jax.random.gumbel(k, s, mode="high")),
    "gumbel_bf16": (lambda k, s: tr.gumbel(k, s, torch.bfloat16), lambda k, s: jax.random.gumbel(k, s, jnp.bfloat16)),
}


@pytest.mark.parametrize("name", sorted(TRANSCENDENTAL))
def test_transcendental_samplers_match_jax_bit_for_bit(name: str) -> None:
    ours, theirs = TRANSCENDENTAL[name]
    for seed in (0, 1, 2**32 - 1):
        _same_bits(ours(tr.PRNGKey(seed), (20011,)), theirs(jax.random.PRNGKey(seed), (20011,)))


def test_float16_gumbel_is_within_the_documented_tolerance() -> None:
    """float16 `gumbel` (low mode) is the one dtype/sampler pair not reproduced bit for bit."""
    a = tr.gumbel(tr.PRNGKey(0), (4099,), torch.float16).float().numpy()
    b = np.asarray(jax.random.gumbel(jax.random.PRNGKey(0), (4099,), jnp.float16)).astype(np.float32)
    assert np.all(np.abs(a - b) <= 8 * float(np.finfo(np.float16).eps) * np.maximum(1.0, np.abs(b)))


def test_xla_kernels_match_on_a_million_inputs() -> None:
    from tfun.random._samplers import erf_inv_f32, log1p_f32, log_f32

    rng = np.random.RandomState(5)
    u = rng.uniform(-1, 1, 1_000_000).astype(np.float32)
    pos = rng.uniform(np.finfo(np.float32).tiny, 1, 200_000).astype(np.float32)
    _same_bits(erf_inv_f32(torch.from_numpy(u)), jax.jit(jax.lax.erf_inv)(u))
    _same_bits(log1p_f32(torch.from_numpy(u)), jax.jit(jnp.log1p)(u))
    _same_bits(log_f32(torch.from_numpy(pos)), jax.jit(jnp.log)(pos))


def test_erf_matches_xla_bit_for_bit() -> None:
    from tfun.random._samplers import erf_f32

    w = np.random.RandomState(2).uniform(-5, 5, 50000).astype(np.float32)
    _same_bits(erf_f32(torch.from_numpy(w)), jax.jit(jax.lax.erf)(w))


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    shape=st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple),
    data=st.integers(0, 2**32 - 1),
)
def test_hypothesis_keys_bits_uniform(seed: int, shape: tuple[int, ...], data: int) -> None:
    k, jk = tr.fold_in(tr.PRNGKey(seed), data), jax.random.fold_in(jax.random.PRNGKey(seed), data)
    _same_bits(k, jk)
    _same_bits(tr.bits(k, shape), jax.random.bits(jk, shape))
    _same_bits(tr.uniform(k, shape), jax.random.uniform(jk, shape))
    _same_bits(tr.randint(k, shape, -7, 300), jax.random.randint(jk, shape, -7, 300))
    _same_bits(tr.normal(k, shape), jax.random.normal(jk, shape))
    _same_bits(tr.gumbel(k, shape), jax.random.gumbel(jk, shape))


@settings(max_examples=10, deadline=None)
@given(lo=st.integers(-(2**31), 2**31 - 1), span=st.integers(-5, 2**31), seed=st.integers(0, 2**32 - 1))
def test_hypothesis_randint_bounds(lo: int, span: int, seed: int) -> None:
    hi = max(-(2**31), min(2**31 - 1, lo + span))
    _same_bits(tr.randint(tr.PRNGKey(seed), (9,), lo, hi), jax.random.randint(jax.random.PRNGKey(seed), (9,), lo, hi))


# --- transforms -------------------------------------------------------------------------------

def test_vmap_over_a_batch_of_keys() -> None:
    keys = tr.split(tr.PRNGKey(0), 4)
    for f in (lambda k: tr.normal(k, (3,)), lambda k: tr.split(k), lambda k: tr.randint(k, (5,), 0, 9),
              lambda k: tr.permutation(k, 6), lambda k: tr.fold_in(k, 3)):
        assert torch.equal(tfun.vmap(f)(keys), torch.stack([f(k) for k in keys]))


def test_jit_is_one_graph_of_integer_ops_and_matches_eager() -> None:
    k = tr.PRNGKey(4)
    f = tfun.jit(lambda k: (tr.normal(k, (257,)), tr.split(k, 3), tr.randint(k, (9,), 0, 5)), backend="aot_eager")
    for a, b in zip(f(k), (tr.normal(k, (257,)), tr.split(k, 3), tr.randint(k, (9,), 0, 5))):
        assert torch.equal(a, b)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda k: tr.bits(k, (8,)), backend=backend, fullgraph=True)(k)
    ops = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert len(graphs) == 1 and not any("sort" in o or "loop" in o for o in ops), ops


def test_keys_in_scan_and_fori_loop_carries() -> None:
    k = tr.PRNGKey(0)

    def body(carry, _):
        key, sub = tr.split(carry)
        return key, tr.normal(sub, (2,))

    _, ys = tfun.lax.scan(body, k, None, length=5)
    ref, kk = [], k
    for _ in range(5):
        kk, sub = tr.split(kk)
        ref.append(tr.normal(sub, (2,)))
    assert torch.equal(ys, torch.stack(ref))
    jk, jref = jax.random.PRNGKey(0), []
    for _ in range(5):
        jk, sub = jax.random.split(jk)
        jref.append(jax.random.uniform(sub, (2,)))
    out = tfun.lax.fori_loop(
        0, 5, lambda i, c: (tr.split(c[0])[0], c[1].index_copy(0, i.reshape(1), tr.uniform(tr.split(c[0])[1], (2,))[None])),
        (k, torch.zeros(5, 2)),
    )
    _same_bits(out[1], np.stack(jref))


# --- errors -----------------------------------------------------------------------------------

def test_a_float_key_is_refused() -> None:
    with pytest.raises(ArgumentTypeError) as e:
        tr.normal(torch.zeros(2), (3,))
    msg = str(e.value)
    assert msg.splitlines()[0] == "tfun.random.normal: key must be a uint32 tensor of shape (2,) (one Threefry key)."
    assert "key.dtype: got torch.float32, expected torch.uint32" in msg
    assert "tfun.random.PRNGKey" in msg.splitlines()[-1]


def test_a_key_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(ArgumentValueError, match=r"key.shape: got \(3,\), expected \(2,\)"):
        tr.uniform(torch.zeros(3, dtype=torch.uint32))
    with pytest.raises(ArgumentValueError, match="tfun.vmap"):
        tr.split(tr.split(tr.PRNGKey(0), 3))
    with pytest.raises(ArgumentTypeError, match="key: got a int"):
        tr.bits(0)


def test_bad_arguments_are_refused() -> None:
    k = tr.PRNGKey(0)
    with pytest.raises(ArgumentValueError, match=r"data must be an integer in \[0, 2\*\*32\)"):
        tr.fold_in(k, -1)
    with pytest.raises(ArgumentTypeError, match="dtype must be a floating dtype"):
        tr.normal(k, (2,), torch.int32)
    with pytest.raises(ArgumentValueError, match="int32 range"):
        tr.randint(k, (2,), 0, 2**40)
    with pytest.raises(ArgumentValueError, match="must broadcast"):
        tr.uniform(k, (3,), minval=torch.zeros(4))
    with pytest.raises(ArgumentValueError, match="shape must be a tuple"):
        tr.normal(k, (-1,))
    with pytest.raises(TfunError, match="seed must be an integer"):
        tr.PRNGKey(1.5)
