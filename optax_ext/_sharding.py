"""State leaves that mirror a param get that param's sharding.

An optimizer's `init` builds its moments with `jnp.zeros_like(param)` (or, as
`MultiSteps` needs for its accumulator, `jnp.zeros(shape, dtype)`). Under
`jax.jit` those zeros carry no sharding of their own:

- with `Explicit` mesh axes (the default of `jax.make_mesh` since jax 0.7)
  the sharding is part of the type: `zeros_like` keeps it, `zeros(shape)`
  gives a replicated array;
- with `Auto` axes, or sharded arrays and no mesh set, the sharding of a
  traced param is unknown while tracing, and XLA replicates a constant that
  depends on no input: `jax.jit(optax.adam(1e-3).init)` returns replicated
  moments for sharded params, one full copy per device.

`mirror_param_sharding` fixes both without asking the user for shardings.
With the sharding in the type it calls `jax.sharding.reshard`. Without it,
it adds to the leaf an exact zero computed elementwise from the param; XLA's
sharding propagation then gives the leaf the param's layout, as it would an
elementwise function of the param. This runs once, in `init`, and only when
the process has several devices.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.core import Tracer
from jaxtyping import PyTree

from ._tree import cast_like


def _is_hole(x: Any) -> bool:
    """A place in a tree where a param leaf may be missing in a state."""
    return x is None or isinstance(x, optax.MaskedNode)


def typed_sharding(x: Any) -> Any:
    """The sharding that is part of `x`'s type, or None if it shards nothing."""
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    spec = getattr(sharding, "spec", None)
    if spec is None or all(axis is None for axis in spec):
        return None
    return sharding


def _exact_zero_like(param: jax.Array, dtype: Any) -> jax.Array:
    """Zeros of `dtype` with `param`'s shape, computed elementwise from `param`.

    `param != param` is a bool; converted and multiplied by zero it is `+0`
    for every entry (no NaN from `nan * 0`, no `-0` from a negative param).
    XLA does not fold a floating-point multiply by zero, so the dependence
    on the param survives until sharding propagation.
    """
    float_dtype = param.dtype if jnp.issubdtype(param.dtype, jnp.floating) else None
    flag = (param != param).astype(float_dtype or jnp.float32)
    return (flag * 0).astype(dtype)


def _mirror_leaf(leaf: Any, param: Any) -> Any:
    if not (isinstance(leaf, jax.Array) and isinstance(param, jax.Array)):
        return leaf
    if leaf.shape != param.shape or not jnp.issubdtype(leaf.dtype, jnp.number):
        return leaf  # factored moments, counts, bools and keys keep theirs
    if not isinstance(param, Tracer) and not isinstance(leaf, Tracer):
        if leaf.sharding == param.sharding:
            return leaf
        return jax.device_put(leaf, param.sharding)
    typed = typed_sharding(param)
    if typed is not None:
        return jax.sharding.reshard(leaf, typed)
    if not isinstance(param, Tracer):
        return leaf
    if jax.device_count() == 1:
        return leaf
    return cast_like(lax.add(leaf, _exact_zero_like(param, leaf.dtype)), leaf)


def mirror_param_sharding(state: PyTree, params: PyTree) -> PyTree:
    """Gives every subtree of `state` that has the structure of `params` (a
    `None` or `optax.MaskedNode` standing for a missing leaf) the params'
    shardings, leaf by leaf, where a state leaf has its param's shape."""
    skeleton = jax.tree.structure(params, is_leaf=_is_hole)
    if skeleton.num_leaves == 0:
        return state
    param_leaves = jax.tree.leaves(params, is_leaf=_is_hole)

    def mirrors(node: Any) -> bool:
        return jax.tree.structure(node, is_leaf=_is_hole) == skeleton

    def fix(node: Any) -> Any:
        if not mirrors(node):
            return node
        leaves = jax.tree.leaves(node, is_leaf=_is_hole)
        fixed = [_mirror_leaf(s, p) for s, p in zip(leaves, param_leaves, strict=True)]
        return jax.tree.unflatten(skeleton, fixed)

    return jax.tree.map(fix, state, is_leaf=mirrors)


def zeros_like_struct(struct: Any, dtype: Any = None) -> jax.Array:
    """Zeros with the shape, dtype (or `dtype`) and, where it is part of the
    type (`Explicit` mesh axes), the sharding of a `jax.ShapeDtypeStruct`."""
    dtype = struct.dtype if dtype is None else dtype
    if sharded_type(struct):
        return jnp.zeros(struct.shape, dtype, out_sharding=struct.sharding)
    return jnp.zeros(struct.shape, dtype)


def shards_over(tree: PyTree, axes: Any) -> bool:
    """Whether a leaf of `tree` is split, in its type, over one of the mesh
    axes `axes` (a name or a tuple of names)."""
    names = set(axis_names(axes))
    for x in jax.tree.leaves(tree):
        sharding = typed_sharding(x)
        for entry in () if sharding is None else sharding.spec:
            entry = axis_names(entry)
            if names.intersection(entry):
                return True
    return False


def split_leading(x: jax.Array, k: int) -> jax.Array:
    """`x` with its leading axis of `n` rows reshaped to `(n // k, k)`: row
    `a * k + j` at `[a, j]`. A leading axis split in `x`'s type stays split
    in the first of the two (JAX asks for that sharding explicitly)."""
    shape = (x.shape[0] // k, k, *x.shape[1:])
    sharding = typed_sharding(x)
    if sharding is None:
        return x.reshape(shape)
    spec = jax.sharding.PartitionSpec(sharding.spec[0], None, *sharding.spec[1:])
    return jax.lax.reshape(
        x, shape, out_sharding=jax.sharding.NamedSharding(sharding.mesh, spec)
    )


def sharded_type(struct: Any) -> bool:
    """Whether a `jax.ShapeDtypeStruct`'s sharding names a mesh axis (part of
    its type on `Explicit` axes)."""
    spec = getattr(getattr(struct, "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def varying_axes(x: Any) -> frozenset | None:
    """The mesh axes along which `x` may differ between devices inside
    `jax.shard_map` (its type's `vma`); None where the type does not say."""
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval: Any) -> frozenset | None:
    """`varying_axes` of a value of type `aval`."""
    vma = getattr(aval, "vma", None)  # jax < 0.9
    if vma is None:  # jax >= 0.9
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return None if vma is None else frozenset(vma)


def summed_axes(axes: frozenset, like_axes: frozenset, names: tuple) -> tuple:
    """Those of the mesh axes `names` that a value varying over `like_axes`
    (its accumulator) varies over and one varying over `axes` does not:
    that one is the same on every device there, as `jax.grad` with respect
    to a replicated value makes it (it sums over the devices)."""
    return tuple(n for n in names if n in like_axes and n not in axes)


def axis_names(axes: Any) -> tuple:
    """Mesh axis names as a tuple: `axes` is one name or a tuple of them
    (as `axis_name` arguments and `PartitionSpec` entries are)."""
    return tuple(axes) if isinstance(axes, tuple) else (axes,)


def manual_axes(names: tuple) -> tuple:
    """Those of the mesh axes `names` that are bound here by `jax.shard_map`
    (`Manual` in the abstract mesh): the only axes a value can be typed as
    varying over. A `jax.vmap` axis is bound but not one of them."""
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return tuple(n for n in names if types.get(n) == jax.sharding.AxisType.Manual)


def cast_varying(x: jax.Array, axes: tuple) -> jax.Array:
    """`x` typed as differing across the mesh axes `axes` inside
    `jax.shard_map` (`jax.lax.pcast(..., to="varying")`, which jax 0.8 calls
    `jax.lax.pvary`)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pyright: ignore[reportAttributeAccessIssue]  # jax < 0.9


def varying_call(name: Any) -> str:
    """How the user writes `cast_varying` of params over the axis `name`
    with the installed JAX (for error messages)."""
    if hasattr(jax.lax, "pcast"):
        return f"jax.lax.pcast(params, {name!r}, to='varying')"
    return f"jax.lax.pvary(params, {name!r})"
