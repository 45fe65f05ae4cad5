"""A `MultiSteps` mini-step: the gradients folded into the accumulator,
then, where the window ends, the inner optimizer on the window's
accumulation in the step's `Form` (`update_if`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jaxtyping import PyTree

from .._leaves import is_none
from .._transformations import merge_trainable, step_and_apply
from .accumulator import Accumulator, Weights, as_gradient_dtype
from .branch import Form, update_if
from .devices import SingleDeviceState


class Window(NamedTuple):
    """What a `MultiSteps` runs its mini-steps with."""

    inner: optax.GradientTransformationExtraArgs
    fusable_inner: Any  # the inner optimizer as given, for `step_and_apply`
    devices: SingleDeviceState
    accumulator: Accumulator


class MiniStep(NamedTuple):
    """One mini-step's decisions (`MultiSteps._decide`)."""

    window_end: jax.Array
    should_skip: jax.Array
    index: jax.Array  # the state's `mini_step`
    weights: Weights | None
    stored: jax.Array | None  # weighted: the state's running weight


def _keep_or(keep: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)


def _arrays_at(tree: PyTree, like: PyTree) -> PyTree:
    """The leaves of `tree` where `like` holds an array, `None` elsewhere."""
    return jax.tree.map(
        lambda x, ref: x if eqx.is_array(ref) else None, tree, like, is_leaf=is_none
    )


def _kept(keep: jax.Array | None, new: tuple, old: tuple) -> tuple:
    """`new` (result, state) as it is where `keep` is `None`; else each
    leaf selected from `new` or `old` by `keep`, the state paired with it."""
    if keep is None:
        return new
    result, state = _keep_or(keep, new, old)
    return result, (state, keep)


class _Inner:
    """The inner optimizer on the window's accumulation, as `update_if`
    calls it; weighted and per device, the state travels with whether the
    window's weights sum to more than 0 (`wrap`, `unwrap`)."""

    def __init__(self, window: Window, inputs: Any, weights: Weights | None):
        self.window, self.inputs = window, inputs
        self.total = None if weights is None else weights.total
        self.decides = weights is not None and window.devices.per_device
        self.dtypes = jax.tree.map(lambda g: jnp.result_type(g), inputs.grads)

    def wrap(self, state: PyTree) -> PyTree:
        return (state, jnp.zeros((), jnp.bool_)) if self.decides else state

    def unwrap(self, state: PyTree, ran: jax.Array) -> tuple[PyTree, jax.Array]:
        return state if self.decides else (state, ran)

    def _gradients(self, acc: PyTree, state: PyTree) -> tuple[PyTree, Any, Any]:
        w = self.window
        value, keep = w.devices.finish(acc, w.accumulator, self.total)
        grads = jax.tree.map(as_gradient_dtype, value, self.dtypes)
        return grads, keep, state[0] if self.decides else state

    def update(self, acc: PyTree, state: PyTree) -> tuple[PyTree, PyTree]:
        grads, keep, state = self._gradients(acc, state)
        inputs = self.inputs
        out, new = self.window.inner.update(
            grads, state, inputs.params, **inputs.extra_args
        )
        return _kept(keep, (out, new), (jax.tree.map(jnp.zeros_like, out), state))

    def apply(self, acc: PyTree, state: PyTree, arrays: PyTree) -> tuple[PyTree, Any]:
        grads, keep, state = self._gradients(acc, state)
        inputs = self.inputs
        params = merge_trainable(inputs.params, arrays)
        new_params, new = step_and_apply(
            self.window.fusable_inner, grads, state, params, **inputs.extra_args
        )
        return _kept(keep, (_arrays_at(new_params, arrays), new), (arrays, state))


def run_window(
    window: Window,
    form: Form,
    fused: bool,
    step: MiniStep,
    inputs: Any,
    acc: PyTree,
    inner_state: PyTree,
) -> tuple[PyTree, PyTree, PyTree, jax.Array]:
    """One mini-step. Returns the updates (`fused`: the new params), the
    inner state, the new accumulator and whether the inner optimizer ran."""
    fold = window.accumulator.fold

    def one(g: jax.Array, a: jax.Array) -> jax.Array:
        return lax.select(step.should_skip, a, fold(g, a, step.index, step.weights))

    acc = jax.tree.map(one, window.devices.add_axis(inputs.grads), acc)
    inner = _Inner(window, inputs, step.weights)
    pred = step.window_end
    if step.weights is not None and not inner.decides:
        pred = jnp.logical_and(pred, step.weights.total > 0)
    params = inputs.params
    # Only the params' arrays go through the conditional.
    arrays = _arrays_at(params, params) if fused else None
    state_in = inner.wrap(inner_state)
    if form is Form.FOLD:
        result = arrays if fused else jax.tree.map(jnp.zeros_like, params)
        state_out, ran = state_in, pred
    else:
        counter = (jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32))
        run = inner.apply if fused else inner.update
        result, state_out, count, (cleared,) = update_if(
            pred, run, (acc,), state_in, carry=arrays, counter=counter, form=form
        )
        # Cleared only where the inner optimizer reads the accumulator as stored.
        same = jax.tree.map(lambda a, d: jnp.result_type(a) == d, acc, inner.dtypes)
        acc = jax.tree.map(lambda c, a, s: c if s else a, cleared, acc, same)
        ran = count == 1
    if fused:
        result = merge_trainable(params, result)
    inner_state, emitted = inner.unwrap(state_out, ran)
    return result, inner_state, acc, emitted
