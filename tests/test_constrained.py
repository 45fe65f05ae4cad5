"""Constrained parameters: the call-time pattern keeps the constraint at every
step; a value derived once at construction breaks it (the PyTorch pitfall)."""

import importlib.util
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_ext

paramax = pytest.importorskip("paramax")

_spec = importlib.util.spec_from_file_location(
    "constrained_parameters",
    pathlib.Path(__file__).parent.parent / "examples" / "constrained_parameters.py",
)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


def test_call_time_constraint_holds_and_recovers_the_truth():
    truth, x, y = ex.synthetic_data(jax.random.key(0))
    model, history = ex.train(ex.Gated(4, jax.random.key(1)), x, y, steps=400)
    assert all(0 < p < 1 and s > 0 for _, p, s in history)
    true = paramax.unwrap(truth)
    assert abs(history[-1][1] - float(true.p)) < 0.02
    assert abs(history[-1][2] - float(true.scale)) < 0.05
    assert history[-1][0] < 1e-2 * history[0][0]


def test_raw_parameters_receive_the_gradient():
    truth, x, y = ex.synthetic_data(jax.random.key(0))
    grads = eqx.filter_grad(ex.loss)(ex.Gated(4, jax.random.key(1)), x, y)
    # d loss / d raw = d loss / d p * sigmoid'(raw): non-zero, on the raw leaf.
    assert float(jnp.abs(grads.p.args[0])) > 0
    assert float(jnp.abs(grads.scale.args[0])) > 0


class Derived(eqx.Module):
    """The pitfall: p computed once from raw in __init__ and stored."""

    raw: jax.Array
    p: jax.Array

    def __init__(self):
        self.raw = jnp.zeros(())
        self.p = jax.nn.sigmoid(self.raw)

    def __call__(self, x):
        return self.p * x


def test_value_derived_at_construction_breaks_the_constraint():
    model = Derived()
    x = jnp.ones(8)
    y = 3.0 * x  # pulls p towards 3, outside (0, 1)
    opt = optax_ext.MultiSteps(optax.adam(0.2), every_k_schedule=2)
    state = opt.init(model)
    ps = []
    for _ in range(40):
        grads = eqx.filter_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        assert float(grads.raw) == 0.0  # raw gets no gradient at all
        updates, state = opt.update(grads, state, model)
        model = eqx.apply_updates(model, updates)
        ps.append(float(model.p))
    assert max(ps) > 1.0  # the optimizer moved p itself: constraint broken
    np.testing.assert_array_equal(model.raw, 0.0)
