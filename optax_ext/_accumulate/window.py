"""A `MultiSteps` mini-step: the gradients folded into the accumulator,
and at the end of a window the inner optimizer on the window's mean, in
one conditional (`update_if`). A weighted window runs only where its
weights sum to more than 0.

The fold writes the accumulator before the conditional, which reads it
as the window's mean; the accumulator's reset comes after it (it reads the
conditional's counter), so the accumulator, the inner state and the params
stay in their donated buffers on every backend (`docs/design.md`, "One
conditional on every backend").
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib.metadata import version
from typing import Any, cast

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax import lax
from jaxtyping import PyTree

from .._apply import apply_gradients, merge_trainable
from .._leaves import is_none
from .._weighted import Weights
from .arithmetic import fold, fold_weighted
from .branch import order_after, update_if
from .devices import PerDeviceState, SingleDeviceState

_JAXLIB = tuple(int(x) for x in re.findall(r"\d+", version("jaxlib"))[:2])


def folds_in_branch() -> bool:
    """Whether the running branch folds the gradients into the accumulator
    itself, rather than reading the fold written before the conditional:
    only where XLA:CPU before jaxlib 0.11 compiles the step, which keeps a
    fold read by the conditional out of the accumulator's buffer (+1x the
    params for Adam; `docs/design.md`, "One conditional on every
    backend")."""
    return _JAXLIB < (0, 11) and jax.default_backend() == "cpu"


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
    *,
    mean: bool,
    weights: Weights | None,
    devices: SingleDeviceState,
    may_be_first: bool = True,
) -> PyTree:
    """`acc` with `grads` folded in: the running mean (or sum), weighted
    with `weights`. The gradient gets the state's device axis (if any)."""

    def one(g: jax.Array, a: jax.Array) -> jax.Array:
        g = devices.add_axis(g)
        if weights is None:
            return fold(g, a, mini_step, mean, may_be_first=may_be_first)
        return fold_weighted(g, a, *weights.folding)

    return jax.tree.map(one, grads, acc)


def run_window(
    window_end: jax.Array,
    should_skip: jax.Array,
    weights: Weights | None,
    grads: PyTree,
    acc: PyTree,
    mini_step: jax.Array,
    mini_next: jax.Array,
    inner_state: PyTree,
    params: PyTree | None,
    extra_args: dict[str, Any],
    *,
    inner: optax.GradientTransformationExtraArgs,
    fusable_inner: Any,
    devices: SingleDeviceState,
    as_gradients: Callable[[PyTree], PyTree],
    mean: bool,
    may_emit_first: bool,
    fused: bool,
    emit: bool | None = None,
) -> tuple[PyTree, PyTree, PyTree, jax.Array, jax.Array]:
    """One mini-step: `grads` folded into `acc` (kept where
    `should_skip`), then `inner` on the window's mean (`as_gradients` casts
    it to the gradients' dtypes) where the window ends, in one `update_if`,
    then the accumulator cleared where the window ended. Returns the
    updates (or, `fused`, the new params from
    `apply_gradients(fusable_inner, ...)`), the inner state, the
    accumulator, the next `mini_step` (`mini_next`, out of the
    conditional), and whether the inner optimizer ran.

    Weighted, whether the window's weights sum to more than 0 is known
    before the `cond` on one device (in its predicate); per device only
    after the window's all-reduce, so the emitting branch selects the
    updates (zeros), the inner state and the params as they came in where
    the sum over the devices is 0, and hands the decision out with the
    inner state.

    Where `folds_in_branch()`, the conditional reads the gradients and the
    accumulator as they came in and the running branch folds them itself.

    With `emit` (a Python bool: the host knows which step ends a window)
    there is no conditional: `False` only folds, `True` runs the inner
    optimizer on this step's window; a traced reason not to (a skipped
    step, a window of weight 0) then selects what came in. There the
    accumulator's reset is ordered after the results (`order_after`), so it
    is written after they have read it."""
    decided_inside = weights is not None and isinstance(devices, PerDeviceState)
    pred = window_end
    if weights is not None and not decided_inside:
        pred = jnp.logical_and(window_end, weights.total > 0)

    def fold_kept(grads, acc, mini_step):
        # This step's fold, or the accumulator as it came where skipped.
        new = folded(grads, acc, mini_step, mean=mean, weights=weights, devices=devices)
        return jax.tree.map(lambda n, a: lax.select(should_skip, a, n), new, acc)

    new = fold_kept(grads, acc, mini_step)
    # Where the mean is read: the fold before the conditional, or (the
    # whole program where `folds_in_branch()`, and a GPU's conditional) a
    # fold of the running branch's own.
    everywhere = folds_in_branch()
    branch_on_gpu = everywhere or emit is None
    operands = (grads, acc, mini_step, new, weights)

    def fold_in_branch(grads, acc, mini_step, new):
        # Where a window cannot end on its first mini-step, no select of a
        # first value: with it XLA:GPU wrote out a mean read twice.
        return folded(
            grads,
            acc,
            mini_step,
            mean=mean,
            weights=weights,
            devices=devices,
            may_be_first=may_emit_first,
        )

    def read_fold(grads, acc, mini_step, new):
        return new

    def per_platform(on_gpu, elsewhere, *args):
        if on_gpu is elsewhere:
            return elsewhere(*args)
        return lax.platform_dependent(
            *args, cuda=on_gpu, rocm=on_gpu, default=elsewhere
        )

    def window_grads(operands):
        *folding, weights = operands
        acc = per_platform(
            fold_in_branch if branch_on_gpu else read_fold,
            fold_in_branch if everywhere else read_fold,
            *folding,
        )
        if weights is None:
            mean_, keep = devices.window_mean(acc), None
        else:
            mean_, keep = devices.window_weighted_mean(acc, weights.total)
        return as_gradients(mean_), keep

    def inner_update(*args):
        *operands, state = args
        mean_, keep = window_grads(operands)
        if keep is None:
            return inner.update(mean_, state, params, **extra_args)
        state, _ = state
        out, new = inner.update(mean_, state, params, **extra_args)
        out = jax.tree.map(lambda u: jnp.where(keep, u, jnp.zeros_like(u)), out)
        return out, (_keep_or(keep, new, state), keep)

    def inner_apply(*args):
        *operands, state, arrays = args
        mean_, keep = window_grads(operands)
        state = state if keep is None else state[0]
        new_params, new = apply_gradients(
            fusable_inner, mean_, state, merge_trainable(params, arrays), **extra_args
        )
        new_arrays = _arrays_at(new_params, arrays)
        if keep is None:
            return new_arrays, new
        new_arrays = _keep_or(keep, new_arrays, arrays)
        return new_arrays, (_keep_or(keep, new, state), keep)

    state_in = (
        (inner_state, jnp.zeros((), jnp.bool_)) if decided_inside else inner_state
    )
    # The params' arrays go through the conditional; their other leaves (an
    # Equinox model's Python numbers and functions) stay outside.
    arrays = _arrays_at(params, params) if fused else None
    if emit is None:
        # The next counter comes out of the conditional (0 where it ran),
        # and with it the order: the accumulator is cleared after the reads.
        result, state_out, next_mini = update_if(
            pred,
            inner_apply if fused else inner_update,
            operands,
            state_in,
            carry=arrays,
            counter=(jnp.zeros((), mini_next.dtype), mini_next),
        )
        next_mini = cast(jax.Array, next_mini)  # a counter in, a count out
    elif emit:
        if fused:
            result, state_out = inner_apply(*operands, state_in, arrays)
            result = _keep_or(pred, result, arrays)
        else:
            result, state_out = inner_update(*operands, state_in)
            result = jax.tree.map(
                lambda u: jnp.where(pred, u, 0).astype(u.dtype), result
            )
        state_out = _keep_or(pred, state_out, state_in)
        next_mini = mini_next
    else:
        result = arrays if fused else jax.tree.map(jnp.zeros_like, params)
        state_out, next_mini = state_in, mini_next
    reset = jnp.logical_and(window_end, next_mini == 0)
    if emit:
        reset, (result, state_out) = order_after(reset, (result, state_out))
    if fused:
        result = merge_trainable(params, result)
    inner_state, emitted = state_out if decided_inside else (state_out, pred)

    def clear(n):
        return jax.tree.map(lambda n: lax.select(reset, lax.full_like(n, 0), n), n)

    def fold_and_clear(grads, acc, mini_step, new):
        # Where the branch folded: one loop, the fold and the reset.
        return clear(fold_kept(grads, acc, mini_step))

    def clear_fold(grads, acc, mini_step, new):
        return clear(new)

    # Where the branch folds everywhere, `new` is the fold: cleared as is.
    cleared = per_platform(
        clear_fold if everywhere or emit is not None else fold_and_clear,
        clear_fold,
        grads,
        acc,
        mini_step,
        new,
    )
    return result, inner_state, cleared, next_mini, emitted
