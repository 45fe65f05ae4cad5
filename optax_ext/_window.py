"""The end of a `MultiSteps` window: the inner optimizer on the window's
mean, in the one conditional (`update_if`), the accumulator cleared after
it. A weighted window runs only where its weights sum to more than 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from ._apply import apply_gradients
from ._conditional import update_if
from ._devices import PerDeviceState, SingleDeviceState
from ._weighted import Weights


def _keep_or(keep: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)


def run_window(
    window_end: jax.Array,
    weights: Weights | None,
    acc: PyTree,
    inner_state: PyTree,
    params: PyTree | None,
    extra_args: dict[str, Any],
    *,
    inner: optax.GradientTransformationExtraArgs,
    fusable_inner: Any,
    devices: SingleDeviceState,
    as_gradients: Callable[[PyTree], PyTree],
    fused: bool,
) -> tuple[PyTree, PyTree, PyTree, jax.Array]:
    """`inner` on the window's mean (`as_gradients` casts it to the
    gradients' dtypes) where the window ends, in the one `update_if`, the
    accumulator `acc` cleared after it. Returns the updates (or, `fused`,
    the new params from `apply_gradients(fusable_inner, ...)`), the inner
    state, the accumulator, and whether the inner optimizer ran.

    Only the inner optimizer sits inside the `cond`; the accumulator goes in
    and comes back out, cleared in the emitting branch, as it came in from
    the other: both keep it in the donated buffer, and a state saved after
    an emitting step holds zeros there, as optax's does (docs/design.md).

    Weighted, whether the window's weights sum to more than 0 is known
    before the `cond` on one device (in its predicate); per device only
    after the window's all-reduce, so the emitting branch selects the
    updates (zeros), the inner state and the params as they came in where
    the sum over the devices is 0, and hands the decision out with the
    inner state."""
    decided_inside = weights is not None and isinstance(devices, PerDeviceState)
    pred = window_end
    if weights is not None and not decided_inside:
        pred = jnp.logical_and(window_end, weights.total > 0)

    def window_grads(acc):
        if weights is None:
            mean, keep = devices.window_mean(acc), None
        else:
            mean, keep = devices.window_weighted_mean(acc, weights.total)
        return as_gradients(mean), keep

    def inner_update(acc, state):
        grads, keep = window_grads(acc)
        if keep is None:
            return inner.update(grads, state, params, **extra_args)
        state, _ = state
        out, new = inner.update(grads, state, params, **extra_args)
        out = jax.tree.map(lambda u: jnp.where(keep, u, jnp.zeros_like(u)), out)
        return out, (_keep_or(keep, new, state), keep)

    def inner_apply(acc, state, params):
        grads, keep = window_grads(acc)
        state = state if keep is None else state[0]
        new_params, new = apply_gradients(
            fusable_inner, grads, state, params, **extra_args
        )
        if keep is None:
            return new_params, new
        return _keep_or(keep, new_params, params), (_keep_or(keep, new, state), keep)

    state_in = (
        (inner_state, jnp.zeros((), jnp.bool_)) if decided_inside else inner_state
    )
    result, state_out, acc = update_if(
        pred,
        inner_apply if fused else inner_update,
        acc,
        state_in,
        clear_grads=True,
        carry=params if fused else None,
    )
    inner_state, emitted = state_out if decided_inside else (state_out, pred)
    return result, inner_state, acc, emitted
