"""zero_nans: NaN becomes zero; dtypes, weak types and the state are stable."""

import equinox as eqx
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import avals, to_np
from hypothesis import given, settings

import optax_ext

nan, inf = float("nan"), float("inf")
FLOATS = ["float16", "bfloat16", "float32", "complex64"]
INTS = ["int8", "int32", "uint8"]


def _reference(x):
    """NaN -> 0 by hand, in numpy; everything else unchanged."""
    x = np.asarray(x)
    if not np.issubdtype(x.dtype, np.inexact):
        return x, False
    return np.where(np.isnan(x), 0, x), bool(np.isnan(x).any())


@settings(max_examples=20)
@given(
    dtype=st.sampled_from(FLOATS + INTS),
    shape=st.sampled_from([(), (1,), (4,), (2, 3)]),
    seed=st.integers(0, 2**16),
    jit=st.booleans(),
)
def test_matches_hand_reference_and_keeps_dtype(dtype, shape, seed, jit):
    rng = np.random.default_rng(seed)
    values = rng.choice([nan, inf, -inf, 0.0, 1.5, -2.0], size=shape)
    if dtype in INTS:
        values = rng.integers(0, 100, size=shape)
    leaf = jnp.asarray(values).astype(dtype)
    updates = {"a": leaf, "b": [jnp.ones(2, jnp.float32)]}
    tx = optax_ext.zero_nans()
    update = jax.jit(tx.update) if jit else tx.update
    out, state = update(updates, tx.init(updates))
    assert avals(out) == avals(updates)
    want, want_nan = _reference(
        to_np(leaf) if dtype != "complex64" else np.asarray(leaf)
    )
    got = to_np(out["a"]) if dtype != "complex64" else np.asarray(out["a"])
    np.testing.assert_array_equal(got, want)
    assert bool(state.found_nan["a"]) == want_nan
    assert not bool(state.found_nan["b"][0])


def test_same_results_as_optax():
    updates = {"w": jnp.array([nan, 1.0, inf]), "b": jnp.array([2.0, nan])}
    ours, theirs = optax_ext.zero_nans(), optax.zero_nans()
    u1, s1 = ours.update(updates, ours.init(updates))
    u2, s2 = theirs.update(updates, theirs.init(updates))
    assert type(s1) is optax.ZeroNansState
    assert jax.tree.structure(s1) == jax.tree.structure(s2)
    for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_weak_type_is_kept():
    tx = optax_ext.zero_nans()
    updates = {"w": jnp.asarray(nan)}  # a weakly typed float
    out, _ = jax.jit(tx.update)(updates, tx.init(updates))
    assert out["w"].weak_type and out["w"] == 0


def test_state_is_bool_even_if_a_wrapper_promoted_it():
    tx = optax_ext.zero_nans()
    updates = {"w": jnp.array([nan, 1.0])}
    promoted = optax.ZeroNansState({"w": jnp.asarray(1, jnp.int32)})
    _, state = jax.jit(tx.update)(updates, promoted)
    assert avals(state) == avals(tx.init(updates))
    assert state.found_nan["w"].dtype == jnp.bool_ and bool(state.found_nan["w"])


def test_none_masked_node_empty_and_integer_leaves():
    tx = optax_ext.zero_nans()
    params = {"a": jnp.zeros(2), "i": jnp.zeros(2, jnp.int32), "m": optax.MaskedNode()}
    updates = {
        "a": jnp.array([nan, 1.0]),
        "i": jnp.array([3, 4], jnp.int32),
        "m": optax.MaskedNode(),
    }
    out, state = tx.update(updates, tx.init(params))
    np.testing.assert_array_equal(out["a"], [0.0, 1.0])
    np.testing.assert_array_equal(out["i"], [3, 4])
    assert out["m"] == optax.MaskedNode()
    assert not bool(state.found_nan["i"])
    for empty in [{}, (), None, []]:
        out, state = tx.update(empty, tx.init(empty))
        assert jax.tree.leaves(out) == []
    with_none = {"a": jnp.array([nan]), "f": None}
    out, state = tx.update(with_none, tx.init(with_none))
    assert out["f"] is None and state.found_nan["f"] is None


def test_equinox_model_state_matches_its_gradients():
    """Non-array leaves get None at init, as eqx.filter_grad gives None for
    them: the state keeps one structure, so it can be a scan carry."""
    model = eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.tanh, key=jax.random.key(0))
    ours, theirs = optax_ext.zero_nans(), optax.zero_nans()
    grads = eqx.filter_grad(lambda m: jnp.sum(m(jnp.ones(2))))(model)

    def scan_with(tx):
        def body(state, _):
            return tx.update(grads, state)[1], None

        return jax.lax.scan(body, tx.init(model), length=3)[0]

    state = scan_with(ours)
    assert jax.tree.structure(state) == jax.tree.structure(ours.update(grads, state)[1])
    with pytest.raises(TypeError):  # optax: the carry changes structure
        scan_with(theirs)


def test_vmap_scan_and_grad():
    tx = optax_ext.zero_nans()
    batch = jnp.array([[nan, 1.0], [2.0, nan], [3.0, 4.0]])
    out, state = jax.vmap(lambda u: tx.update(u, tx.init(u)))(batch)
    np.testing.assert_array_equal(out, [[0, 1], [2, 0], [3, 4]])
    np.testing.assert_array_equal(state.found_nan, [True, True, False])

    def body(carry, u):
        out, carry = tx.update(u, carry)
        return carry, out

    last, outs = jax.lax.scan(body, tx.init(batch[0]), batch)
    np.testing.assert_array_equal(outs, [[0, 1], [2, 0], [3, 4]])
    assert not bool(last.found_nan)

    # The gradient through zero_nans is 1 where the value passed, 0 where zeroed.
    g = jax.grad(lambda x: jnp.sum(tx.update(jnp.log(x), tx.init(x))[0]))(
        jnp.array([-1.0, 2.0])
    )
    np.testing.assert_allclose(g, [0.0, 0.5])


def test_python_scalar_updates():
    tx = optax_ext.zero_nans()
    out, state = tx.update({"a": nan, "b": 2.0}, tx.init({"a": 0.0, "b": 0.0}))
    assert float(out["a"]) == 0.0 and float(out["b"]) == 2.0


def _assert_same_as_optax(ours, theirs):
    """Same tree, avals (dtype, shape, weak type) and values, NaN included."""
    assert jax.tree.structure(ours) == jax.tree.structure(theirs)
    assert avals(ours) == avals(theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


UPDATES = {"w": jnp.array([nan, 1.0, inf]), "s": nan, "i": 3, "k": jnp.arange(2)}


def test_update_ignores_a_none_state_as_optax_does():
    """Issue 13: `zero_nans().update(g, None)` crashed; optax ignores the state."""
    ours = optax_ext.zero_nans().update(UPDATES, None)
    theirs = optax.zero_nans().update(UPDATES, None)
    _assert_same_as_optax(ours, theirs)
    assert bool(ours[1].found_nan["w"]) and bool(ours[1].found_nan["s"])


def test_updates_of_another_tree_than_init_as_optax():
    """Issue 13: updates whose tree differs from init's raised a raw pytree
    error; optax builds the state from the updates."""
    params = {"w": jnp.zeros(3), "extra": jnp.zeros(1)}
    ours, theirs = optax_ext.zero_nans(), optax.zero_nans()
    for updates in [UPDATES, [jnp.array([nan])], jnp.array([1.0, nan])]:
        _assert_same_as_optax(
            ours.update(updates, ours.init(params)),
            theirs.update(updates, theirs.init(params)),
        )
        _assert_same_as_optax(
            jax.jit(ours.update)(updates, ours.init(params)),
            jax.jit(theirs.update)(updates, theirs.init(params)),
        )


@pytest.mark.parametrize("jit", [False, True])
def test_python_scalar_and_integer_leaves_as_optax(jit):
    """Issue 13: Python float and int leaves and integer arrays are accepted
    where optax accepts them, with optax's results: the same updates (dtype
    and weak type included) and the same state, from init on."""
    params = {"w": jnp.zeros(3), "s": 0.5, "i": 2, "k": jnp.zeros(2, jnp.int32)}
    ours, theirs = optax_ext.zero_nans(), optax.zero_nans()
    init = (jax.jit(ours.init) if jit else ours.init)(params)
    _assert_same_as_optax(init, theirs.init(params))
    update = jax.jit(ours.update) if jit else ours.update
    _assert_same_as_optax(
        update(UPDATES, init), theirs.update(UPDATES, theirs.init(params))
    )


def test_state_keeps_init_structure_for_equinox_gradients():
    """Where the updates have None for a numeric leaf the state still records
    False there, so it keeps init's structure (a scan carry)."""
    params = {"w": jnp.zeros(2), "i": jnp.zeros(2, jnp.int32), "f": jax.nn.relu}
    tx = optax_ext.zero_nans()
    state = tx.init(params)
    assert state.found_nan["f"] is None
    _, new_state = tx.update({"w": jnp.array([nan, 0.0]), "i": None, "f": None}, state)
    assert jax.tree.structure(new_state) == jax.tree.structure(state)
    assert avals(new_state) == avals(state)
    assert bool(new_state.found_nan["w"]) and not bool(new_state.found_nan["i"])


X64 = ["float64", "complex128", "int64"]


@settings(max_examples=15)
@given(
    dtype=st.sampled_from(X64),
    shape=st.sampled_from([(), (3,), (2, 2)]),
    seed=st.integers(0, 2**16),
)
def test_x64_dtypes_match_hand_reference_and_optax(dtype, shape, seed):
    """float64, complex128 and int64 under x64 (jax.enable_x64): NaN -> 0 by
    hand in numpy, every other entry bit for bit, and optax's result."""
    rng = np.random.default_rng(seed)
    values = rng.choice([nan, inf, -inf, 0.0, 1e-300, -2.5], size=shape)
    with jax.enable_x64(True):
        if dtype == "int64":
            leaf = jnp.asarray(rng.integers(-(2**40), 2**40, size=shape), dtype)
        elif dtype == "complex128":
            z = values.astype(np.complex128)
            z.imag = rng.choice([nan, inf, 0.0, 3.0], size=shape)
            leaf = jnp.asarray(z, dtype)
        else:
            leaf = jnp.asarray(values, dtype)
        updates = {"a": leaf, "p": 1e-300}  # a Python float: weak float64
        ours = optax_ext.zero_nans()
        out, state = jax.jit(ours.update)(updates, ours.init(updates))
        theirs = optax.zero_nans()
        _assert_same_as_optax(
            (out, state), theirs.update(updates, theirs.init(updates))
        )
        want, want_nan = _reference(np.asarray(leaf))
        assert out["a"].dtype == jnp.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(out["a"]), want)
        assert bool(state.found_nan["a"]) == want_nan
        assert float(out["p"]) == 1e-300 and out["p"].dtype == jnp.float64
