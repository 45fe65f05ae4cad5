"""stop_gradient_where: values unchanged, gradients selected away."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import avals

import optax_ext

X = {"a": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array(0.5, jnp.bfloat16)}


def _loss(tree):
    # d/da = 2a, d/db = 3 b**2
    return jnp.sum(tree["a"] ** 2) + (tree["b"].astype(jnp.float32) ** 3)


def _grad(pred, tree=X):
    return jax.grad(lambda t: _loss(optax_ext.stop_gradient_where(pred, t)))(tree)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("frozen", [False, True])
def test_scalar_predicate_blocks_everything(frozen, jit):
    grad = jax.jit(_grad) if jit else _grad
    g = grad(jnp.asarray(frozen))
    scale = 0.0 if frozen else 1.0
    np.testing.assert_allclose(g["a"], scale * 2 * X["a"])
    np.testing.assert_allclose(np.float32(g["b"]), scale * 3 * 0.25)


def test_values_dtypes_and_weak_types_unchanged():
    tree = {"a": jnp.array([jnp.nan, jnp.inf, 1.0]), "w": jnp.asarray(2.0)}
    out = jax.jit(optax_ext.stop_gradient_where)(jnp.asarray(True), tree)
    assert avals(out) == avals(tree)
    np.testing.assert_array_equal(out["a"], tree["a"])


def test_per_leaf_and_elementwise_predicates():
    g = _grad({"a": True, "b": jnp.asarray(False)})
    np.testing.assert_array_equal(g["a"], [0.0, 0.0, 0.0])
    np.testing.assert_allclose(np.float32(g["b"]), 0.75)
    g = _grad({"a": jnp.array([True, False, True]), "b": True})
    np.testing.assert_array_equal(g["a"], [0.0, -4.0, 0.0])
    assert float(g["b"]) == 0.0


def test_vmap_over_the_predicate_and_nested_grad():
    preds = jnp.array([True, False])
    g = jax.vmap(lambda p: _grad(p)["a"])(preds)
    np.testing.assert_array_equal(g, [[0, 0, 0], [2.0, -4.0, 6.0]])

    # Second derivative of x**3 through the call: 6x, or 0 when stopped.
    def f(x, p):
        return optax_ext.stop_gradient_where(p, x) ** 3

    for p, want in [(False, 12.0), (True, 0.0)]:
        assert float(jax.grad(jax.grad(f))(2.0, jnp.asarray(p))) == want


def test_equinox_model_leaves_pass_through():
    model = eqx.nn.MLP(2, 1, 4, 1, activation=jax.nn.tanh, key=jax.random.key(0))
    out = optax_ext.stop_gradient_where(jnp.asarray(True), model)
    assert out.activation is jax.nn.tanh
    grads = eqx.filter_grad(
        lambda m: jnp.sum(optax_ext.stop_gradient_where(True, m)(jnp.ones(2)))
    )(model)
    assert all(float(jnp.abs(g).sum()) == 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    "pred, error",
    [
        (jnp.asarray(1), TypeError),
        (1.0, TypeError),
        ({"a": True}, ValueError),  # not a prefix of X
        (jnp.ones(2, bool), ValueError),  # does not broadcast
        (jnp.ones((2, 3), bool), ValueError),  # would change a leaf's shape
        ((), ValueError),
    ],
    ids=["int", "float", "not-prefix", "shape", "larger", "empty"],
)
def test_bad_predicates(pred, error):
    with pytest.raises(error, match="stop_gradient_where"):
        optax_ext.stop_gradient_where(pred, {"a": jnp.ones(3), "b": X["b"]})
    if error is TypeError:  # checked even where no leaf is floating
        with pytest.raises(error, match="stop_gradient_where"):
            optax_ext.stop_gradient_where(pred, jnp.arange(3))


def test_nothing_leaks_outside_the_call():
    """Only the value passed through the call is stopped: the same input used
    elsewhere in the function keeps its gradient, before and after."""

    def f(x):
        before = jnp.sum(x**2)  # d/dx = 2x
        stopped = jnp.sum(optax_ext.stop_gradient_where(jnp.asarray(True), x) ** 3)
        after = jnp.sum(jnp.sin(x))  # d/dx = cos x
        return before + stopped + after

    x = jnp.array([0.5, -1.0])
    np.testing.assert_allclose(jax.grad(f)(x), 2 * x + jnp.cos(x), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), 2 * x + jnp.cos(x), rtol=1e-6)
