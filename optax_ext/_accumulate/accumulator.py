"""One accumulator for `MultiSteps` and `microbatched`, so both compute the
same: how a value folds in (`Accumulator`, `Count`, `AnyOf`, `Rows`) and how
the devices' accumulators meet after the last fold."""

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from .arithmetic import round_stochastically, widen, work_dtype


class Weights(NamedTuple):
    """One weighted fold's scalars (`Accumulator.weigh`)."""

    total: jax.Array  # the running weight, this value's included
    first: jax.Array  # no weight came before: the value is selected
    nothing: jax.Array  # this value's weight is 0: it is not read
    scale: jax.Array  # `total / w` for the mean, `w` for the sum


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """The running mean (`mean=True`) or sum of the values, maybe weighted."""

    mean: bool = True
    weighted: bool = False

    def weigh(self, before: jax.Array, weight: jax.Array) -> Weights:
        """The scalars of folding a value of `weight` after `before`."""
        total = before + weight
        nothing = weight == 0
        scale = weight
        if self.mean:
            scale = total / jnp.where(nothing, jnp.ones_like(weight), weight)
        return Weights(total, before == 0, nothing, scale)

    def fold(
        self,
        g: Any,
        acc: jax.Array,
        index: jax.Array,
        w: Weights | None,
        key: Any = None,
    ) -> jax.Array:
        """`acc` with `g` folded in as the `index`-th value (from 0), the first
        selected: Welford's mean `acc + (g - acc) / (index + 1)` or the sum;
        with `Weights` `w`, `acc + (g - acc) / (W / w)` or `acc + w g`, a
        weight of 0 not read. Rounded to nearest, or with `key` stochastically."""
        # lax, not jnp: no per-leaf `jit` of jnp's functions to trace and inline.
        work = work_dtype(acc.dtype)
        g = widen(jnp.asarray(g), work)
        old = lax.convert_element_type(acc, work)
        scale = lax.convert_element_type(index + 1 if w is None else w.scale, work)
        if w is not None:
            scale = lax.broadcast(scale, old.shape)
        value = lax.mul(g, scale) if w is not None and not self.mean else g
        running = lax.add(old, lax.div(lax.sub(g, old), scale) if self.mean else value)
        running = lax.select(index == 0 if w is None else w.first, value, running)
        if key is not None:  # to bfloat16, the accumulator's dtype
            running = round_stochastically(running, key)
        new = lax.convert_element_type(running, acc.dtype)
        return new if w is None else lax.select(w.nothing, acc, new)

    def part(self, acc: jax.Array, weight: jax.Array | None) -> jax.Array:
        """This device's share of the all-reduce, in at least float32."""
        if not self.weighted:
            return acc.astype(work_dtype(acc.dtype))
        assert weight is not None
        wide = acc.astype(jnp.promote_types(work_dtype(acc.dtype), weight.dtype))
        if self.mean:
            wide = wide * weight.astype(wide.dtype)
        return jnp.where(weight > 0, wide, jnp.zeros_like(wide))

    def whole(self, summed: jax.Array, total: jax.Array | None, devices: int) -> Any:
        """The accumulation over every device from the sum of their `part`s."""
        if not self.weighted:
            return summed / devices
        if not self.mean:
            return summed
        assert total is not None
        safe = jnp.where(total > 0, total, jnp.ones_like(total))
        return summed / safe.astype(summed.dtype)


class Count:
    """An integer output: summed over micro-batches and devices."""

    def fold(self, out: Any, acc: Any, j: Any, weights: Any) -> jax.Array:
        return Accumulator(mean=False).fold(out, acc, j, None)

    def part(self, acc: jax.Array, weight: Any) -> jax.Array:
        return acc

    def whole(self, summed: jax.Array, total: Any, devices: int) -> jax.Array:
        return summed


class AnyOf:
    """A bool output: whether it held on any micro-batch of any device."""

    def fold(self, out: Any, acc: Any, j: Any, weights: Any) -> jax.Array:
        return jnp.logical_or(acc, out)

    def part(self, acc: jax.Array, weight: Any) -> jax.Array:
        return acc.astype(jnp.int32)

    def whole(self, summed: jax.Array, total: Any, devices: int) -> jax.Array:
        return summed > 0


class Rows:
    """A per-example output: each micro-batch's rows, as they are."""

    def fold(self, out: Any, acc: Any, j: Any, weights: Any) -> jax.Array:
        return lax.dynamic_update_index_in_dim(acc, out, j, axis=1)


class GradientRows(Rows):
    """Rows of a gradient with respect to the batch, scaled by their share."""

    def __init__(self, accumulator: Accumulator):
        self.accumulator = accumulator


def reduce_across(
    kinds: list, accs: list, weight: jax.Array | None, axis_name: Any
) -> tuple[list, jax.Array | None]:
    """Each device's accumulators (`weight`: its weight) over every device
    along `axis_name` in one all-reduce, `part`s summed, then `whole` (`Rows`
    kept as they are); and the weights' sum (`None` unweighted)."""
    pairs = list(zip(kinds, accs, strict=True))
    parts = [k.part(a, weight) for k, a in pairs if not isinstance(k, Rows)]
    parts, weight = lax.psum((parts, weight), axis_name)
    n, summed = lax.axis_size(axis_name), iter(parts)
    return [
        a if isinstance(k, Rows) else k.whole(next(summed), weight, n) for k, a in pairs
    ], weight


def weight_dtype(accumulators: Any) -> Any:
    """float64 where an accumulator works in 64 bits (complex128 too), else float32."""
    leaves = jax.tree.leaves(accumulators)
    wide = any(jnp.finfo(work_dtype(jnp.result_type(a))).bits == 64 for a in leaves)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def as_gradient_dtype(value: jax.Array, dtype: Any) -> jax.Array:
    """An accumulated value back in the gradients' `dtype` (real or complex)."""
    if jnp.iscomplexobj(value) and not jnp.issubdtype(dtype, jnp.complexfloating):
        value = lax.real(value)
    return value.astype(dtype)
