"""A `MultiSteps` mini-step: the gradients folded into the accumulator,
then, where the window ends, the inner optimizer on the window's
accumulation in the step's `Form` (`update_if`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from .._leaves import is_none
from .._transformations import merge_trainable, step_and_apply
from .accumulations import Plain
from .accumulator import Weights
from .branch import Form, update_if
from .devices import SingleDeviceState
from .xla import Mechanisms


class Window(NamedTuple):
    """A `MultiSteps`' configuration: what its steps are checked and run with."""

    inner: optax.GradientTransformationExtraArgs
    fusable_inner: Any  # the inner optimizer as given, for `step_and_apply`
    devices: SingleDeviceState
    accumulation: Plain  # or another kind (`accumulations`)
    accumulator_dtype: Any  # as given, checked (for the messages)
    inner_structures: dict  # `check_state_structure`'s answers by the avals
    every_k_schedule: Any  # the gradient step to the window's length
    should_skip_update_fn: Any  # `None` or the function, as given
    mechanisms: Mechanisms  # the XLA mechanisms its step runs with


class StepInputs(NamedTuple):
    """A step's inputs, as `prepare_step` builds them."""

    grads: PyTree  # zeros where an accumulated param got `None`
    params: PyTree | None  # `accumulated(params)`, or `None` where not passed
    weight: Any  # the mini-step's `weight=` (`None` without `weighted=True`)
    k: jax.Array  # the length of the window this mini-step is in
    record: Any  # what the inner `init` builds, for `strong_as_recorded`
    extra_args: dict[str, Any]  # for the inner optimizer (`weight=` taken out)
    should_skip: jax.Array  # the skip function's decision, agreed by the devices
    skip_state: PyTree  # what the skip function returned beside it


class MiniStep(NamedTuple):
    """One mini-step's decisions (`MultiSteps._decide`)."""

    window_end: jax.Array
    should_skip: jax.Array
    index: jax.Array  # the state's `mini_step`
    weights: Weights | None  # from the kind's `begin`
    stored: Any  # the kind's running scalars as the state held them


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
    result, state = jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)
    return result, (state, keep)


class _Inner:
    """The inner optimizer on the window's accumulation, as `update_if`
    calls it; where a window may hold nothing and the devices decide it,
    the state travels with whether it held something (`wrap`, `unwrap`)."""

    def __init__(self, window: Window, inputs: StepInputs, step: MiniStep):
        self.window, self.inputs, self.step = window, inputs, step
        self.decides = window.accumulation.may_be_empty and window.devices.per_device
        self.dtypes = jax.tree.map(lambda g: jnp.result_type(g), inputs.grads)

    def wrap(self, state: PyTree) -> PyTree:
        return (state, jnp.zeros((), jnp.bool_)) if self.decides else state

    def unwrap(self, state: PyTree, ran: jax.Array) -> tuple[PyTree, jax.Array]:
        return state if self.decides else (state, ran)

    def _gradients(self, acc: PyTree, state: PyTree) -> tuple[PyTree, Any, Any]:
        w = self.window
        grads, keep = w.accumulation.finalize(acc, self.step, w.devices, self.dtypes)
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
    inputs: StepInputs,
    acc: PyTree,
    inner_state: PyTree,
) -> tuple[PyTree, PyTree, PyTree, jax.Array]:
    """One mini-step. Returns the updates (`fused`: the new params), the
    inner state, the new accumulator and whether the inner optimizer ran."""
    acc = window.accumulation.fold(acc, inputs.grads, step, window.devices)
    inner = _Inner(window, inputs, step)
    pred = step.window_end
    ready = window.accumulation.ready(step)
    if ready is not None and not inner.decides:
        pred = jnp.logical_and(pred, ready)
    params = inputs.params
    # Only the params' arrays go through the conditional.
    arrays = _arrays_at(params, params) if fused else None
    state_in = inner.wrap(inner_state)
    if form is Form.FOLD:
        out = arrays if fused else jax.tree.map(jnp.zeros_like, params)
        state_out, ran = state_in, pred
    else:
        run, on = (inner.apply if fused else inner.update), window.mechanisms
        out, state_out, count, (cleared,) = update_if(
            pred, run, (acc,), state_in, carry=arrays, form=form, mechanisms=on
        )
        # Cleared only where the inner optimizer reads the accumulator as stored.
        same = jax.tree.map(lambda a, d: jnp.result_type(a) == d, acc, inner.dtypes)
        acc = jax.tree.map(lambda c, a, s: c if s else a, cleared, acc, same)
        ran = count == 1
    if fused:
        out = merge_trainable(params, out)
    inner_state, emitted = inner.unwrap(state_out, ran)
    return out, inner_state, acc, emitted
