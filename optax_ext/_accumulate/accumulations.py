"""`MultiSteps`' accumulations, a class each, owning its carry (`acc_grads`
and a dict of its state fields after optax's) from `init` to `finalize`; a
part (`NoiseScale`) adds one field to a kind."""

import functools
import itertools
from collections import namedtuple
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jaxtyping import PyTree

from .._tree import describe_value, is_real_scalar
from .accumulator import Accumulator, as_gradient_dtype, weight_dtype
from .arithmetic import seed, work_dtype

NO_WEIGHT = object()


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


State = Any  # `state_type(fields)` for the kind's `fields`
OPTAX_FIELDS = optax.MultiStepsState._fields


@functools.cache
def state_type(fields: tuple[str, ...]) -> Any:
    """The state's NamedTuple: `optax.MultiStepsState`'s fields, then `fields`."""
    known = {(): optax.MultiStepsState, ("acc_weight",): WeightedMultiStepsState}
    if (found := known.get(fields)) is None:
        found = namedtuple("MultiStepsState", OPTAX_FIELDS + fields)
        found.__reduce__ = lambda state: (_built_state, (fields, tuple(state)))
    return found


def _built_state(fields: tuple[str, ...], values: tuple) -> Any:
    """A built state as pickle loads it (pickle finds a class by a name it lacks)."""
    return state_type(fields)(*values)


class Plain:
    """The window's running mean (`mean=True`) or sum of its gradients, in
    `optax.MultiStepsState` (with each part's field after optax's); with
    `stochastic`, each fold rounds to the bfloat16 accumulator without bias."""

    fields: tuple[str, ...] = ()  # its own, before its parts'
    weighted = False  # whether a mini-step has a `weight=`

    def __init__(self, mean: bool, parts: tuple = (), stochastic: bool = False):
        self.arithmetic = Accumulator(mean, self.weighted)
        self.parts, self.stochastic = parts, stochastic
        self.own = self.fields + tuple(p.field for p in parts)  # after optax's

    def init(self, acc_grads: PyTree) -> dict:
        """The carry (besides `acc_grads`) at the start, without the devices' axis."""
        return {p.field: p.init() for p in self.parts}

    def state(self, fields: tuple, carry: dict) -> State:
        """The state of optax's `fields` and the `carry`."""
        return state_type(self.own)(*fields, *(carry[n] for n in self.own))

    def carry(self, state: Any) -> dict:
        """The state's fields after optax's."""
        return dict(zip(state._fields[len(OPTAX_FIELDS) :], state[5:], strict=True))

    def check(self, state: Any, weight: Any, who: str, state_arg: str) -> Any:
        """The step's `weight=`, checked with its state (`who` calls it `state_arg`)."""
        if weight is not NO_WEIGHT:
            raise TypeError(
                f"{who} got weight={describe_value(weight)}, but this MultiSteps "
                "was built without weighted=True: build it with `MultiSteps(..., "
                "weighted=True)` and init its state again to weigh the mini-steps."
            )
        have = tuple(getattr(state, "_fields", ()))[len(OPTAX_FIELDS) :]
        if have != self.own:
            missing = [f for f in self.own if f not in have]
            lacks = f"no {missing[0]}" if missing else "other fields"
            raise TypeError(
                f"{who}'s `{state_arg}` has {lacks}: got a "
                f"{type(state).__name__} with the fields {list(have)} after optax's, "
                f"where this MultiSteps' init returns {list(self.own)}. Build both "
                "with the same arguments (weighted=, noise_scale=) or use this init."
            )

    def begin(self, carry: dict, weight: Any, mini_step: jax.Array) -> Any:
        """This mini-step's `Weights` (`None`: it counts as one)."""

    def fold(
        self, acc: PyTree, carry: dict, inputs: Any, step: Any, devices: Any
    ) -> tuple[PyTree, dict]:
        """`acc` and the carry after this mini-step (kept if it is skipped)."""
        leaf, fold, on = itertools.count(), self.arithmetic.fold, self.stochastic
        at = (step.gradient_step, step.index, devices.index()) if on else None

        def one(g: jax.Array, a: jax.Array) -> jax.Array:
            key = None if at is None else seed(*at, next(leaf))
            new = fold(g, a, step.index, step.weights, key)
            return lax.select(inputs.should_skip, a, new)

        acc = jax.tree.map(one, devices.add_axis(inputs.grads), acc)
        for p in self.parts:
            carry = {**carry, p.field: p.fold(carry[p.field], inputs, step)}
        return acc, carry

    def ready(self, step: Any) -> jax.Array | None:
        """Whether this device's window holds something to apply (`None`: it
        always does; else, with `axis_name`, `finalize` decides over the devices)."""
        return None if step.weights is None else step.weights.total > 0

    def reports(self, carry: dict) -> dict:
        """The fields `finalize` writes (with the window's end, in its branch)."""
        return {p.field: carry[p.field] for p in self.parts}

    def finalize(
        self, acc: PyTree, reports: dict, step: Any, devices: Any, dtypes: PyTree
    ) -> tuple[PyTree, jax.Array | None, dict]:
        """The window's gradients over every device, in `dtypes`; whether this
        device applies them (`None`: it does); the `reports` after the window."""
        total = None if step.weights is None else step.weights.total
        value, keep = devices.finish(acc, self.arithmetic, total, dtypes)
        for p in self.parts:
            new = p.finalize(reports[p.field], value, self.arithmetic, devices)
            reports = {**reports, p.field: new}
        return jax.tree.map(as_gradient_dtype, value, dtypes), keep, reports

    def as_optax(self, state: Any) -> Any:
        """`state` as `optax.MultiStepsState`, or an error if it cannot be."""
        if hasattr(state, "acc_weight"):
            raise TypeError(
                "MultiSteps.optax_state got a weighted state: optax.MultiSteps has no "
                "weighted form and would drop its acc_weight (the window's running "
                "weight) silently; it goes on only in MultiSteps(..., weighted=True)."
            )
        return optax.MultiStepsState(*state[:5])


class Weighted(Plain):
    """`sum_i w_i g_i / sum_i w_i` (or the sum `sum_i w_i g_i`), in a
    `WeightedMultiStepsState`: the carry holds the running weight `acc_weight`."""

    fields = ("acc_weight",)
    weighted = True

    def init(self, acc_grads: PyTree) -> dict:
        acc_weight = jnp.zeros((), weight_dtype(acc_grads))
        return {"acc_weight": acc_weight, **super().init(acc_grads)}

    def check(self, state: Any, weight: Any, who: str, state_arg: str) -> Any:
        who = who.replace("MultiSteps.", "MultiSteps(weighted=True).")
        if weight is NO_WEIGHT:
            raise TypeError(
                f"{who} needs `weight=`, the mini-step's weight: a scalar >= 0 (e.g. "
                "its non-padding tokens). Flax's TrainState.apply_gradients and "
                "nnx.Optimizer.update do not pass it on: call "
                "optax_ext.train_state_apply_gradients(state, grads, weight=n) or "
                "optax_ext.nnx_apply_gradients(optimizer, model, grads, weight=n)."
            )
        if not is_real_scalar(weight):
            raise TypeError(
                f"{who}'s `weight` must be a real scalar >= 0 (an int or float, e.g. "
                f"the mini-step's non-padding tokens), got {describe_value(weight)}."
            )
        traced = isinstance(weight, jax.core.Tracer)  # then not checked
        known = None if traced else float(np.asarray(weight))
        if known is not None and not (known >= 0 and np.isfinite(known)):
            raise ValueError(
                f"{who}'s `weight` must be finite and >= 0, got {known!r}: it is the "
                "mini-step's share of the window (e.g. its non-padding tokens)."
            )
        super().check(state, NO_WEIGHT, who, state_arg)
        value = state.acc_weight
        dtype = getattr(value, "dtype", np.dtype(object))
        if not (jnp.issubdtype(dtype, jnp.floating) and np.shape(value) in ((), (1,))):
            raise TypeError(
                f"{who}'s `{state_arg}.acc_weight` must be a float scalar (as "
                f"init builds it), got {describe_value(value)}."
            )
        tiny, top = float(jnp.finfo(dtype).tiny), float(jnp.finfo(dtype).max)
        if known is not None and (0 < known < tiny or known > top):
            raise ValueError(
                f"{who}'s `weight` is {known!r}, which the window's weights (summed "
                f"in {np.dtype(dtype)}, as state.acc_weight) do not hold: "
                f"{np.dtype(dtype)} keeps {tiny:.3g} to {top:.3g}, and XLA flushes a "
                "smaller one to 0. Only the weights' ratios matter: scale them alike."
            )
        return weight

    def begin(self, carry: dict, weight: Any, mini_step: jax.Array) -> Any:
        """How `weight` folds in after the running weight (0 at a window's start)."""
        stored = jnp.reshape(carry["acc_weight"], ())
        if not isinstance(weight, jax.Array):  # JAX would wrap an int64 to int32
            weight = np.asarray(weight).astype(stored.dtype)
        w = lax.convert_element_type(weight, stored.dtype)
        before = jnp.where(mini_step == 0, jnp.zeros((), stored.dtype), stored)
        return self.arithmetic.weigh(before, w)

    def fold(
        self, acc: PyTree, carry: dict, inputs: Any, step: Any, devices: Any
    ) -> tuple[PyTree, dict]:
        acc, carry = super().fold(acc, carry, inputs, step, devices)
        stored = jnp.reshape(carry["acc_weight"], ())
        running = jnp.where(inputs.should_skip, stored, step.weights.total)
        acc_weight = jnp.where(step.window_end, jnp.zeros_like(running), running)
        return acc, {**carry, "acc_weight": devices.add_axis(acc_weight)}


class NoiseScaleState(NamedTuple):
    """`MultiSteps(..., noise_scale=True)`'s float32 scalars (with
    `axis_name`, this device's, of shape `(1,)`): the window's sums so far,
    and the estimates from the last completed window."""

    sum_squares: jax.Array  # sum_i w_i |g_i|^2
    weight: jax.Array  # sum_i w_i (each w_i 1 unweighted)
    count: jax.Array  # the micro-batches folded in (of weight > 0)
    squared_norm: jax.Array  # |G|^2, unbiased (NaN before a window of 2)
    trace: jax.Array  # tr(Sigma) of one micro-batch (of a unit of weight)


class NoiseScale:
    """The gradient noise scale's estimates from each window (McCandlish et
    al. 2018, appendix A). With `n` micro-batch gradients `g_i` of weights
    `w_i` (1 each unweighted; over every device), `W = sum w_i`, `S = sum
    w_i |g_i|^2` and the window's mean `G_W`: `E S = W |G|^2 + n tr(Sigma)`
    and `E W |G_W|^2 = W |G|^2 + tr(Sigma)`, solved for both."""

    field = "noise_scale"

    @staticmethod
    def _squares(tree: PyTree) -> jax.Array:
        """`sum |x|^2` over `tree`'s leaves, in float32 (or wider)."""
        wide = [jnp.abs(x.astype(work_dtype(x.dtype))) for x in jax.tree.leaves(tree)]
        return sum((jnp.sum(jnp.square(x)) for x in wide), jnp.zeros((), jnp.float32))

    def init(self) -> NoiseScaleState:
        zero, nan = jnp.zeros((), jnp.float32), jnp.full((), jnp.nan, jnp.float32)
        return NoiseScaleState(zero, zero, zero, nan, nan)

    def fold(self, c: NoiseScaleState, inputs: Any, step: Any) -> NoiseScaleState:
        w = jnp.float32(1 if inputs.weight is None else inputs.weight)
        counts = jnp.logical_and(jnp.logical_not(inputs.should_skip), w > 0)
        terms = (w * self._squares(inputs.grads), w, jnp.ones((), jnp.float32))
        bases = [jnp.where(step.index == 0, jnp.zeros_like(x), x) for x in c[:3]]
        sums = [jnp.where(counts, b + t, b) for b, t in zip(bases, terms, strict=True)]
        return NoiseScaleState(*sums, c.squared_norm, c.trace)

    def finalize(self, c: Any, value: PyTree, arithmetic: Any, devices: Any) -> Any:
        (s, w, n), size = devices.total(tuple(c[:3]))
        if not arithmetic.mean:  # the window's mean from its sum
            by = w if arithmetic.weighted else n / size
            value = jax.tree.map(lambda v: v / by, value)
        g2 = self._squares(value)
        trace = (s - w * g2) / (n - 1)
        nan = jnp.full((), jnp.nan, jnp.float32)
        norm, trace = (jnp.where(n > 1, e, nan) for e in (g2 - trace / w, trace))
        return c._replace(squared_norm=norm, trace=trace)


def gradient_noise_scale(state: Any) -> tuple[jax.Array, jax.Array]:
    """The gradient noise scale's two estimates from the last completed
    window of a `MultiSteps(..., noise_scale=True)`'s `state`.

    **Arguments:**

    - `state`: its state (with `axis_name`: a device's, or all stacked).

    **Returns:**

    `(squared_norm, trace)`, float32 scalars: unbiased estimates of `|G|^2`
    and of the trace of one micro-batch gradient's covariance (of a unit of
    weight, weighted), over every device (McCandlish et al. 2018, appendix
    A); NaN before a window of two micro-batches. `trace / squared_norm` is
    `B_simple`; smooth both first (`docs/multi_steps.md`).
    """
    carry = getattr(state, "noise_scale", None)
    if not isinstance(carry, NoiseScaleState):
        raise TypeError(
            "optax_ext.gradient_noise_scale needs the state of a MultiSteps(..., "
            f"noise_scale=True), whole, not its inner_opt_state; got "
            f"{describe_value(state)}."
        )
    return tuple(jnp.reshape(x, (-1,))[0] for x in carry[3:])
