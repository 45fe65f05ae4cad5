"""`MultiSteps`' checks: `prepare_step` builds a step's inputs, `check_state`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import PyTree

from ._accumulate.accumulations import NO_WEIGHT, UNREAD
from ._accumulate.arithmetic import (
    PROMOTION_ERROR,
    holds,
    least_holding,
    rounds_stochastically,
)
from ._accumulate.window import StepInputs, Window
from ._leaves import accumulated, zeros_where_undifferentiated
from ._records import check_state_structure
from ._tree import as_index, check_same_shapes, check_same_structure, describe_value

INT32_MAX = int(jnp.iinfo(jnp.int32).max)
_ACC = "the accumulated gradients in the state"
_NUMERIC = (jnp.integer, jnp.floating, jnp.bool_)

_MSG_EVERY_K = (
    "every_k_schedule must be an int from 1 to 2**31 - 1, got {!r}: it is the number "
    "of mini-steps accumulated per update, counted in the state's int32 mini_step."
)
_MSG_K = (
    "every_k_schedule returned {!r}{}; a window is a whole number of mini-steps "
    "from 1 to 2**31 - 1 (the state counts them in int32). Round the schedule's "
    "output (e.g. `jnp.ceil(k).astype(jnp.int32)`)."
)
_MSG_FIELDS = (
    "{}'s `{}` must be the optax.MultiStepsState that MultiSteps.init returned, "
    "got {}, which has no {}. {}"
)
_HINT_DICT = (
    "It is a dict with the state's fields, as a checkpoint restored without a target "
    "comes back: restore into the abstract state (`jax.eval_shape(opt.init, params)`) "
    "or the state init returns, so that its types come back too."
)
_HINT_STATE = (
    "Pass the whole MultiSteps state (not its inner_opt_state, nor another "
    "optimizer's state)."
)
_MSG_SKIP_FLAG = (
    "should_skip_update_fn {} must return a scalar bool as its first output, got {} "
    "{!r} (dtype {}, shape {}). Reduce it to one decision, e.g. with `jnp.any(...)`."
)
_HINT_PARAMS = (
    "pass the params (or the Equinox model) this MultiSteps's init was given, "
    "or params of the same tree and shapes."
)
_MSG_FLOAT0 = (
    "MultiSteps: the gradient at {} has dtype float0, what "
    "`jax.grad(..., allow_int=True)` gives an integer param: there is nothing to "
    "accumulate or apply there (optax's optimizers and `apply_updates` refuse "
    "float0 too). Pass None there, as `eqx.filter_grad` does, or leave the "
    "integer params out of the differentiated tree."
)


def _rounding_message(where: str, g_dtype: Any, a_dtype: Any, acc_dtype: Any) -> str:
    least = least_holding(g_dtype, a_dtype)
    wide = f"a dtype holding {g_dtype}" if least is None else f"jnp.{least}"
    return (
        f"MultiSteps: the gradient at {where or 'the root'} has dtype {g_dtype}, "
        f"but the accumulator for it in the state (acc_grads{where}) has dtype "
        f"{a_dtype}, which does not hold every {g_dtype} value: accumulating "
        f"would round every gradient to {a_dtype}. The accumulator's dtype is "
        "fixed by init: the least dtype holding the params' dtype and "
        f"accumulator_dtype (here accumulator_dtype={acc_dtype}). Build "
        f"MultiSteps with accumulator_dtype={wide} and init it again, or pass "
        f"gradients of dtype {a_dtype}."
    )


def _caller(method: str) -> tuple[str, str]:
    """How the user called `method`, and its state argument's name."""
    if method == "apply_gradients":
        return "optax_ext.apply_gradients", "opt_state"
    return f"MultiSteps.{method}", "state"


def prepare_step(
    config: Window,
    grads: PyTree,
    state: Any,
    params: PyTree | None,
    extra_args: dict[str, Any],
    method: str,
) -> StepInputs:
    """The inputs of a `MultiSteps` step, checked."""
    devices = config.devices
    devices.check_bound(method)
    extra_args = dict(extra_args)
    weight = extra_args.pop("weight", NO_WEIGHT)
    check_state(state, method)
    weight = config.accumulation.check(state, weight, _caller(method))
    acc = devices.drop_axis(state.acc_grads)
    if params is not None:
        params = accumulated(params)
        _check_params(params, acc)
    given, grads = grads, zeros_where_undifferentiated(grads, params)
    _check_gradients(grads, acc, config.accumulator_dtype, config.accumulation)
    who, state_arg = _caller(method)
    record = check_state_structure(
        config.inner.init,
        state.inner_opt_state,
        acc if params is None else params,
        config.inner_structures,
        is_params=params is not None,
        names=(who, f"{state_arg}.inner_opt_state", "MultiSteps"),
    )
    devices.check_gradients(given, acc)
    gradient_step = jnp.asarray(state.gradient_step)
    k = check_k(config.every_k_schedule(gradient_step), gradient_step)
    skip_fn = config.should_skip_update_fn
    skip, skip_state = skip_decision(skip_fn, grads, gradient_step, params, weight)
    skip = skip if skip_fn is None else devices.agree(skip)
    return StepInputs(grads, params, weight, k, record, extra_args, skip, skip_state)


def check_state(state: Any, method: str, *, counters: bool = True) -> None:
    """Checks `state`'s fields and counters (a step's: arrays)."""
    who, state_arg = _caller(method)
    fields = optax.MultiStepsState._fields
    missing = [f for f in fields if not hasattr(state, f)]
    if missing:
        # A dict with the fields: a checkpoint restored without a target.
        as_dict = isinstance(state, dict) and set(fields) <= set(state)
        hint = _HINT_DICT if as_dict else _HINT_STATE
        got, names = describe_value(state), ", ".join(missing)
        raise TypeError(_MSG_FIELDS.format(who, state_arg, got, names, hint))
    arrays = method in ("update", "apply_gradients")  # a step's
    for name in ("mini_step", "gradient_step") if counters else ():
        value = getattr(state, name)
        try:
            dtype = jnp.result_type(value)
        except TypeError:
            dtype = None
        integer = dtype is not None and jnp.issubdtype(dtype, jnp.integer)
        if not integer or jnp.ndim(value) or (arrays and not hasattr(value, "dtype")):
            what = f"(one state's counter; for a stack of states, jax.vmap {who})"
            if arrays:
                what = "array (as MultiSteps.init builds it)"
            raise TypeError(
                f"{who}'s `{state_arg}.{name}` must be a scalar integer "
                f"{what}, got {describe_value(value)}."
            )


def check_bool(value: Any, must: str) -> bool:
    """`value` as a bool; a `TypeError` saying `must` where it is none."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{must}, got {describe_value(value)}.")
    return bool(value)


def check_stochastic_rounding(value: Any, accumulator_dtype: Any) -> bool:
    """`stochastic_rounding` as a bool, with a bfloat16 `accumulator_dtype`."""
    stochastic = check_bool(value, "stochastic_rounding must be True or False")
    if stochastic and accumulator_dtype != jnp.bfloat16:
        raise ValueError(
            "stochastic_rounding=True rounds the accumulator to bfloat16 without "
            "bias; it needs accumulator_dtype=jnp.bfloat16, got "
            f"accumulator_dtype={accumulator_dtype}."
        )
    return stochastic


def validate_every_k(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
    if callable(every_k_schedule):
        return every_k_schedule
    # A bool is the int it is, as in optax (which tests `isinstance(k, int)`).
    k = as_index(every_k_schedule)
    if isinstance(every_k_schedule, bool):
        k = int(every_k_schedule)
    if k is None:
        raise TypeError(
            "every_k_schedule must be a positive int or a function of the "
            f"gradient step returning one, got {every_k_schedule!r} of type "
            f"{type(every_k_schedule).__name__}."
        )
    if not 1 <= k <= INT32_MAX:
        raise ValueError(_MSG_EVERY_K.format(every_k_schedule))
    return lambda _: k


def check_k(k: Any, gradient_step: jax.Array) -> jax.Array:
    """The window length from `every_k_schedule`, checked where known."""
    try:
        known = np.asarray(k)
    except UNREAD:
        known = None
    kind = known if known is not None else jnp.asarray(k)
    numeric = any(jnp.issubdtype(kind.dtype, t) for t in _NUMERIC)
    if kind.shape != () or not numeric:
        raise TypeError(
            "every_k_schedule must return a scalar int (the number of mini-steps "
            f"in this window), got {describe_value(k)}."
        )
    if kind.dtype == jnp.bool_:
        k = jnp.asarray(k, jnp.int32)
    value = None if known is None else known.item()
    if value is not None and not (1 <= value <= INT32_MAX and value == int(value)):
        try:
            at = f" at gradient step {int(gradient_step)}"
        except jax.errors.ConcretizationTypeError:
            at = ""
        raise ValueError(_MSG_K.format(value, at))
    return jnp.asarray(k)


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
    """`fn(updates, gradient_step, params)` checked (zeros where `weight` is 0)."""
    if fn is None:
        return jnp.zeros((), jnp.bool_), ()
    if weight is not None:
        w = weight if isinstance(weight, jax.Array) else np.asarray(weight)
        zero_weight = w == 0
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
    dtype, shape = getattr(should_skip, "dtype", None), jnp.shape(should_skip)
    if isinstance(should_skip, bool):
        should_skip = jnp.asarray(should_skip)
    elif dtype != jnp.bool_ or shape != ():
        got = type(should_skip).__name__
        raise TypeError(_MSG_SKIP_FLAG.format(name, got, should_skip, dtype, shape))
    return should_skip, skip_state


def _check_params(params: PyTree, acc: PyTree) -> None:
    """Raises where the params do not fit the accumulator."""
    names = dict(expected_name=_ACC, got_name="the params")
    hint = _HINT_PARAMS[0].upper() + _HINT_PARAMS[1:]
    check_same_structure(acc, params, **names, hint=hint)
    check_same_shapes(acc, params, **names, hint=_HINT_PARAMS)


def _check_gradients(grads: PyTree, acc: PyTree, accumulator_dtype: Any, kind) -> None:
    """Raises where the gradients do not fit the accumulator."""
    check_same_structure(acc, grads, expected_name=_ACC, got_name="the updates")
    check_same_shapes(
        acc,
        grads,
        expected_name="the accumulated gradients",
        got_name="the updates",
        hint="the gradients must have the shapes of the params.",
    )
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    for (path, g), a in zip(flat, jax.tree.leaves(acc), strict=True):
        where = jax.tree_util.keystr(path)
        if getattr(g, "dtype", None) == jax.dtypes.float0:
            raise TypeError(_MSG_FLOAT0.format(where))
        g_dtype = jnp.result_type(g)
        try:
            held = jnp.result_type(g, a.dtype) == a.dtype
        except PROMOTION_ERROR:
            held = holds(a.dtype, g_dtype)
        if not (held or kind.stochastic and rounds_stochastically(g_dtype)):
            message = _rounding_message(where, g_dtype, a.dtype, accumulator_dtype)
            raise TypeError(message)
