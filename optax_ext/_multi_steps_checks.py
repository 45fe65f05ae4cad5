"""`check_step` runs every check of a `MultiSteps` step's inputs, once, at
its entry. What `MultiSteps` checks of its arguments and inputs, each with an
error that names the argument, what was passed and what is expected: the
window length, the state, the skip function's output, and the gradients
against the accumulator (whose dtype rule is `_accumulate.arithmetic`'s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import PyTree

from ._accumulate.arithmetic import PROMOTION_ERROR, holds, least_holding
from ._accumulate.devices import SingleDeviceState
from ._leaves import accumulated, zeros_where_undifferentiated
from ._records import check_state_structure
from ._tree import (
    as_index,
    caller,
    check_same_shapes,
    check_same_structure,
    describe_value,
)
from ._weighted import NO_WEIGHT, check_state_kind, check_weight, check_weight_held

INT32_MAX = int(jnp.iinfo(jnp.int32).max)


class StepInputs(NamedTuple):
    """A step's inputs, checked by `check_step`."""

    grads: PyTree
    """The gradients, with zeros where an accumulated param got `None`."""
    params: PyTree | None
    """`accumulated(params)`, or `None` where none were passed."""
    weight: Any
    """The mini-step's `weight=` (`None` without `weighted=True`)."""
    k: jax.Array
    """The length of the window this mini-step is in."""
    record: Any
    """What the inner `init` builds, for `strong_as_recorded`."""
    extra_args: dict[str, Any]
    """The extra arguments for the inner optimizer (`weight=` taken out)."""


def check_step(
    grads: PyTree,
    state: Any,
    params: PyTree | None,
    extra_args: dict[str, Any],
    *,
    method: str,
    devices: SingleDeviceState,
    weighted: bool,
    accumulator_dtype: Any,
    inner_init: Callable,
    inner_structures: dict,
    every_k_schedule: Callable[[jax.Array], Any],
) -> StepInputs:
    """Every check of a `MultiSteps` step's inputs, in the order a bad input
    is reported: the mesh axis, the state, the weight, the params and the
    gradients against the accumulator, the inner state against what
    `inner_init` builds (from the params where given: an integer leaf's
    accumulator is float32, its param not), the devices' gradients, the
    window length."""
    devices.check_bound(method)
    check_state(state, method)
    extra_args = dict(extra_args)
    weight = check_weight(extra_args.pop("weight", NO_WEIGHT), weighted, method)
    check_state_kind(state, weighted, method)
    if weighted:
        check_weight_held(weight, jnp.result_type(state.acc_weight), method)
    acc = devices.drop_axis(state.acc_grads)
    if params is not None:
        params = accumulated(params)
        check_params(params, acc)
    # Integer and Python-number params hold state (as in optax) but get a
    # `None` gradient from `eqx.filter_grad`: zeros there, `None` back in
    # the updates.
    given = grads
    grads = zeros_where_undifferentiated(grads, params)
    check_gradients(grads, acc, accumulator_dtype)
    record = check_state_structure(
        inner_init,
        state.inner_opt_state,
        acc if params is None else params,
        inner_structures,
        is_params=params is not None,
        who=caller(method)[0],
        state_name=f"{caller(method)[1]}.inner_opt_state",
        owner="MultiSteps",
    )
    devices.check_gradients(given, acc)
    gradient_step = jnp.asarray(state.gradient_step)
    k = check_k(every_k_schedule(gradient_step), gradient_step)
    return StepInputs(grads, params, weight, k, record, extra_args)


def validate_every_k(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
    if callable(every_k_schedule):
        return every_k_schedule
    # A bool is the int it is, as in optax (which tests `isinstance(k, int)`).
    k = (
        int(every_k_schedule)
        if isinstance(every_k_schedule, bool)
        else as_index(every_k_schedule)
    )
    if k is not None:
        if not 1 <= k <= INT32_MAX:
            raise ValueError(
                "every_k_schedule must be an int from 1 to 2**31 - 1, got "
                f"{every_k_schedule!r}: it is the number of mini-steps "
                "accumulated per update, counted in the state's int32 mini_step."
            )
        return lambda _: k
    raise TypeError(
        "every_k_schedule must be a positive int or a function of the gradient "
        f"step returning one, got {every_k_schedule!r} of type "
        f"{type(every_k_schedule).__name__}."
    )


def check_k(k: Any, gradient_step: jax.Array) -> jax.Array:
    """The window length from `every_k_schedule`: a scalar int, a float
    holding a whole number, or a bool (`True` is 1), as optax accepts. A
    value known while tracing (a Python or NumPy number, or a JAX array made
    outside the trace) must be a whole number from 1 to 2**31 - 1, under
    `jit` too; a traced one (under `jit` that includes a `jnp` constant made
    inside the schedule) is handled by `_window_complete`."""
    try:
        known = np.asarray(k)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        known = None
    kind = known if known is not None else jnp.asarray(k)
    numeric = (
        jnp.issubdtype(kind.dtype, jnp.integer)
        or jnp.issubdtype(kind.dtype, jnp.floating)
        or kind.dtype == jnp.bool_
    )
    if kind.shape != () or not numeric:
        raise TypeError(
            "every_k_schedule must return a scalar int (the number of mini-steps "
            f"in this window), got {describe_value(k)}."
        )
    if kind.dtype == jnp.bool_:
        k = jnp.asarray(k, jnp.int32)
    if known is None:
        return jnp.asarray(k)  # traced under jit: see `_window_complete`
    value = known.item()
    if not 1 <= value <= INT32_MAX or value != int(value):
        try:
            at = f" at gradient step {int(gradient_step)}"
        except jax.errors.ConcretizationTypeError:
            at = ""
        raise ValueError(
            f"every_k_schedule returned {value!r}{at}; a window is a whole "
            "number of mini-steps from 1 to 2**31 - 1 (the state counts them in "
            "int32). Round the schedule's output (e.g. "
            "`jnp.ceil(k).astype(jnp.int32)`)."
        )
    return jnp.asarray(k)


def check_state(state: Any, method: str) -> None:
    """Raises a `TypeError` unless `state` is a `MultiStepsState`-like value
    with scalar integer array counters."""
    check_scalar_counters(state, method, arrays=True)


def check_scalar_counters(state: Any, method: str, arrays: bool = False) -> None:
    """`check_state_fields`, and counters that are scalar integers: what
    reading one state's window needs (Python ints too, unless `arrays`, as
    `update` needs them)."""
    check_state_fields(state, method)
    who, state_arg = caller(method)
    for name in ("mini_step", "gradient_step"):
        value = getattr(state, name)
        try:
            dtype = jnp.result_type(value)
        except TypeError:
            dtype = None
        if (
            dtype is None
            or not jnp.issubdtype(dtype, jnp.integer)
            or jnp.ndim(value)
            or (arrays and not hasattr(value, "dtype"))
        ):
            what = (
                "array (as MultiSteps.init builds it)"
                if arrays
                else (f"(one state's counter; for a stack of states, jax.vmap {who})")
            )
            raise TypeError(
                f"{who}'s `{state_arg}.{name}` must be a scalar integer "
                f"{what}, got {describe_value(value)}."
            )


def check_state_fields(state: Any, method: str) -> None:
    """Raises a `TypeError` unless `state` has `MultiStepsState`'s fields
    (counters of any shape: `has_updated` reads a stack of states too)."""
    fields = optax.MultiStepsState._fields
    missing = [f for f in fields if not hasattr(state, f)]
    if missing:
        if isinstance(state, dict) and set(fields) <= set(state):
            # What a checkpoint library gives back restored without a target.
            hint = (
                "It is a dict with the state's fields, as a checkpoint restored "
                "without a target comes back: restore into the abstract state "
                "(`jax.eval_shape(opt.init, params)`) or the state init "
                "returns, so that its types come back too."
            )
        else:
            hint = (
                "Pass the whole MultiSteps state (not its inner_opt_state, nor "
                "another optimizer's state)."
            )
        who, state_arg = caller(method)
        raise TypeError(
            f"{who}'s `{state_arg}` must be the optax.MultiStepsState "
            f"that MultiSteps.init returned, got {describe_value(state)}, which "
            f"has no {', '.join(missing)}. {hint}"
        )


def check_use_grad_mean(use_grad_mean: Any) -> bool:
    if not isinstance(use_grad_mean, bool | np.bool_):
        raise TypeError(
            "use_grad_mean must be True (the window's gradients averaged) or "
            f"False (summed), got {describe_value(use_grad_mean)}."
        )
    return bool(use_grad_mean)


def check_skip_fn(fn: Any) -> Callable | None:
    if fn is not None and not callable(fn):
        raise TypeError(
            "should_skip_update_fn must be None or a function "
            f"(updates, gradient_step, params) -> (bool, state), got {fn!r}."
        )
    return fn


def skip_decision(
    fn: Callable | None,
    updates: PyTree,
    gradient_step: jax.Array,
    params: PyTree,
    weight: Any = None,
) -> tuple[jax.Array, PyTree]:
    """`fn(updates, gradient_step, params)` checked: a scalar bool and the
    skip state; never skip (and an empty state) without `fn`. A mini-step of
    `weight` 0 has its gradient not read (an all-padding micro-batch's NaN):
    `fn` sees zeros there, so such a step counts as accepted and adds
    nothing."""
    if fn is None:
        return jnp.zeros((), jnp.bool_), ()
    if weight is not None:
        zero_weight = (
            weight == 0 if isinstance(weight, jax.Array) else np.asarray(weight) == 0
        )
        updates = jax.tree.map(
            lambda g: jnp.where(zero_weight, jnp.zeros_like(g), g), updates
        )
    out = fn(updates, gradient_step, params)
    name = getattr(fn, "__name__", repr(fn))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise TypeError(
            f"should_skip_update_fn {name} must return a pair (should_skip, "
            f"skip_state), got {type(out).__name__}: {out!r}."
        )
    should_skip, skip_state = out
    dtype = getattr(should_skip, "dtype", None)
    if isinstance(should_skip, bool):
        should_skip = jnp.asarray(should_skip)
    elif dtype != jnp.bool_ or jnp.shape(should_skip) != ():
        raise TypeError(
            f"should_skip_update_fn {name} must return a scalar bool as its first "
            f"output, got {type(should_skip).__name__} {should_skip!r} (dtype "
            f"{dtype}, shape {jnp.shape(should_skip)}). "
            "Reduce it to one decision, e.g. with `jnp.any(...)`."
        )
    return should_skip, skip_state


def check_params(params: PyTree, acc: PyTree) -> None:
    """Raises where the params' optimised leaves do not fit the accumulator
    `init` built from the params: another tree, or other shapes."""
    hint = (
        "pass the params (or the Equinox model) this MultiSteps's init was "
        "given, or params of the same tree and shapes."
    )
    check_same_structure(
        acc,
        params,
        expected_name="the accumulated gradients in the state",
        got_name="the params",
        hint=hint[0].upper() + hint[1:],
    )
    check_same_shapes(
        acc,
        params,
        expected_name="the accumulated gradients in the state",
        got_name="the params",
        hint=hint,
    )


def check_gradients(grads: PyTree, acc: PyTree, accumulator_dtype: Any) -> None:
    """Raises where the gradients do not fit the accumulator: another tree
    or shapes, or a dtype the accumulator's does not hold (accumulating
    would round it)."""
    check_same_structure(
        acc,
        grads,
        expected_name="the accumulated gradients in the state",
        got_name="the updates",
    )
    check_same_shapes(
        acc,
        grads,
        expected_name="the accumulated gradients",
        got_name="the updates",
        hint="the gradients must have the shapes of the params.",
    )
    for (path, g), a in zip(
        jax.tree_util.tree_flatten_with_path(grads)[0],
        jax.tree.leaves(acc),
        strict=True,
    ):
        if getattr(g, "dtype", None) == jax.dtypes.float0:
            raise TypeError(
                f"MultiSteps: the gradient at {jax.tree_util.keystr(path)} has "
                "dtype float0, what `jax.grad(..., allow_int=True)` gives an "
                "integer param: there is nothing to accumulate or apply there "
                "(optax's optimizers and `apply_updates` refuse float0 too). "
                "Pass None there, as `eqx.filter_grad` does, or leave the "
                "integer params out of the differentiated tree."
            )
        g_dtype = jnp.result_type(g)
        try:
            held = jnp.result_type(g, a.dtype) == a.dtype
        except PROMOTION_ERROR:
            held = holds(a.dtype, g_dtype)
        if held:
            continue
        where = jax.tree_util.keystr(path)
        least = least_holding(g_dtype, a.dtype)
        wide = f"a dtype holding {g_dtype}" if least is None else f"jnp.{least}"
        raise TypeError(
            f"MultiSteps: the gradient at {where or 'the root'} has dtype "
            f"{g_dtype}, but the accumulator for it in the state "
            f"(acc_grads{where}) has dtype {a.dtype}, which does not hold "
            f"every {g_dtype} value: accumulating would round every "
            f"gradient to {a.dtype}. The accumulator's dtype is fixed by "
            "init: the least dtype holding the params' dtype and "
            f"accumulator_dtype (here accumulator_dtype="
            f"{accumulator_dtype}). Build MultiSteps with "
            f"accumulator_dtype={wide} and init it again, or pass gradients "
            f"of dtype {a.dtype}."
        )
