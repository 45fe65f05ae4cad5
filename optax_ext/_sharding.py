"""State that mirrors a param gets its sharding (docs/data_parallel.md); mesh axes."""

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
    return None if spec is None or all(axis is None for axis in spec) else sharding


def _exact_zero_like(param: jax.Array, dtype: Any) -> jax.Array:
    """`+0` of `dtype` per entry of `param`, computed from it: XLA does not
    fold a float multiply by zero, so sharding propagation sees the param."""
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
    if not isinstance(param, Tracer) or jax.device_count() == 1:
        return leaf
    return cast_like(lax.add(leaf, _exact_zero_like(param, leaf.dtype)), leaf)


def mirror_param_sharding(state: PyTree, params: PyTree) -> PyTree:
    """`state`'s subtrees shaped like `params` (holes allowed) given their shardings."""
    skeleton = jax.tree.structure(params, is_leaf=_is_hole)
    if skeleton.num_leaves == 0:
        return state
    param_leaves = jax.tree.leaves(params, is_leaf=_is_hole)
    mirrors = lambda node: jax.tree.structure(node, is_leaf=_is_hole) == skeleton

    def fix(node: Any) -> Any:
        if not mirrors(node):
            return node
        leaves = jax.tree.leaves(node, is_leaf=_is_hole)
        fixed = [_mirror_leaf(s, p) for s, p in zip(leaves, param_leaves, strict=True)]
        return jax.tree.unflatten(skeleton, fixed)

    return jax.tree.map(fix, state, is_leaf=mirrors)


def zeros_like_struct(struct: Any, dtype: Any = None) -> jax.Array:
    """Zeros like a `jax.ShapeDtypeStruct`, its typed sharding included."""
    dtype = struct.dtype if dtype is None else dtype
    if sharded_type(struct):
        return jnp.zeros(struct.shape, dtype, out_sharding=struct.sharding)
    return jnp.zeros(struct.shape, dtype)


def shards_over(tree: PyTree, axes: Any) -> bool:
    """Whether a leaf of `tree` is split, in its type, over one of `axes`."""
    names = set(axis_names(axes))
    for x in jax.tree.leaves(tree):
        sharding = typed_sharding(x)
        for entry in () if sharding is None else sharding.spec:
            if names.intersection(axis_names(entry)):
                return True
    return False


def split_leading(x: jax.Array, k: int) -> jax.Array:
    """`x`'s leading axis reshaped to `(n // k, k)`, a typed split kept on the first."""
    shape = (x.shape[0] // k, k, *x.shape[1:])
    sharding = typed_sharding(x)
    if sharding is None:
        return x.reshape(shape)
    spec = jax.sharding.PartitionSpec(sharding.spec[0], None, *sharding.spec[1:])
    return jax.lax.reshape(
        x, shape, out_sharding=jax.sharding.NamedSharding(sharding.mesh, spec)
    )


def sharded_type(struct: Any) -> bool:
    """Whether a `jax.ShapeDtypeStruct`'s sharding names a mesh axis."""
    spec = getattr(getattr(struct, "sharding", None), "spec", None)
    return spec is not None and any(axis is not None for axis in spec)


def varying_axes(x: Any) -> frozenset | None:
    """The mesh axes `x` may vary along in `jax.shard_map` (None where unsaid)."""
    return aval_varying_axes(jax.typeof(x))


def aval_varying_axes(aval: Any) -> frozenset | None:
    """`varying_axes` of a value of type `aval`."""
    vma = getattr(aval, "vma", None)  # jax < 0.9
    if vma is None:  # jax >= 0.9
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", None)
    return None if vma is None else frozenset(vma)


def summed_axes(axes: frozenset, like_axes: frozenset, names: tuple) -> tuple:
    """The axes of `names` in `like_axes` but not in `axes` (a value the same there)."""
    return tuple(n for n in names if n in like_axes and n not in axes)


def axis_names(axes: Any) -> tuple:
    """One mesh axis name or a tuple of them, as a tuple."""
    return tuple(axes) if isinstance(axes, tuple) else (axes,)


def manual_axes(names: tuple) -> tuple:
    """The axes of `names` bound here by `jax.shard_map` (`Manual`, not `jax.vmap`)."""
    mesh = jax.sharding.get_abstract_mesh()
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return tuple(n for n in names if types.get(n) == jax.sharding.AxisType.Manual)


def cast_varying(x: jax.Array, axes: tuple) -> jax.Array:
    """`x` typed as varying over `axes` (`pcast`; `pvary` before jax 0.9)."""
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # pyright: ignore[reportAttributeAccessIssue]  # jax < 0.9


def varying_call(name: Any) -> str:
    """`cast_varying` of params as the user writes it (for messages)."""
    if hasattr(jax.lax, "pcast"):
        return f"jax.lax.pcast(params, {name!r}, to='varying')"
    return f"jax.lax.pvary(params, {name!r})"
