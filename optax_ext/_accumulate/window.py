"""A `MultiSteps` mini-step: the gradients folded into the accumulator,
then, where the window ends, the inner optimizer on the accumulator's mean
in one conditional (`update_if`). A weighted window runs only where its
weights sum to more than 0.

The fold comes first and is the new accumulator: the train step's backward
pass can fold each gradient as it produces it and free it. The
conditional only reads the accumulator; it writes the inner state and
(fused) the params. Nothing clears the accumulator: the next window's
first fold overwrites it (`docs/design.md`, "The plain form").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jaxtyping import PyTree

from .._leaves import is_none
from .._transformations import merge_trainable, step_and_apply
from .._weighted import Weights
from .arithmetic import as_gradient_dtype, fold, fold_weighted
from .branch import conform_state, select_results, update_if
from .devices import PerDeviceState, SingleDeviceState


def _keep_or(keep: jax.Array, new: PyTree, old: PyTree) -> PyTree:
    return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)


def _arrays_at(tree: PyTree, like: PyTree) -> PyTree:
    """The leaves of `tree` where `like` holds an array, `None` elsewhere."""
    return jax.tree.map(
        lambda x, ref: x if eqx.is_array(ref) else None, tree, like, is_leaf=is_none
    )


def folded(
    grads: PyTree,
    acc: PyTree,
    mini_step: jax.Array,
    should_skip: jax.Array,
    *,
    mean: bool,
    weights: Weights | None,
    devices: SingleDeviceState,
) -> PyTree:
    """`acc` with `grads` folded in: the running mean (or sum), weighted
    with `weights`; the window's first fold overwrites what `acc` held; a
    skipped step keeps `acc`. The gradient gets the state's device axis
    (if any)."""

    def one(g: jax.Array, a: jax.Array) -> jax.Array:
        if weights is None:
            new = fold(g, a, mini_step, mean)
        else:
            new = fold_weighted(g, a, *weights.folding)
        return lax.select(should_skip, a, new)

    return jax.tree.map(one, devices.add_axis(grads), acc)


def _inner_steps(
    weights: Weights | None,
    devices: SingleDeviceState,
    grad_dtypes: PyTree,
    inner: optax.GradientTransformationExtraArgs,
    fusable_inner: Any,
    params: PyTree | None,
    extra_args: dict[str, Any],
) -> tuple[Callable, Callable]:
    """The inner optimizer on the accumulator's window mean: `update(acc,
    state)` returns the updates and the new state, `apply(acc, state,
    arrays)` the new params' arrays and the new state. Per device and
    weighted, the state is paired with whether the window's weights sum
    to more than 0, and where they do not the updates are zeros and the
    state (and the params) as they came in."""

    def as_gradients(mean_):
        return jax.tree.map(as_gradient_dtype, mean_, grad_dtypes)

    def window_grads(acc):
        if weights is None:
            return as_gradients(devices.window_mean(acc)), None
        mean_, keep = devices.window_weighted_mean(acc, weights.total)
        return as_gradients(mean_), keep

    def inner_update(acc, state):
        mean_, keep = window_grads(acc)
        if keep is None:
            return inner.update(mean_, state, params, **extra_args)
        state, _ = state
        out, new = inner.update(mean_, state, params, **extra_args)
        out = jax.tree.map(lambda u: jnp.where(keep, u, jnp.zeros_like(u)), out)
        return out, (_keep_or(keep, new, state), keep)

    def inner_apply(acc, state, arrays):
        mean_, keep = window_grads(acc)
        state = state if keep is None else state[0]
        new_params, new = step_and_apply(
            fusable_inner, mean_, state, merge_trainable(params, arrays), **extra_args
        )
        new_arrays = _arrays_at(new_params, arrays)
        if keep is None:
            return new_arrays, new
        new_arrays = _keep_or(keep, new_arrays, arrays)
        return new_arrays, (_keep_or(keep, new, state), keep)

    return inner_update, inner_apply


def _in_conditional(
    pred: jax.Array,
    step: Callable,
    acc: PyTree,
    state: PyTree,
    carry: PyTree,
    selected_on: Callable[[str], bool] | None = None,
) -> tuple[PyTree, PyTree, jax.Array]:
    """`step` in `update_if` (selected instead on the platforms
    `selected_on` names), and whether it ran as the branches say: a value
    read after the conditional keeps its barrier, and so the conditional,
    alive in XLA."""
    result, state_out, ran = update_if(
        pred,
        step,
        (acc,),
        state,
        carry=carry,
        counter=(jnp.ones((), jnp.int32), jnp.zeros((), jnp.int32)),
        selected_on=selected_on,
    )
    return result, state_out, ran == 1


def _selected(
    pred: jax.Array, step: Callable, acc: PyTree, state: PyTree, carry: PyTree
) -> tuple[PyTree, PyTree, jax.Array]:
    """`step` run unconditionally, its results where `pred`, zero updates
    (or the carry) and `state` as they came in elsewhere."""
    carried = carry is not None
    result, state_out = step(acc, state, carry) if carried else step(acc, state)
    new = (result, conform_state(state_out, state))
    return (*select_results(pred, new, (carry, state), carried), pred)


def drop_in_in_conditional(platform: str) -> bool:
    """Whether the drop-in `update` runs the inner optimizer in a
    conditional on `platform` (`"cpu"`, `"cuda"`, `"rocm"`, `"tpu"`), rather
    than on every step with its results selected, as optax.MultiSteps does.
    Only XLA:CPU: on GPUs and TPUs a conditional that returns the updates
    holds them in a buffer of their own, +0.74x the params over
    optax.MultiSteps' train step on an H200 and +1.03x on a TPU v5e
    (`docs/design.md`, "The plain form")."""
    return platform == "cpu"


def run_window(
    window_end: jax.Array,
    should_skip: jax.Array,
    weights: Weights | None,
    grads: PyTree,
    acc: PyTree,
    mini_step: jax.Array,
    inner_state: PyTree,
    params: PyTree | None,
    extra_args: dict[str, Any],
    *,
    inner: optax.GradientTransformationExtraArgs,
    fusable_inner: Any,
    devices: SingleDeviceState,
    grad_dtypes: PyTree,
    mean: bool,
    fused: bool,
    emit: bool | None = None,
) -> tuple[PyTree, PyTree, PyTree, jax.Array]:
    """One mini-step: `grads` folded into `acc` (kept where
    `should_skip`), then `inner` on the window's mean (cast to
    `grad_dtypes`, the gradients' dtypes) where the window ends. Returns the
    updates (or, `fused`, the new params from
    `step_and_apply(fusable_inner, ...)`), the inner state, the new
    accumulator and whether the inner optimizer ran.

    The inner optimizer runs in one `update_if`, but for the drop-in on
    GPUs and TPUs (`drop_in_in_conditional`; not per device, where the
    conditional holds the window's all-reduce) and with `emit=True` (the
    host knows the window ends): there it runs on every step, and a
    traced reason not to (a window that goes on, a skipped step, a window
    of weight 0) selects what came in, as optax.MultiSteps does.
    `emit=False` only folds.

    Weighted, whether the window's weights sum to more than 0 is known
    before the conditional on one device; per device only after the
    window's all-reduce, so the emitting branch selects the updates
    (zeros), the inner state and the params as they came in where the sum
    over the devices is 0, and hands the decision out with the inner
    state."""
    decided_inside = weights is not None and isinstance(devices, PerDeviceState)
    pred = window_end
    if weights is not None and not decided_inside:
        pred = jnp.logical_and(window_end, weights.total > 0)
    acc = folded(
        grads,
        acc,
        mini_step,
        should_skip,
        mean=mean,
        weights=weights,
        devices=devices,
    )

    inner_update, inner_apply = _inner_steps(
        weights, devices, grad_dtypes, inner, fusable_inner, params, extra_args
    )
    state_in = (
        (inner_state, jnp.zeros((), jnp.bool_)) if decided_inside else inner_state
    )
    # The params' arrays go through the conditional; their other leaves (an
    # Equinox model's Python numbers and functions) stay outside.
    arrays = _arrays_at(params, params) if fused else None

    args = (pred, inner_apply if fused else inner_update, acc, state_in, arrays)
    if emit is False:
        result = arrays if fused else jax.tree.map(jnp.zeros_like, params)
        state_out, ran = state_in, pred
    elif emit:
        result, state_out, ran = _selected(*args)
    elif fused or isinstance(devices, PerDeviceState):
        # Per device the window's all-reduce stays in the conditional.
        result, state_out, ran = _in_conditional(*args)
    else:
        result, state_out, ran = _in_conditional(
            *args, selected_on=lambda p: not drop_in_in_conditional(p)
        )
    if fused:
        result = merge_trainable(params, result)
    inner_state, emitted = state_out if decided_inside else (state_out, ran)
    return result, inner_state, acc, emitted
