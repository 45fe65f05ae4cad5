"""Fit a Gaussian process's kernel inside anything: jit, vmap, an outer grad.

The story this answers (Optuna's GPSampler): the sampler fitted its kernel
by gradient descent, and when the user's objective ran under
`torch.no_grad()` the inner fit silently got no gradients and fell back to
the default kernel parameters. In JAX a gradient is a function transform,
not a global mode, so the fit below computes its own gradients wherever it
is called: plainly, under `jax.jit`, `jax.vmap` over data sets, on inputs
wrapped in `lax.stop_gradient`, or inside an outer `jax.grad`. And it never
falls back silently: the result carries a status to check.

The model: an RBF kernel with lengthscale, variance and noise, each kept
positive by a softplus of an unconstrained parameter (computed at call time,
so the raw parameter is what the optimizer moves). The fit minimises the
negative marginal log-likelihood with L-BFGS, wrapped with `zero_nans`, in a
`lax.while_loop` that stops on a relative tolerance.

    python examples/gp_kernel_fit.py
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

import optax_ext

CONVERGED, MAX_STEPS, NON_FINITE = 0, 1, 2
STATUS = {CONVERGED: "converged", MAX_STEPS: "max_steps", NON_FINITE: "non_finite"}


class FitResult(NamedTuple):
    raw: jax.Array  # unconstrained (lengthscale, variance, noise)
    value: jax.Array  # negative marginal log-likelihood at `raw`
    steps: jax.Array
    status: jax.Array  # CONVERGED, MAX_STEPS or NON_FINITE


def kernel_params(raw: jax.Array) -> jax.Array:
    """(lengthscale, variance, noise), positive by construction."""
    return jax.nn.softplus(raw) + 1e-6


def neg_mll(raw: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
    lengthscale, variance, noise = kernel_params(raw)
    sq_dist = jnp.sum((x[:, None, :] - x[None, :, :]) ** 2, axis=-1)
    k = variance * jnp.exp(-0.5 * sq_dist / lengthscale**2)
    chol = jnp.linalg.cholesky(k + noise * jnp.eye(x.shape[0], dtype=x.dtype))
    alpha = jax.scipy.linalg.cho_solve((chol, True), y)
    return (
        0.5 * y @ alpha
        + jnp.sum(jnp.log(jnp.diag(chol)))
        + 0.5 * x.shape[0] * math.log(2 * math.pi)
    )


def fit(
    x: jax.Array,
    y: jax.Array,
    raw0: jax.Array | None = None,
    *,
    max_steps: int = 200,
    rtol: float = 1e-7,
) -> FitResult:
    """Minimises `neg_mll` over the raw kernel parameters.

    Jit-, vmap- and grad-safe (the data may carry tangents: the fit sees
    them stopped, and an outer `jax.grad` of `neg_mll(fit(...).raw, x, y)`
    gives the envelope-theorem gradient). Stops when the objective changes by
    less than `rtol` relative, after `max_steps`, or at a non-finite value,
    returning the last finite parameters and saying which in `status`.
    """
    x, y = lax.stop_gradient(x), lax.stop_gradient(y)
    raw0 = jnp.zeros(3, x.dtype) if raw0 is None else raw0

    def objective(raw):
        return neg_mll(raw, x, y)

    opt = optax.chain(optax_ext.zero_nans(), optax.lbfgs())
    value_and_grad = optax.value_and_grad_from_state(objective)

    # carry: (raw, state, step, previous value, value, last finite raw, bad)
    def keep_going(carry):
        _, _, step, previous, value, _, bad = carry
        moving = jnp.abs(previous - value) > rtol * (1 + jnp.abs(value))
        return ~bad & (step < max_steps) & ((step < 2) | moving)

    def one_step(carry):
        raw, state, step, _, value, good_raw, _ = carry
        new_value, grad = value_and_grad(raw, state=state)
        finite = jnp.isfinite(new_value) & jnp.all(jnp.isfinite(grad))
        updates, state = opt.update(
            grad, state, raw, value=new_value, grad=grad, value_fn=objective
        )
        good_raw = jnp.where(finite, raw, good_raw)  # the last finite point
        new_raw = optax.apply_updates(raw, updates)
        return new_raw, state, step + 1, value, new_value, good_raw, ~finite

    inf = jnp.asarray(jnp.inf, x.dtype)
    carry = (raw0, opt.init(raw0), 0, inf, inf, raw0, jnp.asarray(False))
    _, _, steps, previous, value, raw, bad = lax.while_loop(keep_going, one_step, carry)
    converged = jnp.abs(previous - value) <= rtol * (1 + jnp.abs(value))
    status = jnp.where(bad, NON_FINITE, jnp.where(converged, CONVERGED, MAX_STEPS))
    return FitResult(raw, objective(raw), steps, status)


def _data(key, n=40):
    kx, ky = jax.random.split(key)
    x = jax.random.uniform(kx, (n, 1), minval=-3.0, maxval=3.0)
    return x, jnp.sin(2.0 * x[:, 0]) + 0.1 * jax.random.normal(ky, (n,))


def main() -> None:
    x, y = _data(jax.random.key(0))
    result = jax.jit(fit)(x, y)
    print(
        f"fit: {STATUS[int(result.status)]} in {int(result.steps)} steps, "
        f"-mll {float(neg_mll(jnp.zeros(3), x, y)):.3f} -> {float(result.value):.3f}, "
        "(lengthscale, variance, noise) = "
        + ", ".join(f"{v:.3f}" for v in kernel_params(result.raw).tolist())
    )
    keys = jax.random.split(jax.random.key(1), 4)
    batch = jax.vmap(_data)(keys)
    results = jax.jit(jax.vmap(fit))(*batch)
    print("vmap over 4 data sets, statuses:", [STATUS[int(s)] for s in results.status])

    def fitted_objective(y):  # differentiate the optimum with respect to the data
        return neg_mll(fit(x, y).raw, x, y)

    grad_y = jax.grad(fitted_objective)(y)
    print(f"d(-mll at the optimum)/dy: norm {float(jnp.linalg.norm(grad_y)):.3f}")
    bad = fit(x, y.at[0].set(jnp.nan))
    print(f"with a NaN target: status {STATUS[int(bad.status)]} (not a silent default)")


if __name__ == "__main__":
    main()
