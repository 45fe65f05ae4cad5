"""The leaf vocabulary of `_leaves.py` against a table written by hand: which
kinds each leaf is, and what each filter keeps, for a dict and an Equinox
model (the table in docs/design.md, "Which leaves are acted on")."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optax_ext import _leaves

# (name, leaf, kinds it is): d differentiated, o optimised, p passive,
# i integer, w weak number.
LEAVES = [
    ("float32", jnp.ones(2), "do"),
    ("bfloat16", jnp.ones(2, jnp.bfloat16), "do"),
    ("complex64", jnp.ones(2, jnp.complex64), "do"),
    ("weak float", jnp.asarray(1.0), "dow"),
    ("numpy float", np.ones(2, np.float32), "do"),
    ("python float", 0.5, "ow"),
    ("python complex", 1j, "ow"),
    ("int32", jnp.ones(2, jnp.int32), "pi"),
    ("numpy int", np.ones(2, np.int32), "pi"),
    ("python int", 3, "pi"),
    ("bool array", jnp.ones(2, bool), "p"),
    ("python bool", True, "p"),
    ("typed key", jax.random.key(0), "p"),
    ("function", jax.nn.relu, "p"),
]
KINDS = {
    "d": _leaves.is_differentiated,
    "o": _leaves.is_optimised,
    "p": _leaves.is_passive,
    "i": _leaves.is_integer,
    "w": _leaves.is_weak_number,
}


@pytest.mark.parametrize(("name", "leaf", "kinds"), LEAVES, ids=[x[0] for x in LEAVES])
def test_each_leaf_is_of_the_kinds_the_table_says(name, leaf, kinds):
    got = {k for k, is_kind in KINDS.items() if is_kind(leaf)}
    assert got == set(kinds), name


def test_none_is_of_no_kind():
    assert not any(is_kind(None) for is_kind in KINDS.values())


class _Model(eqx.Module):
    w: jax.Array
    p: float
    steps: jax.Array
    act: object


def _kept(tree):
    """The paths of the leaves a filter kept (not `None`)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {jax.tree_util.keystr(path) for path, _ in leaves}


def test_filters_keep_what_the_table_says():
    tree = {name: leaf for name, leaf, _ in LEAVES}
    by_kind = {k: {f"['{n}']" for n, _, kinds in LEAVES if k in kinds} for k in "doi"}
    assert _kept(_leaves.differentiated(tree)) == by_kind["d"]
    assert _kept(_leaves.optimised(tree)) == by_kind["o"]
    assert _kept(_leaves.inner_params(tree)) == by_kind["o"]
    # Outside an Equinox model, integer leaves are accumulated too (optax).
    assert _kept(_leaves.accumulated(tree)) == by_kind["o"] | by_kind["i"]


def test_accumulated_inside_a_model_keeps_its_optimised_leaves_only():
    model = _Model(jnp.ones(2), 0.5, jnp.zeros((), jnp.int32), jax.nn.relu)
    assert _kept(_leaves.accumulated(model)) == {".w", ".p"}
    assert _kept(_leaves.accumulated({"m": model, "n": 3})) == {
        "['m'].w",
        "['m'].p",
        "['n']",
    }


def test_inner_params_makes_weak_numbers_strong():
    tree = {"s": 0.5, "a": jnp.asarray(2.0), "x": jnp.ones(2, jnp.bfloat16)}
    out = _leaves.inner_params(tree)
    for name in ("s", "a"):
        assert out[name].dtype == jnp.result_type(float)
        assert not out[name].weak_type
    assert out["x"] is tree["x"]
    assert float(out["s"]) == 0.5 and float(out["a"]) == 2.0


def test_updates_for_inner_and_back_round_trip():
    params = {"w": jnp.ones(2), "s": 0.5, "n": jnp.ones(2, jnp.int32)}
    updates = {"w": jnp.full(2, 3.0), "s": None, "n": jnp.full(2, 7.0)}
    filled = _leaves.updates_for_inner(updates, params)
    assert filled["n"] is None  # no state for a passive param
    assert filled["s"].shape == () and float(filled["s"]) == 0.0
    assert not filled["s"].weak_type
    new = {"w": jnp.full(2, -1.0), "s": jnp.asarray(-2.0), "n": None}
    back = _leaves.updates_for_params(updates, new, params)
    assert back["s"] is None  # given None, None back
    np.testing.assert_array_equal(back["n"], np.zeros(2))  # passive: zero
    np.testing.assert_array_equal(back["w"], np.full(2, -1.0))


def test_zeros_where_undifferentiated_and_restore_none_round_trip():
    params = _leaves.accumulated({"w": jnp.ones(2), "n": jnp.ones(2, jnp.int32)})
    updates = {"w": None, "n": None}
    filled = _leaves.zeros_where_undifferentiated(updates, params)
    assert filled["w"] is None  # a differentiated param's None stays
    np.testing.assert_array_equal(filled["n"], np.zeros(2, np.int32))
    back = _leaves.restore_none(updates, {"w": None, "n": jnp.ones(2)})
    assert back == {"w": None, "n": None}
