"""`MultiSteps`' checks: `prepare_step` builds a step's inputs, `check_state`."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from ._accumulate import arithmetic
from ._accumulate.accumulations import NO_WEIGHT, OPTAX_FIELDS
from ._accumulate.window import StepInputs, Window
from ._leaves import accumulated, zeros_where_undifferentiated
from ._records import check_state_structure
from ._tree import as_index, check_same_shapes, check_same_structure, describe_value

_ACC = "the accumulated gradients in the state"
_NUMERIC = (jnp.integer, jnp.floating, jnp.bool_)
_HINT_DICT = (
    "It is a dict of the state's fields, as a checkpoint restored without a target: "
    "restore into `jax.eval_shape(opt.init, params)` (or init's state) for its types."
)
_HINT_STATE = "Pass MultiSteps's state, not its inner_opt_state or another optimizer's."
_HINT_PARAMS = (
    "Pass the params (or Equinox model) this MultiSteps's init was given, or params "
    "of the same tree and shapes."
)


def prepare_step(
    config: Window, grads: PyTree, state: Any, params: PyTree, extra: dict, method: str
) -> StepInputs:
    """A step's checked inputs (`params` may be `None`; `extra` loses its `weight=`)."""
    devices = config.devices
    devices.check_bound(method)
    who, state_arg = check_state(state, method)
    weight = extra.pop("weight", NO_WEIGHT)
    weight = config.accumulation.check(state, weight, who, state_arg)
    acc = devices.drop_axis(state.acc_grads)
    if params is not None:
        params = accumulated(params)
        names = dict(expected_name=_ACC, got_name="the params", hint=_HINT_PARAMS)
        check_same_shapes(acc, params, **names)
    given, grads = grads, zeros_where_undifferentiated(grads, params)
    _check_gradients(grads, acc, config)
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
    return StepInputs(grads, params, weight, k, record, extra, skip, skip_state)


def check_state(state: Any, method: str, *, counters: bool = True) -> tuple[str, str]:
    """Checks `state`'s fields and counters; returns the call's and state's names."""
    who, state_arg = f"MultiSteps.{method}", "state"
    if method == "apply_gradients":
        who, state_arg = "optax_ext.apply_gradients", "opt_state"
    missing = [f for f in OPTAX_FIELDS if not hasattr(state, f)]
    if missing:
        as_dict = isinstance(state, dict) and set(OPTAX_FIELDS) <= set(state)
        raise TypeError(
            f"{who}'s `{state_arg}` must be the optax.MultiStepsState that "
            f"MultiSteps.init returned, got {describe_value(state)}, which has no "
            f"{', '.join(missing)}. {_HINT_DICT if as_dict else _HINT_STATE}"
        )
    arrays = method in ("update", "apply_gradients")  # a step's
    for name in ("mini_step", "gradient_step") if counters else ():
        value = getattr(state, name)
        integer = jnp.issubdtype(getattr(value, "dtype", type(value)), jnp.integer)
        if not integer or jnp.ndim(value) or (arrays and not hasattr(value, "dtype")):
            raise TypeError(
                f"{who}'s `{state_arg}.{name}` must be a scalar integer"
                f"{' array' if arrays else ''} (as MultiSteps.init builds it; for a "
                f"stack of states, jax.vmap {who}), got {describe_value(value)}."
            )
    return who, state_arg


def check_stochastic_rounding(stochastic: bool, dtype: Any) -> None:
    """Raises where `stochastic_rounding=True` lacks a bfloat16 `accumulator_dtype`."""
    if stochastic and dtype != jnp.bfloat16:
        raise ValueError(
            "stochastic_rounding=True (a bfloat16 accumulator rounded without bias) "
            f"needs accumulator_dtype=jnp.bfloat16, got accumulator_dtype={dtype}."
        )


def check_every_k(every_k: Any) -> Callable[[jax.Array], Any]:
    """`every_k_schedule` as a function; a bool is its int, as in optax."""
    if callable(every_k):
        return every_k
    k = int(every_k) if isinstance(every_k, bool) else as_index(every_k)
    if k is None or not 1 <= k <= 2**31 - 1:
        raise (TypeError if k is None else ValueError)(
            f"every_k_schedule must be an int from 1 to 2**31 - 1, got {every_k!r} "
            f"({type(every_k).__name__}): the mini-steps per update, counted in int32; "
            "or a function of the gradient step returning one."
        )
    return lambda _: k


def check_k(k: Any, gradient_step: jax.Array) -> jax.Array:
    """The window length from `every_k_schedule` (a bool: its int), checked if known."""
    array = jnp.asarray(k) if isinstance(k, jax.core.Tracer) else np.asarray(k)
    if array.shape != () or not any(jnp.issubdtype(array.dtype, t) for t in _NUMERIC):
        raise TypeError(
            "every_k_schedule must return a scalar int (the number of mini-steps "
            f"in this window), got {describe_value(k)}."
        )
    value = array.item() if isinstance(array, np.ndarray) else None
    if value is not None and not (1 <= value <= 2**31 - 1 and value == int(value)):
        at = ""
        if not isinstance(gradient_step, jax.core.Tracer):
            at = f" at gradient step {int(gradient_step)}"
        raise ValueError(
            f"every_k_schedule returned {value!r}{at}; a window is a whole number of "
            "mini-steps from 1 to 2**31 - 1 (the state counts them in int32). Round "
            "the schedule's output (e.g. `jnp.ceil(k).astype(jnp.int32)`)."
        )
    return jnp.asarray(k, jnp.int32 if array.dtype == jnp.bool_ else None)


def check_skip_fn(fn: Any) -> Callable | None:
    """`should_skip_update_fn`, checked to be `None` or callable."""
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
        zero = (weight if isinstance(weight, jax.Array) else np.asarray(weight)) == 0
        updates = jax.tree.map(lambda g: jnp.where(zero, jnp.zeros_like(g), g), updates)
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
        raise TypeError(
            f"should_skip_update_fn {name} must return a scalar bool first, got "
            f"{type(should_skip).__name__} {should_skip!r} (dtype {dtype}, shape "
            f"{shape}). Reduce it to one decision, e.g. with `jnp.any(...)`."
        )
    return should_skip, skip_state


def _check_gradients(grads: PyTree, acc: PyTree, config: Window) -> None:
    """Raises where the gradients do not fit the accumulator."""
    names = dict(expected_name=_ACC, got_name="the updates")
    check_same_structure(acc, grads, **names)
    check_same_shapes(acc, grads, **names, hint="they must have the params' shapes.")
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    stochastic = config.accumulation.stochastic
    for (path, g), a in zip(flat, jax.tree.leaves(acc), strict=True):
        where = jax.tree_util.keystr(path)
        if getattr(g, "dtype", None) == jax.dtypes.float0:
            raise TypeError(
                f"MultiSteps: the gradient at {where} has dtype float0 (`jax.grad("
                "..., allow_int=True)` of an integer param): nothing to accumulate "
                "or apply, as in optax. Pass None there (as `eqx.filter_grad` does) "
                "or leave integer params out of the differentiated tree."
            )
        g_dtype = jnp.result_type(g)
        held = arithmetic.holds(a.dtype, g)  # a weak `g` as JAX promotes it
        if held or stochastic and arithmetic.rounds_stochastically(g_dtype):
            continue
        least = arithmetic.least_holding(g_dtype, a.dtype)
        wide = f"a dtype holding {g_dtype}" if least is None else f"jnp.{least}"
        raise TypeError(
            f"MultiSteps: the gradient at {where or 'the root'} has dtype {g_dtype}, "
            f"but its accumulator (acc_grads{where}) has dtype {a.dtype}, which does "
            f"not hold every {g_dtype} value: accumulating would round them. init "
            "chose the least dtype holding the params' and accumulator_dtype (here "
            f"accumulator_dtype={config.accumulator_dtype}). Build MultiSteps with "
            f"accumulator_dtype={wide} and init again, or pass {a.dtype} gradients."
        )
