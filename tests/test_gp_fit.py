"""The GP kernel fit of examples/gp_kernel_fit.py in every context, against
scipy's L-BFGS-B on the same objective and closed-form gradients."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.optimize

_spec = importlib.util.spec_from_file_location(
    "gp_kernel_fit",
    pathlib.Path(__file__).parent.parent / "examples" / "gp_kernel_fit.py",
)
gp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gp)

X, Y = gp._data(jax.random.key(0))


def _scipy_fit(x, y):
    f = jax.jit(lambda r: gp.neg_mll(r, x, y))
    g = jax.jit(jax.grad(lambda r: gp.neg_mll(r, x, y)))
    res = scipy.optimize.minimize(
        lambda r: float(f(jnp.asarray(r, jnp.float32))),
        np.zeros(3),
        jac=lambda r: np.asarray(g(jnp.asarray(r, jnp.float32)), np.float64),
        method="L-BFGS-B",
    )
    return res.x, res.fun


@pytest.fixture(scope="module")
def reference():
    return _scipy_fit(X, Y)


def _check(result, reference):
    raw, value = reference
    assert int(result.status) == gp.CONVERGED
    assert float(result.value) <= value + 1e-3
    np.testing.assert_allclose(result.raw, raw, atol=2e-2)
    assert float(jnp.abs(result.raw).max()) > 0.1  # moved away from the start


@pytest.mark.parametrize(
    "context",
    ["plain", "jit", "stop_gradient"],
)
def test_fit_in_every_context_matches_scipy(context, reference):
    if context == "plain":
        result = gp.fit(X, Y)
    elif context == "jit":
        result = jax.jit(gp.fit)(X, Y)
    else:
        result = jax.jit(gp.fit)(jax.lax.stop_gradient(X), jax.lax.stop_gradient(Y))
    _check(result, reference)


def test_fit_under_vmap_matches_separate_fits():
    xs, ys = jax.vmap(gp._data)(jax.random.split(jax.random.key(3), 3))
    batched = jax.jit(jax.vmap(gp.fit))(xs, ys)
    for i in range(3):
        member = jax.tree.map(lambda a, i=i: a[i], batched)
        _check(member, _scipy_fit(xs[i], ys[i]))


def test_outer_grad_is_the_envelope_gradient():
    """d/dy of -mll at the optimum is K(r*)^-1 y (the fit's own dependence on
    y contributes nothing at a minimum): a closed form in float64, and the
    finite difference of the refitted optimum value (which holds only if the
    fit really reached the optimum)."""

    def fitted_objective(y):
        return gp.neg_mll(gp.fit(X, y).raw, X, y)

    grad = jax.jit(jax.grad(fitted_objective))(Y)
    eps = 1e-2
    for i in (0, 7):
        up = float(gp.fit(X, Y.at[i].add(eps)).value)
        down = float(gp.fit(X, Y.at[i].add(-eps)).value)
        np.testing.assert_allclose(
            grad[i], (up - down) / (2 * eps), rtol=2e-2, atol=2e-2
        )
    raw = np.asarray(gp.fit(X, Y).raw, np.float64)
    lengthscale, variance, noise = np.logaddexp(0, raw) + 1e-6
    x = np.asarray(X, np.float64)
    k = variance * np.exp(-0.5 * (x - x.T) ** 2 / lengthscale**2) + noise * np.eye(
        len(x)
    )
    np.testing.assert_allclose(
        grad, np.linalg.solve(k, np.asarray(Y, np.float64)), rtol=2e-3, atol=2e-3
    )


def test_no_silent_fallback():
    bad = gp.fit(X, Y.at[0].set(jnp.nan))
    assert int(bad.status) == gp.NON_FINITE
    short = gp.fit(X, Y, max_steps=2)
    assert int(short.status) == gp.MAX_STEPS and int(short.steps) == 2
