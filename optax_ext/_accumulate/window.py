"""A `MultiSteps` mini-step: the gradients folded into the accumulator,
then, where the window ends, the inner optimizer on the window's
accumulation in the step's `Form` (`update_if`)."""

from __future__ import annotations

from collections.abc import Callable
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
    gradient_step: jax.Array  # the state's
    weights: Weights | None  # from the kind's `begin`
    carry: dict  # the kind's state fields after optax's, as the state held them


def _arrays_at(tree: PyTree, like: PyTree) -> PyTree:
    """The leaves of `tree` where `like` holds an array, `None` elsewhere."""
    return jax.tree.map(
        lambda x, ref: x if eqx.is_array(ref) else None, tree, like, is_leaf=is_none
    )


class _Inner:
    """The inner optimizer on the window's accumulation, as `update_if`
    calls it. Its state travels with the kind's `reports` and, where a
    window may hold nothing and the devices decide it, with whether it
    held something (`wrap`, `unwrap`)."""

    def __init__(self, window: Window, inputs: StepInputs, step: MiniStep):
        self.window, self.inputs, self.step = window, inputs, step
        self.decides = window.accumulation.may_be_empty and window.devices.per_device
        self.dtypes = jax.tree.map(lambda g: jnp.result_type(g), inputs.grads)

    def wrap(self, state: PyTree, reports: dict) -> tuple:
        return state, jnp.zeros((), jnp.bool_) if self.decides else (), reports

    def unwrap(self, wrapped: tuple, ran: jax.Array) -> tuple:
        state, flag, reports = wrapped
        return state, flag if self.decides else ran, reports

    def _run(self, acc: PyTree, wrapped: tuple, inner: Callable, old: Callable):
        """`inner(grads, state)` on the window's gradients; where the devices
        decide, each output selected from `old(out)` where it held nothing."""
        w, (state, _, reports) = self.window, wrapped
        args = (acc, reports, self.step, w.devices, self.dtypes)
        grads, keep, new_reports = w.accumulation.finalize(*args)
        out, new = inner(grads, state)
        if keep is None:
            return out, (new, (), new_reports)
        new, old = (out, new, new_reports), (old(out), state, reports)
        out, new, new_reports = jax.tree.map(
            lambda n, o: jnp.where(keep, n, o), new, old
        )
        return out, (new, keep, new_reports)

    def update(self, acc: PyTree, wrapped: tuple) -> tuple[PyTree, PyTree]:
        inputs, inner = self.inputs, self.window.inner

        def run(grads: PyTree, state: PyTree) -> tuple:
            return inner.update(grads, state, inputs.params, **inputs.extra_args)

        zeros = lambda out: jax.tree.map(jnp.zeros_like, out)  # noqa: E731
        return self._run(acc, wrapped, run, zeros)

    def apply(self, acc: PyTree, wrapped: tuple, arrays: PyTree) -> tuple:
        inputs = self.inputs
        params = merge_trainable(inputs.params, arrays)

        def run(grads: PyTree, state: PyTree) -> tuple:
            new_params, new = step_and_apply(
                self.window.fusable_inner, grads, state, params, **inputs.extra_args
            )
            return _arrays_at(new_params, arrays), new

        return self._run(acc, wrapped, run, lambda out: arrays)


def run_window(
    window: Window,
    form: Form,
    fused: bool,
    step: MiniStep,
    inputs: StepInputs,
    acc: PyTree,
    inner_state: PyTree,
) -> tuple[PyTree, PyTree, PyTree, dict, jax.Array]:
    """One mini-step. Returns the updates (`fused`: the new params), the
    inner state, the new accumulator and carry, and whether the inner
    optimizer ran."""
    kind = window.accumulation
    acc, carry = kind.fold(acc, step.carry, inputs, step, window.devices)
    inner = _Inner(window, inputs, step)
    pred = step.window_end
    ready = kind.ready(step)
    if ready is not None and not inner.decides:
        pred = jnp.logical_and(pred, ready)
    params = inputs.params
    # Only the params' arrays go through the conditional.
    arrays = _arrays_at(params, params) if fused else None
    state_in = inner.wrap(inner_state, kind.reports(carry))
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
    inner_state, emitted, reports = inner.unwrap(state_out, ran)
    return out, inner_state, acc, {**carry, **reports}, emitted
