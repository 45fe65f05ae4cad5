"""Pytree helpers: structure and shape checks, casts keeping weak types, messages."""

import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import PyTree

from ._leaves import is_none, optimised


def is_transformation(x: Any) -> bool:
    """Whether `x` follows the optax protocol: callable `init` and `update`."""
    return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


_NO_UPDATE = object()  # a `None` update where only the containers are compared


def _describe(leaf: Any) -> str:
    """`describe_value(leaf)`; "None" for a `None` leaf or update."""
    return "None" if leaf is None or leaf is _NO_UPDATE else describe_value(leaf)


_STRUCTURE_HINT = (
    "Pass updates with the same structure as the params the optimizer was initialised "
    "with. Only floating arrays are optimised: other params leaves (Python scalars, "
    "integer arrays, functions) hold None in the state, as `eqx.filter_grad` gives "
    "None for them; wrap a Python scalar you want trained in `jnp.asarray`."
)


def _difference(exp_paths, got_paths, exp_def, got_def, names) -> str:
    """Where two trees differ: a path, else their containers."""
    expected_name, got_name = names
    for path, leaf in exp_paths.items():
        if path not in got_paths:
            n = len(path)
            deeper = [p for p in got_paths if p[:n] == path and p[n : n + 1] in "[."]
            listed = ", ".join(deeper[:3]) + (", ..." if len(deeper) > 3 else "")
            held = f"a tree with leaves at {listed}" if deeper else "nothing"
            return (
                f"{got_name} have {held} at {path or 'the root'}, where "
                f"{expected_name} hold {_describe(leaf)}"
            )
        if (leaf is None) != (got_paths[path] is None):
            return (
                f"at {path or 'the root'} {got_name} hold {_describe(got_paths[path])}"
                f" but {expected_name} hold {_describe(leaf)}"
            )
    extra = next((p for p in got_paths if p not in exp_paths), None)
    if extra is not None:
        return (
            f"{got_name} have {_describe(got_paths[extra])} at {extra}, a path "
            f"{expected_name} do not have"
        )
    if str(got_def) == str(exp_def):
        return (
            f"their containers print alike ({got_def}) but compare unequal: they "
            "differ in what a container holds beside its children and does not "
            "print (an Equinox module's static fields, say, which a pickle round "
            "trip can make unequal). Restore a checkpoint into the state this "
            "process builds (its init, or `jax.eval_shape` of it), so the "
            "containers come from here"
        )
    return (
        f"the containers differ: {got_name} are {got_def}, "
        f"{expected_name} are {exp_def}"
    )


def check_same_structure(
    expected: PyTree,
    got: PyTree,
    *,
    expected_name: str,
    got_name: str,
    hint: str = _STRUCTURE_HINT,
) -> None:
    """Raises a `ValueError` naming the first path where two trees differ."""
    flatten = lambda t: jax.tree_util.tree_flatten_with_path(t, is_leaf=is_none)
    (exp_leaves, exp_def), (got_leaves, got_def) = flatten(expected), flatten(got)
    nones = lambda leaves: [leaf is None for _, leaf in leaves]
    if exp_def == got_def and nones(exp_leaves) == nones(got_leaves):
        return
    paths = lambda leaves: {jax.tree_util.keystr(p): leaf for p, leaf in leaves}
    names = (expected_name, got_name)
    problem = _difference(paths(exp_leaves), paths(got_leaves), exp_def, got_def, names)
    raise ValueError(
        f"The tree of {got_name} does not match {expected_name}: {problem}. {hint}"
    )


def check_same_shapes(
    expected: PyTree, got: PyTree, *, expected_name: str, got_name: str, hint: str
) -> None:
    """Raises a `ValueError` naming the first path where the trees or their leaves'
    shapes differ."""
    check_same_structure(
        expected, got, expected_name=expected_name, got_name=got_name, hint=hint
    )
    flat = jax.tree_util.tree_flatten_with_path(expected)[0]
    for (path, e), g in zip(flat, jax.tree.leaves(got), strict=True):
        if jnp.shape(e) != jnp.shape(g):
            raise ValueError(
                f"At {jax.tree_util.keystr(path) or 'the root'} {got_name} have shape "
                f"{jnp.shape(g)} but {expected_name} have shape {jnp.shape(e)}: {hint}"
            )


def saturating_increment(x: jax.Array) -> jax.Array:
    """`x + 1`, staying at the dtype's maximum instead of wrapping around."""
    x = jnp.asarray(x)
    top = jnp.iinfo(x.dtype).max
    return jnp.where(x < top, x + 1, jnp.asarray(top, x.dtype)).astype(x.dtype)


def is_weak(x: Any) -> bool:
    return bool(getattr(x, "weak_type", False))


def cast_like(x: jax.Array, like: Any) -> jax.Array:
    """`x` with the dtype and weak type of `like` (an array or `ShapeDtypeStruct`)."""
    x = jnp.asarray(x)
    if x.dtype == like.dtype and is_weak(x) == is_weak(like):
        return x
    if not is_weak(like):
        return lax.convert_element_type(x, like.dtype)
    if isinstance(like, jax.ShapeDtypeStruct):
        template = as_weak(jnp.zeros((), like.dtype))
        if template.dtype != like.dtype:
            return lax.convert_element_type(x, like.dtype)
    else:
        template = lax.full_like(like, 0, shape=())
    fill = lambda v: lax.full_like(template, v)
    for _ in range(x.ndim):
        fill = jax.vmap(fill)
    return fill(x)


_PYTHON_ZEROS = ((jnp.complexfloating, 0j), (jnp.floating, 0.0), (jnp.integer, 0))


def as_weak(x: jax.Array) -> jax.Array:
    """`x` as a Python number of its kind enters a trace (weak, default dtype)."""
    x = jnp.asarray(x)
    if is_weak(x):
        return x
    for kind, python_zero in _PYTHON_ZEROS:
        if jnp.issubdtype(x.dtype, kind):
            return cast_like(x, jnp.asarray(python_zero))
    return x


def check_updates_fit_params(
    updates: PyTree, params: PyTree, who: str, name: str = "updates"
) -> None:
    """Raises unless `updates` have `optimised(params)`'s tree (`None` fits a leaf)."""
    kept = optimised(params)
    structure = lambda tree: jax.tree.structure(tree, is_leaf=is_none)
    if params is None or structure(updates) == structure(kept):
        return
    mark = lambda x: _NO_UPDATE if x is None else x
    flat = lambda tree: jax.tree.map(mark, tree, is_leaf=is_none)
    try:
        check_same_structure(
            flat(kept),
            flat(updates),
            expected_name="the params",
            got_name=f"the {name}",
            hint="Pass updates (gradients) with the structure of the params passed "
            "with them; a None update may stand for any param leaf, as "
            "`eqx.filter_grad` gives None for leaves it does not differentiate.",
        )
    except ValueError as error:
        raise ValueError(f"{who}: {error}") from None


def describe_value(value: Any) -> str:
    """A short description of a value for an error message."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} (a {type(value).__name__})"


def check_bool(value: Any, must: str) -> bool:
    """`value` as a bool; a `TypeError` saying `must` where it is none."""
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{must}, got {describe_value(value)}.")
    return bool(value)


def as_index(value: Any) -> int | None:
    """`value` as a Python int if it is an integer scalar (not a bool)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def known_bool(x: Any) -> bool | None:
    """`x` as a Python bool where it is known while tracing, else `None`."""
    try:
        return bool(x)
    except jax.errors.ConcretizationTypeError:
        return None


def is_real_scalar(value: Any) -> bool:
    """Whether `value` can be a weight: an int or float scalar, not a bool."""
    dtype = getattr(value, "dtype", None)
    if dtype is None:
        return isinstance(value, int | float) and not isinstance(value, bool)
    real = jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)
    return real and jnp.shape(value) == ()
