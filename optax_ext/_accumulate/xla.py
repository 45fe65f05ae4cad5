"""XLA mechanisms that keep a backend's compiler from undoing the code, switched by
`Mechanisms` and `configured` (docs/design.md, "Mechanisms per backend")."""

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jaxtyping import PyTree

from .. import _sharding
from .._static import ConfigKey


@dataclasses.dataclass(frozen=True)
class Mechanisms:
    """Which mechanisms are on (all, by default)."""

    drop_in_conditional_on: frozenset[str] = frozenset({"cpu"})
    scalar_barrier: bool = True
    distinct_zeros: bool = True
    state_after_updates: bool = True
    clear_when_selected_on: frozenset[str] = frozenset({"tpu"})


def configured(opt: Any, **changes: Any) -> Any:
    """A copy of the `MultiSteps` `opt` with `changes` to its mechanisms, and so to
    its key: equal to `opt` only where they change nothing (benchmarks, tests)."""
    mechanisms = dataclasses.replace(opt._window.mechanisms, **changes)
    new = copy.copy(opt)
    new._window = opt._window._replace(mechanisms=mechanisms)
    new._key = (*opt._key[:-1], ConfigKey(mechanisms))
    return new


def read_token(tree: PyTree) -> jax.Array | None:
    """A bool scalar, always `True`, that XLA computes after every array of
    `tree` (none sharded) and cannot fold; `None` where no leaf can be read."""
    leaves = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    bits = []  # each first element's (its real part's), as uint32
    for x in [y for y in leaves if y.size and jnp.issubdtype(y.dtype, jnp.number)]:
        first = jnp.real(lax.reshape(lax.slice(x, (0,) * x.ndim, (1,) * x.ndim), ()))
        if (width := jnp.dtype(first.dtype).itemsize * 8) in (8, 16, 32, 64):
            first = lax.bitcast_convert_type(first, jnp.dtype(f"uint{width}"))
            bits.append(lax.convert_element_type(first, jnp.uint32))
    if not bits:
        return None
    # `b | 1 != 0`: true for every value, yet not foldable by XLA.
    v = lax.concatenate([lax.reshape(b, (1,)) for b in bits], 0)
    ones = lax.ne(lax.bitwise_or(v, lax.full_like(v, 1)), lax.full_like(v, 0))
    return lax.optimization_barrier(lax.reduce_and(ones, (0,)))


def old_value_read_first(jaxpr: Any, old: list, n_updates: int) -> list[bool]:
    """Per state input `old` of `jaxpr`, whether on XLA:CPU the updates read only
    it, not the state's new value (Lion's `mu`)."""
    var = lambda v: isinstance(v, jex_core.Var)  # not a literal
    alias = {}  # platform choices' outputs that XLA:CPU's branch passes through
    for eqn in jaxpr.eqns:
        platforms = eqn.params.get("branches_platforms") or ()
        on_cpu = [i for i, p in enumerate(platforms) if p is None or "cpu" in p]
        if eqn.primitive.name != "cond" or not on_cpu:
            continue
        branch = eqn.params["branches"][min(on_cpu, key=lambda i: platforms[i] is None)]
        given = {v: k for k, v in enumerate(branch.jaxpr.invars)}
        for out, inner in zip(eqn.outvars, branch.jaxpr.outvars, strict=True):
            if var(inner) and inner in given:
                alias[out] = eqn.invars[1 + given[inner]]
    needed = set(filter(var, jaxpr.outvars[:n_updates]))
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            needed |= set(filter(var, eqn.invars))
    new = [alias.get(n, n) if var(n) else n for n in jaxpr.outvars[n_updates:]]
    only_old = lambda o, n: o in needed and not (var(n) and n in needed)
    return [only_old(o, n) for o, n in zip(old, new, strict=True)]


def state_after_updates(leaves: list, to_order: list[bool], on: Mechanisms) -> list:
    """On XLA:CPU, `to_order`'s states (the last leaves) after all updates, in place."""
    n_updates = len(leaves) - len(to_order)
    number = lambda x: x.size > 1 and jnp.issubdtype(x.dtype, jnp.number)  # no key
    ordered = [i for i, o in enumerate(to_order, n_updates) if o and number(leaves[i])]
    if not ordered or not on.state_after_updates:
        return leaves
    if any(_sharding.varying_axes(x) or _sharding.typed_sharding(x) for x in leaves):
        return leaves

    def after(updates, state):
        updates = lax.optimization_barrier(updates)
        if (token := read_token(updates)) is not None:
            state = [lax.select(token, x, lax.full_like(x, 0)) for x in state]
        return updates, state

    operands = (leaves[:n_updates], [leaves[i] for i in ordered])
    updates, state = lax.platform_dependent(*operands, cpu=after, default=lambda *a: a)
    new = dict(zip([*range(n_updates), *ordered], [*updates, *state], strict=True))
    return [new.get(i, x) for i, x in enumerate(leaves)]


def scalar_barrier(tree: PyTree, on: Mechanisms) -> PyTree:
    """The scalars of `tree` behind one barrier per set of varying axes."""
    if not on.scalar_barrier:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    groups: dict[frozenset, list[int]] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, jax.Array) and x.ndim == 0:
            groups.setdefault(_sharding.varying_axes(x) or frozenset(), []).append(i)
    for indices in groups.values():
        values = lax.optimization_barrier([leaves[i] for i in indices])
        for i, x in zip(indices, values, strict=True):
            leaves[i] = x
    return jax.tree.unflatten(treedef, leaves)


DISTINCT_ZEROS_MIN_SIZE = 1 << 16  # from this many elements, a leaf's own zeros


def distinct_zeros(avals: list, seed: jax.Array, on: Mechanisms) -> list[jax.Array]:
    """Zeros of `avals`, each large inexact one `float(seed + i) * 0`, which XLA
    neither folds nor merges (`on.distinct_zeros`; else plain zeros)."""
    out = []
    for i, aval in enumerate(avals):
        dtype, small = aval.dtype, aval.size < DISTINCT_ZEROS_MIN_SIZE
        if not on.distinct_zeros or small or not jnp.issubdtype(dtype, jnp.inexact):
            zero = lax.full((), 0, dtype)
        else:
            real = jnp.finfo(dtype).dtype  # the real part's dtype for complex
            factor = lax.convert_element_type(seed + i, real)
            zero = lax.convert_element_type(factor * lax.full((), 0, real), dtype)
        explicit = aval.sharding if _sharding.sharded_type(aval) else None
        z = lax.full(aval.shape, zero, dtype, sharding=explicit)
        axes = _sharding.aval_varying_axes(aval) or set()
        axes -= _sharding.varying_axes(z) or set()
        out.append(_sharding.cast_varying(z, tuple(sorted(axes))) if axes else z)
    return out


def cleared(pred: jax.Array, tree: PyTree, clear: bool) -> PyTree:
    """`tree` zeroed where `pred` if `clear`, as optax.MultiSteps clears it."""
    if not clear:
        return tree
    return jax.tree.map(lambda a: jnp.where(pred, jnp.zeros_like(a), a), tree)


def per_platform(selected: Callable, conditional: Callable, on: Mechanisms) -> Any:
    """`conditional()` on the platforms `on.drop_in_conditional_on` names, else
    `selected(clear)`, `clear` on `on.clear_when_selected_on`'s; chosen when
    the program is lowered."""

    def pick(platform: str | None) -> Callable:
        if platform in on.drop_in_conditional_on:
            return conditional
        return lambda: selected(platform in on.clear_when_selected_on)

    forms = {p: pick(p) for p in ("cpu", "cuda", "rocm", "tpu")}
    return lax.platform_dependent(**forms, default=pick(None))
