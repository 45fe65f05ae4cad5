"""The dtypes of gradient accumulation, shared by `microbatched` and `MultiSteps`
(`accumulator_dtype_for`; `work_dtype`, `widen`: float32 for narrow floats), and
the stochastic rounding of float32 to bfloat16 (`round_stochastically`)."""

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree

# Raised by JAX for dtypes it does not promote together (float8 with float32).
PROMOTION_ERROR: type[Exception] = getattr(jax.dtypes, "TypePromotionError", ValueError)


def check_accumulator_dtype(accumulator_dtype: Any, *, complex_ok: bool) -> Any:
    """`accumulator_dtype` as a canonical floating (or complex) dtype, or None."""
    if accumulator_dtype is None:
        return None
    try:
        dtype = jnp.dtype(accumulator_dtype)
    except TypeError:
        dtype = None
    kind = jnp.inexact if complex_ok else jnp.floating
    if dtype is None or not jnp.issubdtype(dtype, kind):
        what = "floating or complex" if complex_ok else "floating"
        raise TypeError(
            f"accumulator_dtype must be a {what} dtype (jnp.float32, the default, "
            f"or wider) or None, got {accumulator_dtype!r}."
        )
    canonical = jax.dtypes.canonicalize_dtype(dtype)
    # Python's float and complex name JAX's default dtypes, as in jnp.zeros.
    named = isinstance(accumulator_dtype, str) or type(accumulator_dtype) is type
    default = named and accumulator_dtype in ("float", "complex", float, complex)
    if canonical != dtype and not default:
        raise ValueError(
            f"accumulator_dtype={dtype} needs 64-bit JAX, without which it is "
            f"{canonical} and the accumulator rounds to it. Enable it before "
            "building the optimizer (`jax.config.update('jax_enable_x64', True)`) "
            f"or pass accumulator_dtype=jnp.{canonical}."
        )
    return canonical


def least_holding(x: Any, other: Any) -> Any:
    """The least dtype holding every value of both (dtypes, or values: a weak one
    as JAX promotes it; float8 by format), or None."""
    try:
        return jnp.result_type(x, other)
    except PROMOTION_ERROR:
        dtypes = jnp.result_type(x), jnp.result_type(other)
    if not all(jnp.issubdtype(d, jnp.inexact) for d in dtypes):
        return None
    for wide, narrow in (dtypes[::-1], dtypes):
        w, n = jnp.finfo(wide), jnp.finfo(narrow)
        if w.nmant >= n.nmant and w.maxexp >= n.maxexp and w.minexp <= n.minexp:
            return jnp.dtype(wide)
    return None


def holds(wide: Any, narrow: Any) -> bool:
    """Whether every value of `narrow` (a dtype or a value) is one of dtype `wide`."""
    least = least_holding(wide, narrow)
    return least is not None and least == wide  # np.dtype(None) is float64


def accumulator_dtype_for(
    leaf: Any, accumulator_dtype: Any, path: str, caller: str, what: str
) -> Any:
    """The dtype `leaf` (an array, Python number or dtype) accumulates in: the
    least holding it and `accumulator_dtype` (without one, float32 for integers)."""
    dtype = jnp.result_type(leaf)
    if accumulator_dtype is None:
        return jnp.dtype(jnp.float32) if jnp.issubdtype(dtype, jnp.integer) else dtype
    if jnp.issubdtype(dtype, jnp.integer):
        return accumulator_dtype
    if (wide := least_holding(leaf, accumulator_dtype)) is not None:
        return wide
    raise TypeError(
        f"{caller}(accumulator_dtype={jnp.dtype(accumulator_dtype)}) cannot accumulate "
        f"{what} at {path or 'the root'} of dtype {dtype}: neither dtype holds every "
        "value of the other. Pass an accumulator_dtype holding both (e.g. "
        "jnp.float32 for float8 values)."
    )


def zero_accumulator(
    params: PyTree, accumulator_dtype: Any, stochastic: bool = False
) -> PyTree:
    """Zeros for each params leaf, in its accumulator's dtype (`MultiSteps`);
    `stochastic`: bfloat16 for every leaf, which a float64 or complex refuses."""
    names = ("MultiSteps", "the params")

    def zeros(path: Any, p: Any) -> jax.Array:
        where, given = jax.tree_util.keystr(path), jnp.result_type(p)
        dtype = accumulator_dtype_for(p, accumulator_dtype, where, *names)
        if stochastic and not rounds_stochastically(given):
            raise TypeError(
                "MultiSteps(stochastic_rounding=True) rounds float32 to bfloat16, "
                f"but the params at {where or 'the root'} have dtype {given}. "
                "Leave stochastic_rounding out for float64 and complex params."
            )
        return jnp.zeros(jnp.shape(p), jnp.bfloat16 if stochastic else dtype)

    return jax.tree_util.tree_map_with_path(zeros, params)


def work_dtype(acc_dtype: Any) -> Any:
    """The dtype a running mean is computed in: float32 for narrower floats."""
    if jnp.issubdtype(acc_dtype, jnp.floating) and jnp.finfo(acc_dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return acc_dtype


def widen(x: jax.Array, dtype: Any) -> jax.Array:
    """`x` converted to `dtype` (the same or wider); a bfloat16 `x` rounded
    by a `reduce_precision` that XLA keeps (docs/design.md)."""
    if x.dtype != jnp.bfloat16 or jnp.dtype(dtype) == x.dtype:
        return lax.convert_element_type(x, dtype)
    fi, exact = jnp.finfo(jnp.bfloat16), lax.convert_element_type(x, jnp.float32)
    exact = lax.reduce_precision(exact, fi.nexp, fi.nmant)
    return lax.convert_element_type(exact, dtype)  # float32 widens exactly


def _mix(x: jax.Array) -> jax.Array:
    """A bijection of uint32 whose every output bit depends on every input
    bit (Wellons' "lowbias32" constants)."""
    for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        x = lax.bitwise_xor(x, lax.shift_right_logical(x, _u32(shift)))
        x = lax.mul(x, _u32(factor))
    return lax.bitwise_xor(x, lax.shift_right_logical(x, _u32(16)))


def _u32(value: Any) -> jax.Array:
    return lax.convert_element_type(value, jnp.uint32)


def seed(*words: Any) -> jax.Array:
    """One uint32 scalar from integer scalars, each changing it all."""
    h = _u32(0x9E3779B9)
    for w in words:
        h = _mix(lax.add(h, _u32(w)))
    return h


def round_stochastically(x: jax.Array, key: jax.Array) -> jax.Array:
    """`x` (float32) in bfloat16, rounded up with probability its fraction of
    an ulp above the value below (no bias), by a hash of `key` and the index."""
    index = lax.reshape(lax.iota(jnp.uint32, x.size), x.shape)
    noise = lax.shift_right_logical(_mix(_mix(lax.add(index, key))), _u32(16))
    bits = lax.add(lax.bitcast_convert_type(x, jnp.uint32), noise)
    up = lax.bitcast_convert_type(lax.bitwise_and(bits, _u32(0xFFFF0000)), jnp.float32)
    return lax.convert_element_type(lax.select(lax.ne(x, x), x, up), jnp.bfloat16)


def rounds_stochastically(dtype: Any) -> bool:
    """Whether values of `dtype` round stochastically to bfloat16 (through float32)."""
    small = jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits <= 32
    return small or jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_
