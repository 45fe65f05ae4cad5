"""The XLA mechanisms of the accumulation, in one place: each keeps one
backend's compiler from undoing what the code writes. A `MultiSteps` holds
its `Mechanisms`; `configured` switches them off to measure what they buy
(docs/design.md, "Mechanisms per backend")."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jaxtyping import PyTree

from .._leaves import is_typed_key
from .._sharding import (
    aval_varying_axes,
    cast_varying,
    sharded_type,
    typed_sharding,
    varying_axes,
)
from .._static import ConfigKey


@dataclasses.dataclass(frozen=True)
class Mechanisms:
    """Which mechanisms are on (all, by default)."""

    drop_in_conditional_on: frozenset[str] = frozenset({"cpu"})
    scalar_barrier: bool = True
    distinct_zeros: bool = True
    state_after_updates: bool = True
    clear_when_selected: bool = True


def configured(opt: Any, **changes: Any) -> Any:
    """A copy of the `MultiSteps` `opt` with `changes` to its mechanisms
    (for benchmarks and tests), equal to `opt` only where they change
    nothing; its last configuration key is its mechanisms."""
    mechanisms = dataclasses.replace(opt._window.mechanisms, **changes)
    new = copy.copy(opt)
    new._window = opt._window._replace(mechanisms=mechanisms)
    new._key = (*opt._key[:-1], ConfigKey(mechanisms))
    return new


def _first_bits(x: jax.Array) -> jax.Array | None:
    """The bits of the first element of `x` as a uint32 scalar (of its real
    part if complex); `None` where `x` is empty or has no bit cast."""
    if x.size == 0 or not jnp.issubdtype(x.dtype, jnp.number):
        return None
    first = lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), ())
    if jnp.issubdtype(first.dtype, jnp.complexfloating):
        first = lax.real(first)
    width = jnp.dtype(first.dtype).itemsize * 8
    if width not in (8, 16, 32, 64):
        return None
    bits = lax.bitcast_convert_type(first, jnp.dtype(f"uint{width}"))
    return lax.convert_element_type(bits, jnp.uint32)


def read_token(tree: PyTree) -> jax.Array | None:
    """A bool scalar, always `True`, that XLA computes after every array of
    `tree` and cannot fold; `None` where no leaf can be read."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    if any(varying_axes(x) or typed_sharding(x) for x in leaves):
        return None
    bits = [b for b in map(_first_bits, leaves) if b is not None]
    if not bits:
        return None
    # `b | 1 != 0`: true for every value, yet not foldable by XLA.
    v = lax.concatenate([lax.reshape(b, (1,)) for b in bits], 0)
    ones = lax.ne(lax.bitwise_or(v, lax.full_like(v, 1)), lax.full_like(v, 0))
    return lax.optimization_barrier(lax.reduce_and(ones, (0,)))


def _cpu_passes_through(jaxpr: Any) -> dict:
    """Outputs of a platform choice (`lax.platform_dependent`) that XLA:CPU's
    branch returns as they came in: each such output var to its input var."""
    alias = {}
    for eqn in jaxpr.eqns:
        platforms = eqn.params.get("branches_platforms") or ()
        on_cpu = [i for i, p in enumerate(platforms) if p is None or "cpu" in p]
        if eqn.primitive.name != "cond" or not on_cpu:
            continue
        branch = eqn.params["branches"][min(on_cpu, key=lambda i: platforms[i] is None)]
        given = {v: k for k, v in enumerate(branch.jaxpr.invars)}
        for out, inner in zip(eqn.outvars, branch.jaxpr.outvars, strict=True):
            if isinstance(inner, jex_core.Var) and inner in given:
                alias[out] = eqn.invars[1 + given[inner]]
    return alias


def old_value_read_first(
    jaxpr: Any, first_state: int, n_state: int, n_updates: int
) -> list[bool]:
    """For each state output of the inner step's `jaxpr`, whether the
    updates read its old value and not the new one (Lion's `mu`), as
    XLA:CPU will run it."""
    needed = {v for v in jaxpr.outvars[:n_updates] if isinstance(v, jex_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed |= {v for v in eqn.invars if isinstance(v, jex_core.Var)}
    old = jaxpr.invars[first_state : first_state + n_state]
    alias = _cpu_passes_through(jaxpr)
    new = [
        alias.get(n, n) if isinstance(n, jex_core.Var) else n
        for n in jaxpr.outvars[n_updates:]
    ]
    return [
        o in needed and (not isinstance(n, jex_core.Var) or n not in needed)
        for o, n in zip(old, new, strict=True)
    ]


def state_after_updates(
    leaves: list[Any], n_updates: int, to_order: list[bool], on: Mechanisms
) -> list[Any]:
    """On XLA:CPU, each new state array in `to_order` computed after every
    update (or new params) leaf, so that it is written in place."""
    at = [i for i in range(n_updates) if isinstance(leaves[i], jax.Array)]
    ordered = [
        i
        for i in range(n_updates, len(leaves))
        if to_order[i - n_updates]
        and isinstance(leaves[i], jax.Array)
        and leaves[i].size > 1
        and not is_typed_key(leaves[i])
        and jnp.issubdtype(leaves[i].dtype, jnp.number)
    ]
    unreadable = any(varying_axes(x) or typed_sharding(x) for x in leaves)
    if not at or not ordered or unreadable or not on.state_after_updates:
        return leaves

    def after(updates, state):
        updates = lax.optimization_barrier(updates)
        token = read_token(updates)
        if token is None:
            return updates, state
        return updates, [lax.select(token, x, lax.full_like(x, 0)) for x in state]

    updates, state = lax.platform_dependent(
        [leaves[i] for i in at],
        [leaves[i] for i in ordered],
        cpu=after,
        default=lambda u, s: (u, s),
    )
    out = list(leaves)
    for i, x in zip([*at, *ordered], [*updates, *state], strict=True):
        out[i] = x
    return out


def scalar_barrier(
    tree: PyTree, ran: jax.Array, on: Mechanisms
) -> tuple[PyTree, jax.Array]:
    """`tree` and `ran` with `ran` and every scalar leaf of `tree` behind an
    optimization barrier, one per set of mesh axes they vary over."""
    if not on.scalar_barrier:
        return tree, ran
    leaves, treedef = jax.tree.flatten(tree)
    scalars = [
        i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and x.ndim == 0
    ]
    groups: dict[frozenset, list[int]] = {}
    for i in scalars:
        groups.setdefault(varying_axes(leaves[i]) or frozenset(), []).append(i)
    out = list(leaves)
    ran_axes = varying_axes(ran) or frozenset()
    if ran_axes not in groups:
        ran = lax.optimization_barrier(ran)
    for axes, indices in groups.items():
        values = [leaves[i] for i in indices]
        if axes == ran_axes:
            *values, ran = lax.optimization_barrier([*values, ran])
        else:
            values = lax.optimization_barrier(values)
        for i, x in zip(indices, values, strict=True):
            out[i] = x
    return jax.tree.unflatten(treedef, out), ran


# Leaves from this many elements get zeros of their own (`distinct_zeros`).
DISTINCT_ZEROS_MIN_SIZE = 1 << 16


def distinct_zeros(
    avals: list[Any], seed: jax.Array | None, on: Mechanisms
) -> list[jax.Array]:
    """Zeros of `avals`, each large one `float(seed + i) * 0`, which XLA
    neither folds nor merges; plain zeros without a traced `seed`."""
    if not on.distinct_zeros:
        seed = None
    out = []
    for i, aval in enumerate(avals):
        dtype = jnp.dtype(aval.dtype)
        small = math.prod(aval.shape) < DISTINCT_ZEROS_MIN_SIZE
        if seed is None or small or not jnp.issubdtype(dtype, jnp.inexact):
            zero = lax.full((), 0, dtype)
        else:
            real = jnp.finfo(dtype).dtype  # the real part's dtype for complex
            factor = lax.convert_element_type(seed + i, real)
            zero = lax.convert_element_type(factor * lax.full((), 0, real), dtype)
        if sharded_type(aval):  # `Explicit` axes: the sharding is in the type
            z = lax.full(aval.shape, zero, dtype, sharding=aval.sharding)
        else:
            z = lax.broadcast(zero, aval.shape)
        axes = (aval_varying_axes(aval) or frozenset()) - (
            varying_axes(z) or frozenset()
        )
        out.append(cast_varying(z, tuple(sorted(axes))) if axes else z)
    return out


def cleared(pred: jax.Array, tree: PyTree, on: Mechanisms) -> PyTree:
    """`tree` zeroed where `pred`: the drop-in's accumulator where it runs
    selected, as optax.MultiSteps clears it (docs/design.md, "Mechanisms
    per backend")."""
    if not on.clear_when_selected:
        return tree
    return jax.tree.map(lambda a: jnp.where(pred, jnp.zeros_like(a), a), tree)


def per_platform(selected: Callable, conditional: Callable, on: Mechanisms) -> Any:
    """`conditional()` on the platforms `on.drop_in_conditional_on` names
    (where the drop-in keeps its conditional), `selected()` on the others,
    chosen when the program is lowered."""

    def pick(platform: str) -> Callable[[], Any]:
        return conditional if platform in on.drop_in_conditional_on else selected

    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
        return pick(jax.default_backend())()
    forms = {p: pick(p) for p in ("cpu", "cuda", "rocm", "tpu")}
    return lax.platform_dependent(**forms, default=selected)
