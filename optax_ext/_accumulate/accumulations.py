"""`MultiSteps`' accumulations, one class each, each owning its carry
(`acc_grads` and its own scalars, `extra`) from `init` to `finalize`:
`MultiSteps`, the window and the devices never ask which kind they hold."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jaxtyping import PyTree

from .._tree import describe_value
from .accumulator import Accumulator, as_gradient_dtype, weight_dtype
from .arithmetic import is_real_scalar

NO_WEIGHT = object()
UNREAD = (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError)
_MSG_UNWEIGHTED = (
    "{} got weight={}, but this MultiSteps was built without weighted=True, where "
    "every mini-step counts the same. Build it with `MultiSteps(..., weighted=True)` "
    "(and init its state again) to average the mini-steps by weight."
)
_MSG_NEEDS_WEIGHT = (
    "{} needs `weight=`: this mini-step's weight, a scalar >= 0 (e.g. its number of "
    "non-padding tokens). The window weighs the mini-step's gradient by it. A loop "
    "that calls tx.update itself does not pass it on: Flax Linen's "
    "TrainState.apply_gradients sends its keywords to .replace, nnx.Optimizer.update "
    "takes none. Call optax_ext.train_state_apply_gradients(state, grads, weight=n) "
    "(Linen) or optax_ext.nnx_apply_gradients(optimizer, model, grads, weight=n) (NNX)."
)
_MSG_WEIGHT_TYPE = (
    "{}'s `weight` must be a real scalar >= 0 (an int or float, e.g. the "
    "mini-step's number of non-padding tokens), got {}."
)
_MSG_WEIGHT_VALUE = (
    "{}'s `weight` must be finite and >= 0, got {!r}: it is the mini-step's "
    "share of the window (e.g. its number of non-padding tokens)."
)
_MSG_WEIGHT_HELD = (
    "{0}'s `weight` is {1!r}, which the window's weights (summed in {2}, as "
    "state.acc_weight) do not hold: {2} keeps {3:.3g} to {4:.3g}, and XLA flushes a "
    "smaller one to 0. Only the weights' ratios matter: scale them all alike."
)
_MSG_NO_ACC_WEIGHT = (
    "{}'s `{}` has no acc_weight: got {}, not the WeightedMultiStepsState that "
    "its init returns. Build the state with this MultiSteps' init."
)
_MSG_OTHER_KIND = (
    "{} got a WeightedMultiStepsState (from MultiSteps(..., weighted=True).init) for a "
    "MultiSteps built without weighted=True; build both with the same `weighted`."
)
_MSG_AS_OPTAX = (
    "MultiSteps.optax_state got a weighted state: optax.MultiSteps has no weighted "
    "form and would drop its acc_weight (the window's running weight) silently. A "
    "weighted state goes on only in optax_ext.MultiSteps(..., weighted=True)."
)


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


State = optax.MultiStepsState | WeightedMultiStepsState


class Plain:
    """The window's running mean (`mean=True`) or sum of its gradients, in
    `optax.MultiStepsState`; no scalars of its own (`extra` is `()`)."""

    State: Any = optax.MultiStepsState  # optax's fields, then `extra`'s
    weighted = False  # whether a mini-step has a `weight=`
    may_be_empty = False  # whether a window may hold nothing to apply

    def __init__(self, mean: bool):
        self.arithmetic = Accumulator(mean, self.weighted)

    def init(self, acc_grads: PyTree, devices: Any) -> tuple:
        """`extra` at the start."""
        return ()

    def state(self, fields: tuple, extra: tuple) -> State:
        """The state of `fields` (optax's, in order) and `extra`."""
        return self.State(*fields, *extra)

    def extra(self, state: Any) -> tuple:
        """The state's fields after optax's."""
        return tuple(state)[len(optax.MultiStepsState._fields) :]

    def check(self, state: Any, weight: Any, names: tuple) -> Any:
        """A step's `weight=` and the kind of its `state`, checked (`names`:
        the call's and its state argument's); the weight."""
        who = names[0]
        if weight is not NO_WEIGHT:
            raise TypeError(_MSG_UNWEIGHTED.format(who, describe_value(weight)))
        if isinstance(state, WeightedMultiStepsState):
            raise TypeError(_MSG_OTHER_KIND.format(who))
        return None

    def begin(self, extra: tuple, weight: Any, mini_step: jax.Array) -> tuple:
        """The running weight stored, and this mini-step's `Weights`."""
        return None, None

    def fold(self, acc: PyTree, grads: PyTree, step: Any, devices: Any) -> PyTree:
        """`acc` with this mini-step's `grads` folded in (kept if skipped)."""
        fold = self.arithmetic.fold

        def one(g: jax.Array, a: jax.Array) -> jax.Array:
            new = fold(g, a, step.index, step.weights)
            return lax.select(step.should_skip, a, new)

        return jax.tree.map(one, devices.add_axis(grads), acc)

    def ready(self, step: Any) -> jax.Array | None:
        """Whether this device's window holds something to apply."""
        return None

    def finalize(
        self, acc: PyTree, step: Any, devices: Any, dtypes: PyTree
    ) -> tuple[PyTree, jax.Array | None]:
        """The window's gradients, in `dtypes`, over every device; and, per
        device, whether they are to be applied (`None`: they are)."""
        total = None if step.weights is None else step.weights.total
        value, keep = devices.finish(acc, self.arithmetic, total)
        return jax.tree.map(as_gradient_dtype, value, dtypes), keep

    def after(self, step: Any, devices: Any) -> tuple:
        """`extra` after the mini-step `step`."""
        return ()

    def as_optax(self, state: Any) -> Any:
        """`state` as `optax.MultiStepsState`, or an error if it cannot be."""
        if self.weighted or isinstance(state, WeightedMultiStepsState):
            raise TypeError(_MSG_AS_OPTAX)
        return state


class Weighted(Plain):
    """`sum_i w_i g_i / sum_i w_i` (or the sum `sum_i w_i g_i`), in a
    `WeightedMultiStepsState`: `extra` is the running weight `acc_weight`."""

    State = WeightedMultiStepsState
    weighted = may_be_empty = True

    def init(self, acc_grads: PyTree, devices: Any) -> tuple:
        return (devices.add_axis(jnp.zeros((), weight_dtype(acc_grads))),)

    def check(self, state: Any, weight: Any, names: tuple) -> Any:
        who, state_arg = names
        weighted_who = who.replace("MultiSteps.", "MultiSteps(weighted=True).")
        if weight is NO_WEIGHT:
            raise TypeError(_MSG_NEEDS_WEIGHT.format(weighted_who))
        if not is_real_scalar(weight):
            raise TypeError(_MSG_WEIGHT_TYPE.format(who, describe_value(weight)))
        try:
            known = float(np.asarray(weight))
        except UNREAD:
            known = None  # traced: not checked
        if known is not None and not (known >= 0 and np.isfinite(known)):
            raise ValueError(_MSG_WEIGHT_VALUE.format(who, known))
        if not hasattr(state, "acc_weight"):
            got = type(state).__name__
            raise TypeError(_MSG_NO_ACC_WEIGHT.format(weighted_who, state_arg, got))
        value = state.acc_weight
        dtype = getattr(value, "dtype", None)
        floating = dtype is not None and jnp.issubdtype(dtype, jnp.floating)
        if not floating or jnp.shape(value) not in ((), (1,)):
            raise TypeError(
                f"{weighted_who}'s `{state_arg}.acc_weight` must be a "
                f"float scalar (as init builds it), got {describe_value(value)}."
            )
        dtype = jnp.result_type(value)
        tiny, largest = float(jnp.finfo(dtype).tiny), float(jnp.finfo(dtype).max)
        if known is not None and (0 < known < tiny or known > largest):
            held = (who, known, np.dtype(dtype), tiny, largest)
            raise ValueError(_MSG_WEIGHT_HELD.format(*held))
        return weight

    def begin(self, extra: tuple, weight: Any, mini_step: jax.Array) -> tuple:
        """The state's running weight as it came in, and how `weight` folds
        in after it; a window's first mini-step starts from 0."""
        (acc_weight,) = extra
        stored = acc_weight if jnp.ndim(acc_weight) == 0 else acc_weight[0]
        dtype = stored.dtype
        if not isinstance(weight, jax.Array):  # a Python or NumPy number: in
            # float directly (JAX would make an int64 an int32 first, wrapping it)
            weight = np.asarray(weight).astype(dtype)
        w = lax.convert_element_type(weight, dtype)
        before = jnp.where(mini_step == 0, jnp.zeros((), dtype), stored)
        return stored, self.arithmetic.weigh(before, w)

    def ready(self, step: Any) -> jax.Array | None:
        return step.weights.total > 0

    def after(self, step: Any, devices: Any) -> tuple:
        running = jnp.where(step.should_skip, step.stored, step.weights.total)
        acc_weight = jnp.where(step.window_end, jnp.zeros_like(running), running)
        return (devices.add_axis(acc_weight),)
