"""`MultiSteps`: gradient accumulation, a drop-in for `optax.MultiSteps`.

Each step folds the gradients into a running mean (or sum) in place; on the
last mini-step of a window the inner optimizer runs, inside one `lax.cond`,
on the window's mean. Everything is chosen by selection, never by
arithmetic on state, so no dtype changes and no NaN or `inf` crosses a
window. With `axis_name`, each device accumulates its own gradients and they
are averaged once per window. With `weighted=True` each mini-step brings a
weight (its token count) and the window emits the weighted mean. How the
accumulator, the inner state and the params stay in their donated buffers
is in `docs/design.md`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jaxtyping import Array, Bool, PyTree

from ._apply import apply_gradients, merge_trainable, with_extra_args
from ._conditional import check_transformation, update_if
from ._devices import AxisView, view
from ._sharding import mirror_param_sharding
from ._static import Configured, config_key
from ._tree import (
    accumulable,
    as_index,
    check_accumulator_dtype,
    check_same_shapes,
    check_same_structure,
    check_state_structure,
    describe_value,
    fill_untrained_gaps,
    restore_none,
    saturating_increment,
    strong_as_recorded,
    traced_state_record,
    widen,
)

_INT32_MAX = int(jnp.iinfo(jnp.int32).max)


def _validate_every_k(every_k_schedule: Any) -> Callable[[jax.Array], Any]:
    if callable(every_k_schedule):
        return every_k_schedule
    # A bool is the int it is, as in optax (which tests `isinstance(k, int)`).
    k = (
        int(every_k_schedule)
        if isinstance(every_k_schedule, bool)
        else as_index(every_k_schedule)
    )
    if k is not None:
        if not 1 <= k <= _INT32_MAX:
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


def _check_k(k: Any, gradient_step: jax.Array) -> jax.Array:
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
    if not 1 <= value <= _INT32_MAX or value != int(value):
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


def _window_complete(mini_step: jax.Array, k: jax.Array) -> jax.Array:
    """Whether the mini-step `mini_step` (counted from 0) completes a window of
    `k`. A traced `k` that is not a whole number closes the window at the
    first mini-step count reaching it (`ceil(k)`); one that is not greater
    than 0 (or NaN) never does: the window goes on accumulating, as in optax,
    which never emits for such `k`."""
    return jnp.logical_and(k > 0, mini_step + 1 >= k)


# Raised by JAX for dtypes it does not promote together (float8 with
# float32). Public as `jax.dtypes.TypePromotionError` from jax 0.10; before,
# only its base class is: catching that is as narrow here, where the calls
# in each `try` can raise nothing else.
_PROMOTION_ERROR: type[Exception] = getattr(
    jax.dtypes, "TypePromotionError", ValueError
)


def _holds(wide: Any, narrow: Any) -> bool:
    """Whether every value of dtype `narrow` is a value of dtype `wide` (as
    JAX promotes: integers count as held by floats). For the dtypes JAX does
    not promote together (float8 with float32, say) the formats are
    compared."""
    try:
        return jnp.promote_types(narrow, wide) == wide
    except _PROMOTION_ERROR:
        pass
    if not (jnp.issubdtype(wide, jnp.inexact) and jnp.issubdtype(narrow, jnp.inexact)):
        return False
    if jnp.issubdtype(narrow, jnp.complexfloating) and not jnp.issubdtype(
        wide, jnp.complexfloating
    ):
        return False
    w, n = jnp.finfo(wide), jnp.finfo(narrow)
    return w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp


def _promote(dtype: Any, accumulator_dtype: Any, path: str) -> Any:
    """The least dtype holding both, or an error naming `accumulator_dtype`."""
    try:
        return jnp.promote_types(dtype, accumulator_dtype)
    except _PROMOTION_ERROR:
        pass
    if _holds(accumulator_dtype, dtype):
        return jnp.dtype(accumulator_dtype)
    if _holds(dtype, accumulator_dtype):
        return jnp.dtype(dtype)
    raise TypeError(
        f"MultiSteps(accumulator_dtype={jnp.dtype(accumulator_dtype)}) cannot "
        f"accumulate the params at {path or 'the root'} of dtype {jnp.dtype(dtype)}: "
        "neither dtype holds every value of the other. Pass an accumulator_dtype "
        "that holds both (e.g. jnp.float32 for float8 params)."
    )


def _work_dtype(acc_dtype: Any) -> Any:
    """The dtype a mini-step's running mean is computed in: float32 for
    floating accumulators narrower than it (float16, bfloat16, float8), where
    `g - acc` would overflow (the mean of 6e4 and -6e4 in float16) and every
    operation would round; the accumulator's own dtype otherwise."""
    if jnp.issubdtype(acc_dtype, jnp.floating) and jnp.finfo(acc_dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return acc_dtype


def _check_state(state: Any, method: str) -> None:
    """Raises a `TypeError` unless `state` is a `MultiStepsState`-like value
    with scalar integer counters."""
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
        raise TypeError(
            f"MultiSteps.{method}'s `state` must be the optax.MultiStepsState "
            f"that MultiSteps.init returned, got {describe_value(state)}, which "
            f"has no {', '.join(missing)}. {hint}"
        )
    for name in ("mini_step", "gradient_step"):
        value = getattr(state, name)
        dtype = getattr(value, "dtype", None)
        if (
            dtype is None
            or not jnp.issubdtype(dtype, jnp.integer)
            or jnp.shape(value) != ()
        ):
            raise TypeError(
                f"MultiSteps.{method}'s `state.{name}` must be a scalar integer "
                f"array (as MultiSteps.init builds it), got {describe_value(value)}."
            )


def _check_skip_fn(fn: Any) -> Callable | None:
    if fn is not None and not callable(fn):
        raise TypeError(
            "should_skip_update_fn must be None or a function "
            f"(updates, gradient_step, params) -> (bool, state), got {fn!r}."
        )
    return fn


def _should_skip(
    fn: Callable | None, updates: PyTree, gradient_step: jax.Array, params: PyTree
) -> tuple[jax.Array, PyTree]:
    """`fn(updates, gradient_step, params)` checked: a scalar bool and the
    skip state; never skip (and an empty state) without `fn`."""
    if fn is None:
        return jnp.zeros((), jnp.bool_), ()
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


def _fold(g: jax.Array, acc: jax.Array, mini_step: jax.Array, mean: bool) -> jax.Array:
    """`acc` with the gradient `g` folded in: the running mean (Welford,
    `acc + (g - acc) / (n + 1)`) or sum; the first mini-step of a window
    *selects* `g`, so even a buffer holding a NaN (a state saved by
    optax.MultiSteps, say) starts the window clean. float16 and bfloat16
    accumulators are updated in float32 and rounded once (`_work_dtype`)."""
    # lax, not jnp: no per-leaf `jit` of jnp's functions to trace and inline.
    work = _work_dtype(acc.dtype)
    g = widen(jnp.asarray(g), work)
    old = lax.convert_element_type(acc, work)
    if mean:
        count = lax.convert_element_type(mini_step + 1, work)
        running = lax.add(old, lax.div(lax.sub(g, old), count))
    else:
        running = lax.add(old, g)
    return lax.convert_element_type(lax.select(mini_step == 0, g, running), acc.dtype)


class WeightedMultiStepsState(NamedTuple):
    """The state of `MultiSteps(..., weighted=True)`: the fields of
    `optax.MultiStepsState`, in its order, and the window's running weight."""

    mini_step: jax.Array
    """The number of mini-steps accumulated in this window (int32)."""
    gradient_step: jax.Array
    """The number of windows applied (int32); a window of weight 0 is not."""
    inner_opt_state: Any
    """The inner optimizer's state."""
    acc_grads: Any
    """The window's weighted running mean of the gradients."""
    skip_state: Any
    """What `should_skip_update_fn` returned last (`()` without one)."""
    acc_weight: jax.Array
    """The sum of the window's weights so far (float32; float64 for float64
    or complex128 accumulators). With `axis_name`, this device's own."""


_NO_WEIGHT = object()


def _weight_dtype(acc: PyTree) -> Any:
    """float32, or float64 where an accumulator works in float64 or
    complex128: the ratio of weights divides gradients in that dtype."""
    for a in jax.tree.leaves(acc):
        if jnp.finfo(_work_dtype(jnp.result_type(a))).bits == 64:  # complex128 too
            return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def _check_weight(weight: Any, weighted: bool, method: str) -> Any:
    """The `weight` of one mini-step, checked: given exactly when `weighted`,
    a real scalar, and >= 0 and finite where known while tracing."""
    if not weighted:
        if weight is not _NO_WEIGHT:
            raise TypeError(
                f"MultiSteps.{method} got weight={describe_value(weight)}, but "
                "this MultiSteps was built without weighted=True, where every "
                "mini-step counts the same. Build it with "
                "`MultiSteps(..., weighted=True)` (and init its state again) "
                "to average the mini-steps by weight."
            )
        return None
    if weight is _NO_WEIGHT:
        raise TypeError(
            f"MultiSteps(weighted=True).{method} needs `weight=`: this "
            "mini-step's weight, a scalar >= 0 (e.g. its number of "
            "non-padding tokens). The window emits the mean of its gradients "
            "weighted by it."
        )
    dtype = getattr(weight, "dtype", None)
    if dtype is None:
        if isinstance(weight, bool) or not isinstance(weight, int | float):
            dtype = None
        else:
            dtype = jnp.result_type(weight)
    real = (
        dtype is not None
        and not isinstance(weight, bool)
        and dtype != jnp.bool_
        and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))
    )
    if not real or jnp.shape(weight) != ():
        raise TypeError(
            f"MultiSteps.{method}'s `weight` must be a real scalar >= 0 (an "
            "int or float, e.g. the mini-step's number of non-padding tokens), "
            f"got {describe_value(weight)}."
        )
    try:
        known = float(np.asarray(weight))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return weight  # traced: not checked (see the docstring)
    if not (known >= 0 and np.isfinite(known)):
        raise ValueError(
            f"MultiSteps.{method}'s `weight` must be finite and >= 0, got "
            f"{known!r}: it is the mini-step's share of the window (e.g. its "
            "number of non-padding tokens)."
        )
    return weight


def _fold_weighted(
    g: jax.Array,
    acc: jax.Array,
    first: jax.Array,
    nothing: jax.Array,
    scale: jax.Array,
) -> jax.Array:
    """`acc` with `g` folded in at weight `w`: the weighted running mean
    `acc + (g - acc) / (W / w)`, `W` the window's weight with `w`; `g` is
    *selected* where nothing came before (`first`), and `acc` kept where
    `w == 0` (`nothing`), so a weight-0 gradient, even a NaN one, leaves no
    trace."""
    work = _work_dtype(acc.dtype)
    g = widen(jnp.asarray(g), work)
    old = lax.convert_element_type(acc, work)
    scale = lax.broadcast_in_dim(lax.convert_element_type(scale, work), old.shape, ())
    running = lax.add(old, lax.div(lax.sub(g, old), scale))
    new = lax.convert_element_type(lax.select(first, g, running), acc.dtype)
    return lax.select(nothing, acc, new)


def _accumulate(
    grads: PyTree,
    acc: PyTree,
    mini_step: jax.Array,
    mean: bool,
    should_skip: jax.Array | None,
    devices: Any,
    weighted: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> PyTree:
    """`acc` with `grads` folded in (`_fold`; `_fold_weighted` with its
    `(first, nothing, scale)` given as `weighted`), kept where `should_skip`.
    The gradient gets the state's device axis (if any), which the
    accumulator keeps through the `cond`: a reshape of the `cond`'s result
    made XLA copy it into the state."""

    def one(g: jax.Array, a: jax.Array) -> jax.Array:
        if weighted is None:
            new = _fold(devices.add_axis(g), a, mini_step, mean)
        else:
            new = _fold_weighted(devices.add_axis(g), a, *weighted)
        return new if should_skip is None else lax.select(should_skip, a, new)

    return jax.tree.map(one, grads, acc)


def _next_counters(
    emit: jax.Array,
    should_skip: jax.Array,
    mini_step: jax.Array,
    gradient_step: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """`mini_step` and `gradient_step` after this step: a window restarts
    where it emitted, a skipped step counts nothing, neither overflows."""
    mini = jnp.where(
        emit, 0, jnp.where(should_skip, mini_step, saturating_increment(mini_step))
    )
    gradient = jnp.where(emit, saturating_increment(gradient_step), gradient_step)
    return mini.astype(mini_step.dtype), gradient


def _as_gradient(mean: jax.Array, dtype: Any) -> jax.Array:
    """The window's mean in the gradients' `dtype`. A complex accumulator
    of real gradients holds a zero imaginary part, dropped by `real` (a
    complex-to-real cast warns in JAX and is to raise)."""
    if jnp.iscomplexobj(mean) and not jnp.issubdtype(dtype, jnp.complexfloating):
        mean = lax.real(mean)
    return mean.astype(dtype)


def _zero_accumulator(params: PyTree, accumulator_dtype: Any) -> PyTree:
    """Zeros for each params leaf, in its accumulator's dtype (`_acc_dtype`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: jnp.zeros(
            jnp.shape(p), _acc_dtype(p, accumulator_dtype, jax.tree_util.keystr(path))
        ),
        params,
    )


def _acc_dtype(param: Any, acc: Any, path: str) -> Any:
    """The accumulator's dtype for a params leaf: the least dtype holding
    the leaf's dtype and `accumulator_dtype` (a Python number counts as
    weakly typed, as in JAX's promotion), the leaf's own with `None`;
    `accumulator_dtype` (float32 with `None`) for integer leaves."""
    dtype = jnp.result_type(param)
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.dtype(jnp.float32) if acc is None else acc
    if acc is None:
        return dtype
    try:
        return jnp.result_type(param, acc)
    except _PROMOTION_ERROR:
        return _promote(dtype, acc, path)


def _check_gradients(grads: PyTree, acc: PyTree, accumulator_dtype: Any) -> None:
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
        except _PROMOTION_ERROR:
            held = _holds(a.dtype, g_dtype)
        if held:
            continue
        where = jax.tree_util.keystr(path)
        try:
            wide = f"jnp.{_promote(g_dtype, a.dtype, where)}"
        except TypeError:
            wide = f"a dtype holding {g_dtype}"
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


def _check_weighted(weighted: Any, use_grad_mean: Any) -> bool:
    if not isinstance(weighted, bool | np.bool_):
        raise TypeError(
            f"weighted must be True or False, got {describe_value(weighted)}."
        )
    if weighted and not use_grad_mean:
        raise ValueError(
            "MultiSteps(weighted=True) emits the weighted mean of the window's "
            "gradients; it takes no use_grad_mean=False. For the gradient of "
            "a sum over the window's tokens, scale the inner optimizer's "
            "learning rate by the window's weight instead."
        )
    return bool(weighted)


def _check_state_kind(state: Any, weighted: bool, method: str) -> None:
    """Raises where the state is of the other kind (weighted or not) than
    this `MultiSteps`, or its `acc_weight` is not a float scalar."""
    has = isinstance(state, WeightedMultiStepsState) or hasattr(state, "acc_weight")
    if weighted and not has:
        raise TypeError(
            f"MultiSteps(weighted=True).{method}'s `state` has no acc_weight: "
            f"got {type(state).__name__}, not the WeightedMultiStepsState that "
            "its init returns. Build the state with this MultiSteps' init."
        )
    if not weighted and isinstance(state, WeightedMultiStepsState):
        raise TypeError(
            f"MultiSteps.{method} was built without weighted=True but got a "
            "WeightedMultiStepsState (from MultiSteps(..., weighted=True).init); "
            "build both with the same `weighted`."
        )
    if weighted:
        value = state.acc_weight
        dtype = getattr(value, "dtype", None)
        if (
            dtype is None
            or not jnp.issubdtype(dtype, jnp.floating)
            or jnp.shape(value) not in ((), (1,))
        ):
            raise TypeError(
                f"MultiSteps.{method}'s `state.acc_weight` must be a float "
                "scalar (as init builds it), got "
                f"{describe_value(value)}."
            )


class _Weights(NamedTuple):
    """One weighted mini-step's scalars (`_window_weights`)."""

    stored: jax.Array  # the state's running weight, as it came in
    total: jax.Array  # the window's running weight with this mini-step's
    folding: tuple[jax.Array, jax.Array, jax.Array]  # `_fold_weighted`'s


def _window_weights(
    acc_weight: jax.Array, weight: Any, mini_step: jax.Array
) -> _Weights:
    """The running weight after adding `weight`, and how `_fold_weighted`
    folds it in. A window's first mini-step starts from 0, whatever the
    state holds. `W / w` is computed with `w` replaced by 1 where it is 0
    (it is then not used), so no step makes a NaN or `inf`."""
    stored = acc_weight if jnp.ndim(acc_weight) == 0 else acc_weight[0]
    dtype = stored.dtype
    w = lax.convert_element_type(jnp.asarray(weight), dtype)
    before = jnp.where(mini_step == 0, jnp.zeros((), dtype), stored)
    total = before + w
    nothing = w == 0
    scale = total / jnp.where(nothing, jnp.ones((), dtype), w)
    return _Weights(stored, total, (before == 0, nothing, scale))


class MultiSteps(Configured):
    """Accumulates gradients over several mini-steps, then applies `opt` once.

    A drop-in for `optax.MultiSteps`: the same constructor, `init`, `update`
    (extra keyword arguments such as `value=` go to the inner optimizer),
    `has_updated`, `inner_opt`, `gradient_transformation()` and state type,
    `optax.MultiStepsState`, so a checkpoint written by one loads into the
    other. Each `update` folds the gradients into `acc_grads`; the mini-step
    that completes a window of `k = every_k_schedule(gradient_step)` accepted
    mini-steps applies the inner optimizer to the window's mean (or sum) and
    returns its updates; every other mini-step returns exact zeros without
    running it.

    Beyond optax: every leaf of the inner state keeps its dtype, shape and
    weak type on every step (it is selected, never blended); the
    accumulator is reset by selection, so a NaN or `inf` never crosses a
    window; no gradient is rounded into a narrower accumulator (a
    `TypeError` instead); `params` may be a whole Equinox model. The full
    contract (numerics, window sizes, Equinox leaves, errors) is in
    `docs/multi_steps.md`.

    **Arguments:**

    - `opt`: the inner optimizer, an `optax.GradientTransformation`.
    - `every_k_schedule`: an int from 1 to `2**31 - 1`, or a function from
      the gradient step (int32 scalar) to the number of mini-steps in that
      window. A bool counts as the int it is (`True` is 1), as in optax. A
      traced non-integer `k` closes the window at `ceil(k)`; a traced
      `k <= 0` never closes it (as optax never emits).
    - `use_grad_mean`: average the window's gradients if `True`, else sum them.
    - `should_skip_update_fn`: as in optax, `(updates, gradient_step, params)
      -> (should_skip, skip_state)` with a scalar bool `should_skip`; a
      skipped mini-step leaves the accumulator, counters and inner state as
      they were (e.g. `optax.skip_not_finite`).
    - `accumulator_dtype`: the least dtype to accumulate in; each leaf's
      accumulator has the least dtype holding it and the params leaf's
      (float32 for float32, bfloat16 and float16 params, as optax). `None`
      accumulates in each params leaf's own dtype.
    - `axis_name`: accumulate per device inside `jax.shard_map` and average
      across this axis once per window (`docs/data_parallel.md`).
    - `weighted`: if `True`, `update` and `apply_gradients` take each
      mini-step's `weight=` (a scalar >= 0, traced: e.g. its number of
      non-padding tokens) and the window emits `sum_i w_i g_i / sum_i w_i`,
      the gradient of the mean over all of the window's tokens when each
      `g_i` is its micro-batch's token-mean gradient. A weight of 0 leaves
      no trace (its gradient, even NaN, is not read); a window whose weights
      sum to 0 emits zeros, leaves the inner state (and, fused, the params)
      as they were and does not advance `gradient_step`. With `axis_name`
      the weights are each device's own and the mean is over every device's
      tokens, still in one all-reduce per window. The state is then a
      `WeightedMultiStepsState` (`optax.MultiStepsState`'s fields and
      `acc_weight`, the window's running weight). A weight known while
      tracing must be finite and >= 0; a traced one is not checked (a
      negative or NaN one gives a meaningless mean). Needs
      `use_grad_mean=True`. See "Uneven micro-batches" in
      `docs/multi_steps.md`.

    Two `MultiSteps` built from equal arguments compare and hash equal, so a
    jitted step taking the optimizer as a static argument compiles once.

    **Example:**

    ```python
    opt = optax_ext.MultiSteps(optax.adam(1e-3), every_k_schedule=4)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)  # zeros 3 times in 4
    ```
    """

    def __init__(
        self,
        opt: optax.GradientTransformation,
        every_k_schedule: int | Callable[[jax.Array], Any],
        use_grad_mean: bool = True,
        should_skip_update_fn: Callable[..., tuple[jax.Array, PyTree]] | None = None,
        accumulator_dtype: Any = jnp.float32,
        axis_name: Hashable | None = None,
        weighted: bool = False,
    ):
        check_transformation(opt, "opt")
        self._weighted = _check_weighted(weighted, use_grad_mean)
        self._opt = with_extra_args(opt)
        # As given: `apply_gradients` fuses through a nested MultiSteps or
        # skip_when, which `with_extra_args` would hide.
        self._fusable_inner = opt
        self._every_k_schedule = _validate_every_k(every_k_schedule)
        self._use_grad_mean = bool(use_grad_mean)
        self._should_skip_update_fn = _check_skip_fn(should_skip_update_fn)
        self._accumulator_dtype = check_accumulator_dtype(
            accumulator_dtype, complex_ok=True
        )
        self._key = config_key(
            opt,
            every_k_schedule,
            self._use_grad_mean,
            should_skip_update_fn,
            self._accumulator_dtype,
            axis_name,
            self._weighted,
        )
        self._devices = view(axis_name)
        # `check_state_structure`'s answers by the avals of its template.
        self._inner_structures: dict[tuple, Any] = {}

    @property
    def inner_opt(self) -> optax.GradientTransformationExtraArgs:
        """The wrapped optimizer."""
        return self._opt

    def init(
        self, params: optax.Params
    ) -> optax.MultiStepsState | WeightedMultiStepsState:
        """Builds the initial `optax.MultiStepsState` for `params`.

        With `axis_name`, call it where that axis is bound (inside
        `jax.shard_map`): `acc_grads` and `skip_state` then hold this
        device's own values, with a leading axis of length 1 (see
        `state_specs`).
        """
        params = accumulable(params)
        self._devices.check_bound("init")
        acc_grads = _zero_accumulator(params, self._accumulator_dtype)
        inner_state = self._opt.init(params)
        traced_state_record(
            self._opt.init, params, self._inner_structures, is_params=True
        )
        gradient_step = jnp.zeros((), jnp.int32)
        _, skip_state = _should_skip(
            self._should_skip_update_fn,
            jax.tree.map(jnp.zeros_like, params),
            gradient_step,
            params,
        )
        state = optax.MultiStepsState(
            mini_step=jnp.zeros((), jnp.int32),
            gradient_step=gradient_step,
            inner_opt_state=inner_state,
            acc_grads=acc_grads,
            skip_state=skip_state,
        )
        state = mirror_param_sharding(state, params)
        state = state._replace(
            acc_grads=self._devices.add_axis(state.acc_grads),
            skip_state=self._devices.add_axis(state.skip_state),
        )
        if not self._weighted:
            return state
        weight = jnp.zeros((), _weight_dtype(acc_grads))
        return WeightedMultiStepsState(
            *state, acc_weight=self._devices.add_axis(weight)
        )

    def state_specs(self) -> optax.MultiStepsState | WeightedMultiStepsState:
        """`PartitionSpec`s of the state (a prefix of its tree) for
        `jax.shard_map`: `P()` everywhere, but `P(axis_name)` for `acc_grads`
        and `skip_state` with `axis_name`, where each device accumulates its
        own (outside `shard_map` their leaves have a leading device axis)."""
        replicated: Any = jax.sharding.PartitionSpec()
        specs: dict[str, Any] = dict(
            mini_step=replicated,
            gradient_step=replicated,
            inner_opt_state=replicated,
            acc_grads=self._devices.spec(),
            skip_state=self._devices.spec(),
        )
        if not self._weighted:
            return optax.MultiStepsState(**specs)
        return WeightedMultiStepsState(**specs, acc_weight=self._devices.spec())

    def update(
        self,
        updates: optax.Updates,
        state: optax.MultiStepsState | WeightedMultiStepsState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.MultiStepsState | WeightedMultiStepsState]:
        """Accumulates `updates`; returns the inner optimizer's updates on the
        last mini-step of a window and zeros otherwise. With `weighted=True`,
        pass `weight=` (this mini-step's weight); it is not forwarded to the
        inner optimizer."""
        return self._step(updates, state, params, extra_args, fused=False)

    def _apply_gradients(
        self,
        grads: optax.Updates,
        state: optax.MultiStepsState | WeightedMultiStepsState,
        params: optax.Params,
        **extra_args: Any,
    ) -> tuple[optax.Params, optax.MultiStepsState | WeightedMultiStepsState]:
        """`update` followed by applying the updates to `params`, fused: a
        mini-step returns `params` as they came in, without building zero
        updates (`optax_ext.apply_gradients` calls this)."""
        return self._step(grads, state, params, extra_args, fused=True)

    def _step(
        self,
        updates: PyTree,
        state: optax.MultiStepsState | WeightedMultiStepsState,
        params: PyTree | None,
        extra_args: dict[str, Any],
        *,
        fused: bool,
    ) -> tuple[PyTree, optax.MultiStepsState | WeightedMultiStepsState]:
        devices = self._devices
        devices.check_bound("update")
        method = "apply_gradients" if fused else "update"
        _check_state(state, method)
        extra_args = dict(extra_args)
        weight = _check_weight(
            extra_args.pop("weight", _NO_WEIGHT), self._weighted, method
        )
        _check_state_kind(state, self._weighted, method)
        acc_in = devices.drop_axis(state.acc_grads)
        all_params = params
        if params is not None:
            params = accumulable(params)
        # Integer and Python-number params hold state (as in optax) but get a
        # `None` gradient from `eqx.filter_grad`: zeros there, `None` back in
        # the updates.
        given = updates
        updates = fill_untrained_gaps(updates, params)
        _check_gradients(updates, acc_in, self._accumulator_dtype)
        # Against what init built the inner state from: the params where
        # given (an integer leaf's accumulator is float32, its param not).
        record = check_state_structure(
            self._opt.init,
            state.inner_opt_state,
            acc_in if params is None else params,
            self._inner_structures,
            is_params=params is not None,
            who="MultiSteps.update",
            state_name="state.inner_opt_state",
            owner="MultiSteps",
        )
        devices.check_gradients(updates, acc_in)
        mini_step = jnp.asarray(state.mini_step)
        gradient_step = jnp.asarray(state.gradient_step)
        k = _check_k(self._every_k_schedule(gradient_step), gradient_step)
        should_skip, skip_state = _should_skip(
            self._should_skip_update_fn, updates, gradient_step, params
        )
        skipping = self._should_skip_update_fn is not None
        if skipping:
            should_skip = devices.agree(should_skip)

        folding = weights = None
        if self._weighted:
            # `_check_state_kind` saw its float `acc_weight`.
            acc_weight = cast(WeightedMultiStepsState, state).acc_weight
            weights = _window_weights(acc_weight, weight, mini_step)
            folding = weights.folding
        acc_grads = _accumulate(
            updates,
            state.acc_grads,
            mini_step,
            self._use_grad_mean,
            should_skip if skipping else None,
            devices,
            folding,
        )
        emit = jnp.logical_and(
            jnp.logical_not(should_skip), _window_complete(mini_step, k)
        )
        if weights is not None:
            return self._weighted_step(
                weights,
                emit,
                should_skip,
                skip_state,
                acc_grads,
                state,
                updates,
                given,
                params,
                all_params,
                record,
                extra_args,
                fused=fused,
            )
        update_dtypes = jax.tree.map(lambda g: jnp.result_type(g), updates)

        def window_grads(acc_grads):
            acc_grads = devices.window_mean(acc_grads)
            return jax.tree.map(_as_gradient, acc_grads, update_dtypes)

        def inner_update(acc_grads, inner_state):
            grads = window_grads(acc_grads)
            return self._opt.update(grads, inner_state, params, **extra_args)

        def inner_apply(acc_grads, inner_state, params):
            grads = window_grads(acc_grads)
            return apply_gradients(
                self._fusable_inner, grads, inner_state, params, **extra_args
            )

        # Only the inner optimizer sits inside the `cond`. The accumulator goes
        # in and comes back out: cleared in the emitting branch once the inner
        # optimizer has read it, as it came in from the other. Both keep it in
        # the donated buffer (see docs/design.md). The state after an
        # emitting step holds zeros there, as optax's does: a state saved by
        # either implementation continues correctly in the other.
        if fused:
            new_params, inner_state, acc_grads = update_if(
                emit,
                inner_apply,
                acc_grads,
                state.inner_opt_state,
                clear_grads=True,
                carry=params,
                index_by_live=True,
            )
            result = merge_trainable(all_params, new_params)
        else:
            result, inner_state, acc_grads = update_if(
                emit,
                inner_update,
                acc_grads,
                state.inner_opt_state,
                clear_grads=True,
                index_by_live=True,
            )
            result = restore_none(given, result)
        new_state = optax.MultiStepsState(
            *_next_counters(emit, should_skip, mini_step, gradient_step),
            # A value written into the state weakly typed (`jnp.asarray(1e-2)`)
            # leaves with init's avals.
            inner_opt_state=strong_as_recorded(inner_state, record),
            acc_grads=acc_grads,
            skip_state=devices.add_axis(skip_state),
        )
        return result, new_state

    def _weighted_step(
        self,
        weights: _Weights,
        window_end: jax.Array,
        should_skip: jax.Array,
        skip_state: PyTree,
        acc_grads: PyTree,
        state: optax.MultiStepsState | WeightedMultiStepsState,
        updates: PyTree,
        given: PyTree,
        params: PyTree | None,
        all_params: PyTree | None,
        record: Any,
        extra_args: dict[str, Any],
        *,
        fused: bool,
    ) -> tuple[PyTree, WeightedMultiStepsState]:
        """The rest of `_step` with `weighted=True`: the window's weighted
        mean goes to the inner optimizer where the window's weights sum to
        more than 0. On one device that is known before the `cond` (its
        predicate); with `axis_name` only after the window's all-reduce, so
        the emitting branch selects the updates (zeros), the inner state and
        the params as they came in where the sum over the devices is 0, and
        hands the decision out with the inner state."""
        devices = self._devices
        mini_step = jnp.asarray(state.mini_step)
        gradient_step = jnp.asarray(state.gradient_step)
        update_dtypes = jax.tree.map(lambda g: jnp.result_type(g), updates)
        local = not isinstance(devices, AxisView)
        pred = jnp.logical_and(window_end, weights.total > 0) if local else window_end

        def window_grads(acc_grads):
            mean, keep = devices.window_weighted_mean(acc_grads, weights.total)
            return jax.tree.map(_as_gradient, mean, update_dtypes), keep

        def keep_or(keep, new, old):
            return jax.tree.map(lambda n, o: jnp.where(keep, n, o), new, old)

        def inner_update(acc_grads, inner):
            grads, keep = window_grads(acc_grads)
            if keep is None:
                return self._opt.update(grads, inner, params, **extra_args)
            inner_state, _ = inner
            out, new = self._opt.update(grads, inner_state, params, **extra_args)
            out = jax.tree.map(lambda u: jnp.where(keep, u, jnp.zeros_like(u)), out)
            return out, (keep_or(keep, new, inner_state), keep)

        def inner_apply(acc_grads, inner, params):
            grads, keep = window_grads(acc_grads)
            inner_state = inner if keep is None else inner[0]
            new_params, new = apply_gradients(
                self._fusable_inner, grads, inner_state, params, **extra_args
            )
            if keep is None:
                return new_params, new
            return keep_or(keep, new_params, params), (
                keep_or(keep, new, inner_state),
                keep,
            )

        inner_in = state.inner_opt_state
        if not local:
            inner_in = (inner_in, jnp.zeros((), jnp.bool_))
        if fused:
            new_params, inner_out, acc_grads = update_if(
                pred,
                inner_apply,
                acc_grads,
                inner_in,
                clear_grads=True,
                carry=params,
                index_by_live=True,
            )
            result = merge_trainable(all_params, new_params)
        else:
            result, inner_out, acc_grads = update_if(
                pred,
                inner_update,
                acc_grads,
                inner_in,
                clear_grads=True,
                index_by_live=True,
            )
            result = restore_none(given, result)
        inner_state, emitted = (inner_out, pred) if local else inner_out
        mini, _ = _next_counters(window_end, should_skip, mini_step, gradient_step)
        _, gradient = _next_counters(emitted, should_skip, mini_step, gradient_step)
        running = jnp.where(should_skip, weights.stored, weights.total)
        acc_weight = jnp.where(window_end, jnp.zeros_like(running), running)
        new_state = WeightedMultiStepsState(
            mini,
            gradient,
            inner_opt_state=strong_as_recorded(inner_state, record),
            acc_grads=acc_grads,
            skip_state=devices.add_axis(skip_state),
            acc_weight=devices.add_axis(acc_weight),
        )
        return result, new_state

    def has_updated(
        self, state: optax.MultiStepsState | WeightedMultiStepsState
    ) -> Bool[Array, ""]:
        """`True` when the last *accepted* mini-step completed a window, from
        the counters as in optax (`mini_step == 0 and gradient_step > 0`): a
        skipped step right after an emitting one leaves it `True`, as in
        optax; `state.skip_state` tells the two apart."""
        return jnp.logical_and(
            jnp.asarray(state.mini_step) == 0, jnp.asarray(state.gradient_step) > 0
        )

    def gradient_transformation(self) -> optax.GradientTransformationExtraArgs:
        """This optimizer as a plain `optax.GradientTransformationExtraArgs`."""
        return self.as_transformation()
