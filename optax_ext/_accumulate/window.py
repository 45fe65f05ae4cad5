"""A `MultiSteps` mini-step: the gradients folded into the accumulator, then,
where the window ends, the inner optimizer on it in the step's `Form`."""

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

    window_end: jax.Array  # accepted (not skipped) and the window's last
    index: jax.Array  # the state's `mini_step`
    gradient_step: jax.Array  # the state's
    weights: Weights | None  # from the kind's `begin`
    carry: dict  # the kind's state fields after optax's, as the state held them


def _arrays_at(tree: PyTree, like: PyTree) -> PyTree:
    """The leaves of `tree` where `like` holds an array, `None` elsewhere."""
    pick = lambda x, ref: x if eqx.is_array(ref) else None
    return jax.tree.map(pick, tree, like, is_leaf=is_none)


def _inner_step(
    window: Window, inputs: StepInputs, step: MiniStep, fused: bool, dtypes: PyTree
) -> Callable:
    """The inner optimizer on `(acc, (state, held, reports)[, arrays])`, its
    outputs kept (updates zero) where the devices find the window empty."""
    kind, devices, extra = window.accumulation, window.devices, inputs.extra_args

    def run(acc: PyTree, wrapped: tuple, arrays: PyTree = None) -> tuple:
        state, _, reports = wrapped
        grads, keep, new_reports = kind.finalize(acc, reports, step, devices, dtypes)
        if fused:
            params = merge_trainable(inputs.params, arrays)
            fusable = window.fusable_inner  # `with_extra_args` would hide its kind
            out, new = step_and_apply(fusable, grads, state, params, **extra)
            out = _arrays_at(out, arrays)
        else:
            out, new = window.inner.update(grads, state, inputs.params, **extra)
        if keep is None:
            return out, (new, (), new_reports)
        pick = lambda n, o: jnp.where(keep, n, o)
        old = (arrays if fused else jax.tree.map(jnp.zeros_like, out), state, reports)
        out, new, new_reports = jax.tree.map(pick, (out, new, new_reports), old)
        return out, (new, keep, new_reports)

    return run


def run_window(
    window: Window,
    form: Form,
    fused: bool,
    step: MiniStep,
    inputs: StepInputs,
    acc: PyTree,
    inner_state: PyTree,
) -> tuple[PyTree, PyTree, PyTree, dict, jax.Array]:
    """One mini-step: the updates (`fused`: the new params' arrays), the inner
    state, the new accumulator and carry, and whether the inner optimizer ran."""
    kind, devices = window.accumulation, window.devices
    acc, carry = kind.fold(acc, step.carry, inputs, step, devices)
    dtypes = jax.tree.map(jnp.result_type, inputs.grads)
    pred, ready = step.window_end, kind.ready(step)
    decides = ready is not None and devices.per_device  # `finalize`'s `keep`
    if ready is not None and not decides:
        pred = jnp.logical_and(pred, ready)
    # Only the params' arrays go through the conditional.
    arrays = _arrays_at(inputs.params, inputs.params) if fused else None
    reports = kind.reports(carry)
    state_in = (inner_state, jnp.zeros((), jnp.bool_) if decides else (), reports)
    run, on = _inner_step(window, inputs, step, fused, dtypes), window.mechanisms
    out, state_out, count, (cleared,) = update_if(
        pred, run, (acc,), state_in, carry=arrays, form=form, mechanisms=on
    )
    # Cleared only where the inner optimizer reads the accumulator as stored.
    same = jax.tree.map(lambda a, d: jnp.result_type(a) == d, acc, dtypes)
    acc = jax.tree.map(lambda c, a, s: c if s else a, cleared, acc, same)
    inner_state, held, reports = state_out
    return out, inner_state, acc, {**carry, **reports}, held if decides else count == 1
