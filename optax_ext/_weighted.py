"""`MultiSteps(..., weighted=True)`: its state, the `weight=` of a
mini-step, and the window's running weight. Each mini-step's gradient is
folded with its weight `w` as `acc + (g - acc) / (W / w)`, `W` the window's
running weight (`_accumulate.arithmetic.fold_weighted`); a weight-0 mini-step is not
read (`docs/multi_steps.md`, "Uneven micro-batches").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ._accumulate.arithmetic import is_real_scalar, weighted_fold_terms
from ._tree import caller, describe_value


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


NO_WEIGHT = object()


def check_weight(weight: Any, weighted: bool, method: str) -> Any:
    """The `weight` of one mini-step, checked: given exactly when `weighted`,
    a real scalar, and >= 0 and finite where known while tracing."""
    if not weighted:
        if weight is not NO_WEIGHT:
            raise TypeError(
                f"{caller(method)[0]} got weight={describe_value(weight)}, but "
                "this MultiSteps was built without weighted=True, where every "
                "mini-step counts the same. Build it with "
                "`MultiSteps(..., weighted=True)` (and init its state again) "
                "to average the mini-steps by weight."
            )
        return None
    if weight is NO_WEIGHT:
        raise TypeError(
            f"{caller(method, True)[0]} needs `weight=`: this "
            "mini-step's weight, a scalar >= 0 (e.g. its number of "
            "non-padding tokens). The window emits the mean of its gradients "
            "weighted by it."
        )
    if not is_real_scalar(weight):
        raise TypeError(
            f"{caller(method)[0]}'s `weight` must be a real scalar >= 0 (an "
            "int or float, e.g. the mini-step's number of non-padding tokens), "
            f"got {describe_value(weight)}."
        )
    try:
        known = float(np.asarray(weight))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return weight  # traced: not checked (see the docstring)
    if not (known >= 0 and np.isfinite(known)):
        raise ValueError(
            f"{caller(method)[0]}'s `weight` must be finite and >= 0, got "
            f"{known!r}: it is the mini-step's share of the window (e.g. its "
            "number of non-padding tokens)."
        )
    return weight


def check_weight_held(weight: Any, dtype: Any, method: str) -> None:
    """Refuses a known weight that the dtype the window's weights are summed
    in (`state.acc_weight`'s) does not hold: a positive one below its
    smallest normal number, which XLA flushes to 0, or one above its
    largest, which becomes infinity."""
    try:
        known = float(np.asarray(weight))
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    tiny, largest = float(jnp.finfo(dtype).tiny), float(jnp.finfo(dtype).max)
    if 0 < known < tiny or known > largest:
        raise ValueError(
            f"{caller(method)[0]}'s `weight` is {known!r}, which the window's "
            f"weights (summed in {np.dtype(dtype)}, as state.acc_weight) "
            f"do not hold: {np.dtype(dtype)} keeps {tiny:.3g} to "
            f"{largest:.3g}, and XLA flushes a smaller one to 0. "
            "Only the weights' ratios matter: scale them all alike."
        )


def check_weighted(weighted: Any, use_grad_mean: Any) -> bool:
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


def check_state_kind(state: Any, weighted: bool, method: str) -> None:
    """Raises where the state is of the other kind (weighted or not) than
    this `MultiSteps`, or its `acc_weight` is not a float scalar."""
    has = isinstance(state, WeightedMultiStepsState) or hasattr(state, "acc_weight")
    who, state_arg = caller(method, weighted=True)
    if weighted and not has:
        raise TypeError(
            f"{who}'s `{state_arg}` has no acc_weight: "
            f"got {type(state).__name__}, not the WeightedMultiStepsState that "
            "its init returns. Build the state with this MultiSteps' init."
        )
    if not weighted and isinstance(state, WeightedMultiStepsState):
        raise TypeError(
            f"{caller(method)[0]} got a WeightedMultiStepsState (from "
            "MultiSteps(..., weighted=True).init) for a MultiSteps built "
            "without weighted=True; "
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
                f"{who}'s `{state_arg}.acc_weight` must be a float "
                "scalar (as init builds it), got "
                f"{describe_value(value)}."
            )


class Weights(NamedTuple):
    """One weighted mini-step's scalars (`window_weights`)."""

    stored: jax.Array  # the state's running weight, as it came in
    total: jax.Array  # the window's running weight with this mini-step's
    folding: tuple[jax.Array, jax.Array, jax.Array]  # `fold_weighted`'s


def window_weights(acc_weight: jax.Array, weight: Any, mini_step: jax.Array) -> Weights:
    """The running weight after adding `weight`, and how `fold_weighted`
    folds it in (`weighted_fold_terms`). A window's first mini-step starts
    from 0, whatever the state holds."""
    stored = acc_weight if jnp.ndim(acc_weight) == 0 else acc_weight[0]
    dtype = stored.dtype
    if not isinstance(weight, jax.Array):  # a Python or NumPy number: in
        # float directly (JAX would make an int64 an int32 first, wrapping it)
        weight = np.asarray(weight).astype(dtype)
    w = lax.convert_element_type(weight, dtype)
    before = jnp.where(mini_step == 0, jnp.zeros((), dtype), stored)
    total, folding = weighted_fold_terms(before, w)
    return Weights(stored, total, folding)
