"""Pytree helpers shared by the transformations."""

from __future__ import annotations

import operator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import PyTree


def trainable(tree: PyTree) -> PyTree:
    """Replaces every leaf that is not a floating (or complex) array with `None`.

    These are the leaves `eqx.filter_grad` differentiates; it gives `None` for
    the others (activation functions, integer buffers, PRNG keys), and
    `eqx.apply_updates` skips a `None` update. Optimizer states built from a
    whole Equinox model must hold `None` at the same places, or they do not
    match the gradients, and `jnp.zeros_like(jax.nn.relu)` raises (equinox
    issue #590).
    """
    return jax.tree.map(lambda x: x if eqx.is_inexact_array(x) else None, tree)


def is_none(x: Any) -> bool:
    """`is_leaf` for maps that keep `None` leaves (`eqx.filter_grad`'s)."""
    return x is None


def is_typed_key(x: Any) -> bool:
    """A typed PRNG key array (`jax.random.key(...)`), of any shape."""
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def is_transformation(x: Any) -> bool:
    """Whether `x` follows the optax protocol: callable `init` and `update`."""
    return callable(getattr(x, "init", None)) and callable(getattr(x, "update", None))


class _NoUpdate:
    """Stands for a `None` update where only the containers are compared."""


_NO_UPDATE = _NoUpdate()


def _describe(leaf: Any) -> str:
    if leaf is None or leaf is _NO_UPDATE:
        return "None"
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"an array of shape {tuple(leaf.shape)} and dtype {leaf.dtype}"
    return f"a {type(leaf).__name__}"


_STRUCTURE_HINT = (
    "Pass updates with the same structure as the params the optimizer was "
    "initialised with. Only floating arrays are optimised: other params "
    "leaves (Python scalars, integer arrays, functions) hold None in the "
    "state, as `eqx.filter_grad` gives None for them; wrap a Python scalar "
    "you want trained in `jnp.asarray`."
)


def check_same_structure(
    expected: PyTree,
    got: PyTree,
    *,
    expected_name: str,
    got_name: str,
    hint: str = _STRUCTURE_HINT,
) -> None:
    """Raises a `ValueError` naming the first path where two trees differ.

    `None` counts as a leaf here, so an array where the state holds `None`
    (or the reverse) is reported too.
    """
    exp_leaves, exp_def = jax.tree_util.tree_flatten_with_path(
        expected, is_leaf=is_none
    )
    got_leaves, got_def = jax.tree_util.tree_flatten_with_path(got, is_leaf=is_none)
    if exp_def == got_def and all(
        (a is None) == (b is None)
        for (_, a), (_, b) in zip(exp_leaves, got_leaves, strict=True)
    ):
        return
    exp_paths = {jax.tree_util.keystr(p): leaf for p, leaf in exp_leaves}
    got_paths = {jax.tree_util.keystr(p): leaf for p, leaf in got_leaves}
    for path, leaf in exp_paths.items():
        if path not in got_paths:
            problem = f"{got_name} have nothing at {path or 'the root'}, where "
            problem += f"{expected_name} hold {_describe(leaf)}"
            break
        if (leaf is None) != (got_paths[path] is None):
            problem = (
                f"at {path or 'the root'} {got_name} hold "
                f"{_describe(got_paths[path])} but {expected_name} hold "
                f"{_describe(leaf)}"
            )
            break
    else:
        extra = next((p for p in got_paths if p not in exp_paths), None)
        if extra is not None:
            problem = (
                f"{got_name} have {_describe(got_paths[extra])} at {extra}, a path "
                f"{expected_name} do not have"
            )
        else:
            problem = (
                f"the containers differ: {got_name} are {got_def}, "
                f"{expected_name} are {exp_def}"
            )
    raise ValueError(
        f"The tree of {got_name} does not match {expected_name}: {problem}. {hint}"
    )


def check_same_shapes(
    expected: PyTree, got: PyTree, *, expected_name: str, got_name: str, hint: str
) -> None:
    """Raises a `ValueError` naming the first path where leaf shapes differ
    (the trees have the same structure)."""
    for (path, e), g in zip(
        jax.tree_util.tree_flatten_with_path(expected)[0],
        jax.tree.leaves(got),
        strict=True,
    ):
        if jnp.shape(e) != jnp.shape(g):
            raise ValueError(
                f"At {jax.tree_util.keystr(path) or 'the root'} {got_name} have "
                f"shape {jnp.shape(g)} but {expected_name} have shape "
                f"{jnp.shape(e)}: {hint}"
            )


def saturating_increment(x: jax.Array) -> jax.Array:
    """`x + 1`, staying at the dtype's maximum instead of wrapping around."""
    x = jnp.asarray(x)
    top = jnp.iinfo(x.dtype).max
    # The same expression as `optax.safe_increment`: XLA compiles one
    # kernel for this count and the inner optimizer's.
    return jnp.where(x < top, x + 1, jnp.asarray(top, x.dtype)).astype(x.dtype)


def is_weak(x: Any) -> bool:
    return bool(getattr(x, "weak_type", False))


def avals_key(tree: Any) -> tuple | None:
    """A hashable key of what tracing a function of `tree` depends on: its
    structure and each leaf's shape, dtype and weak type (Python numbers
    count as weakly typed); `None` where a leaf is not an array or number."""
    treedef, avals = state_record(tree)
    return None if any(aval is None for aval in avals) else (treedef, avals)


def cast_like(x: jax.Array, like: Any) -> jax.Array:
    """Returns `x` with the dtype and weak type of `like` (shapes must agree).

    A weakly typed value promotes like a Python scalar: multiplied with a
    bfloat16 array it gives bfloat16, where a strongly typed float32 would
    make the product float32. `lax.full_like` is the public operation that
    produces a weak result: it keeps the weak type of its template.
    """
    x = jnp.asarray(x)
    if x.dtype == like.dtype and is_weak(x) == is_weak(like):
        return x
    if not is_weak(like):
        return lax.convert_element_type(x, like.dtype)
    template = lax.full_like(like, 0, shape=())
    fill = lambda v: lax.full_like(template, v)  # noqa: E731
    # One vmap per axis rather than over a flattened `x`: a reshape of an
    # array sharded over an Explicit mesh axis is a sharding error.
    for _ in range(x.ndim):
        fill = jax.vmap(fill)
    return fill(x)


def as_weak(x: jax.Array) -> jax.Array:
    """Returns `x` as a weakly typed array of the default dtype of its kind.

    This is how a Python `float` (or `int`, `complex`) of the same value would
    enter a traced computation.
    """
    x = jnp.asarray(x)
    if is_weak(x):
        return x
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        python_zero: complex = 0j
    elif jnp.issubdtype(x.dtype, jnp.floating):
        python_zero = 0.0
    elif jnp.issubdtype(x.dtype, jnp.integer):
        python_zero = 0
    else:
        return x
    return cast_like(x, jnp.asarray(python_zero))


def is_python_scalar(x: Any) -> bool:
    """A Python `float` or `complex` (not `bool` or `int`): `jax.grad` gives it
    a gradient and optax keeps optimizer state for it."""
    return isinstance(x, (float, complex))


def optimisable(tree: PyTree) -> PyTree:
    """`trainable(tree)`, except that Python `float` and `complex` leaves are
    kept, as optax keeps them: `optax.adam(...).init({"s": 0.5})` has a moment
    for `s` and `jax.grad` gives `s` a gradient."""
    return jax.tree.map(lambda x: x if _optimised(x) else None, tree)


def _optimised(x: Any) -> bool:
    """What `optimisable` keeps: a floating or complex array, a Python
    `float` or `complex`."""
    return eqx.is_inexact_array(x) or is_python_scalar(x)


def _weakly_typed(x: Any) -> bool:
    """A Python `float` or `complex`, or a weakly typed floating array (what
    `jax.jit` makes of a Python float in its arguments)."""
    return is_python_scalar(x) or (
        eqx.is_inexact_array(x) and bool(getattr(x, "weak_type", False))
    )


def _strong(x: Any) -> jax.Array:
    return lax.convert_element_type(x, jnp.result_type(x))


def strong_scalars(tree: PyTree) -> PyTree:
    """`tree` (as given by `optimisable`) with each weakly typed leaf (see
    `_weakly_typed`) made a strongly typed array of its dtype.

    The inner optimizer's state for such a leaf is then strongly typed from
    `init` on. Built from the Python number itself, a moment is weakly typed
    at `init` and comes back strong from `update` (`optax.adam`'s second
    moment does), so a jitted train step holding it compiles twice (an
    Equinox model's `Dropout.p`). The values are the same either way: the
    leaf's own arithmetic is in its dtype.
    """
    return jax.tree.map(lambda x: _strong(x) if _weakly_typed(x) else x, tree)


def check_updates_fit_params(updates: PyTree, kept: PyTree, who: str) -> None:
    """Raises a `ValueError` naming the first path where `updates` do not have
    the tree of the params, given as `kept = optimisable(params)` (a `None`
    update may stand for any param leaf, as `eqx.filter_grad` gives)."""
    if kept is None:
        return

    def flat(tree: PyTree) -> PyTree:
        # `None` (no gradient) fits any param leaf: compare containers only.
        return jax.tree.map(
            lambda x: _NO_UPDATE if x is None else x, tree, is_leaf=is_none
        )

    updates_def = jax.tree.structure(updates, is_leaf=is_none)
    params_def = jax.tree.structure(kept, is_leaf=is_none)
    if updates_def == params_def:
        return
    try:
        check_same_structure(
            flat(kept),
            flat(updates),
            expected_name="the params",
            got_name="the updates",
            hint="Pass updates (gradients) with the structure of the params "
            "passed with them; a None update may stand for any param leaf, "
            "as `eqx.filter_grad` gives None for leaves it does not "
            "differentiate.",
        )
    except ValueError as error:
        raise ValueError(f"{who}: {error}") from None


def state_record(state: PyTree) -> tuple[Any, tuple]:
    """A tree's structure and each leaf's (shape, dtype, weak type), `None`
    for a leaf without a dtype (Python numbers count as weakly typed): of
    the state an `init` called on real params built, for
    `strong_as_recorded`, and the parts of `avals_key`."""
    leaves, treedef = jax.tree.flatten(state)
    avals = []
    for x in leaves:
        try:
            dtype = jnp.result_type(x)
        except TypeError:
            avals.append(None)
            continue
        shape = tuple(x.shape) if hasattr(x, "shape") else jnp.shape(x)
        weak = is_weak(x) or isinstance(x, int | float | complex)
        avals.append((shape, dtype, weak))
    return treedef, tuple(avals)


def traced_state_record(
    init: Any, template: PyTree, known: dict, *, is_params: bool
) -> tuple[Any, tuple | None] | None:
    """The `state_record` of what `init` builds from params like `template`,
    traced abstractly: with each leaf's avals where `is_params` (`template`
    is what `init` is given), the structure alone (`(treedef, None)`) where
    it stands in for them (the accumulator, say: its dtypes need not be the
    params'); `None` where `init` cannot be traced without real params.

    `known` caches the answers by `avals_key` of `template`; `init` fills
    it with the same call, so the step traces no inner init for params
    `init` has seen, and an optimizer that never ran `init` computes the
    same record."""
    key = avals_key(template)
    key = None if key is None else (is_params, key)
    if key is not None and key in known:
        return known[key]
    try:
        record = state_record(jax.eval_shape(init, template))
    except Exception:  # noqa: BLE001 - an init that needs real params
        record = None  # no check
    if record is not None and not is_params:
        record = (record[0], None)
    if key is not None:
        known[key] = record
    return record


def check_state_structure(
    init: Any,
    state: PyTree,
    template: PyTree,
    known: dict,
    *,
    is_params: bool,
    who: str,
    state_name: str,
    owner: str,
) -> tuple[Any, tuple | None] | None:
    """Raises a `TypeError` if `state` is not shaped like what `init` builds
    from params shaped like `template` (another optimizer's state was
    passed). Returns `traced_state_record`'s record, for
    `strong_as_recorded`."""
    record = traced_state_record(init, template, known, is_params=is_params)
    if record is None:
        return None
    got, expected = jax.tree.structure(state), record[0]
    if got != expected:
        raise TypeError(
            f"{who}'s `{state_name}` does not have the structure of the inner "
            f"optimizer's state: got {got}, expected {expected}. Pass the "
            f"state that this {owner}'s init returned (not one "
            "built by another optimizer)."
        )
    return record


def strong_as_recorded(
    state: PyTree, record: tuple[Any, tuple | None] | None
) -> PyTree:
    """`state` with each weakly typed leaf made strong where `init` built it
    strong with the same shape and dtype (`record`, from `state_record`): a
    value written into the state as `jnp.asarray(1e-2)` where init stored a
    float32 array, which a conditional returning the state as it came in
    would keep weak for good. Applied to the state a step returns, not to
    the one the inner optimizer reads (which sees what was written, as it
    would unwrapped). The value is unchanged; other leaves, and every leaf
    where `record` holds no avals, are returned as they are."""
    if record is None or record[1] is None:
        return state
    leaves, treedef = jax.tree.flatten(state)
    if treedef != record[0]:
        return state
    out = []
    for x, aval in zip(leaves, record[1], strict=True):
        if (
            aval is not None
            and not aval[2]
            and is_weak(x)
            and jnp.result_type(x) == aval[1]
            and tuple(jnp.shape(x)) == aval[0]
        ):
            x = lax.convert_element_type(x, aval[1])
        out.append(x)
    return jax.tree.unflatten(treedef, out)


def fill_scalar_gaps(updates: PyTree, params: PyTree) -> PyTree:
    """`updates` aligned with `strong_scalars(optimisable(params))`, for
    `params` as the caller was given them.

    Where `params` holds a Python scalar (or a weakly typed array) the update
    is made a strongly typed array, as the param is: a zero where it is
    `None`. `optimisable` gives such a param a state entry (as optax does),
    but `eqx.filter_grad` gives it a `None` gradient (an Equinox model's
    `float` field); the zero keeps the trees the inner optimizer maps over
    aligned. Where `params` holds a leaf that `optimisable` drops (an integer
    array: no state is kept for it) the update is `None`. The caller puts
    back what it was given with `restore_untrained`. Trees that do not line
    up are returned unchanged, for the inner optimizer to judge.
    """
    if params is None:
        return updates

    def fill(u: Any, p: Any) -> Any:
        if _not_optimised(p):
            return None  # no state for it: see `restore_untrained`
        if not _weakly_typed(p):
            return u
        if u is None:
            return jnp.zeros(jnp.shape(p), jnp.result_type(p))
        return _strong(u) if _weakly_typed(u) else u

    try:
        return jax.tree.map(fill, updates, params, is_leaf=is_none)
    except (ValueError, TypeError):
        return updates


def _not_optimised(p: Any) -> bool:
    return p is not None and not _optimised(p)


def restore_untrained(original: PyTree, new: PyTree, params: PyTree) -> PyTree:
    """`restore_none(original, new)`, and a zero update (in the dtype of the
    update given) where `params` holds a leaf that is not optimised (an
    integer array, which `fill_scalar_gaps` handed on as `None`): the param
    stays as it is."""
    if params is None:
        return restore_none(original, new)

    def back(o: Any, n: Any, p: Any) -> Any:
        if o is None:
            return None
        if _not_optimised(p):
            dtype = jnp.result_type(o)
            return o if dtype == jax.dtypes.float0 else jnp.zeros(jnp.shape(o), dtype)
        return n

    try:
        return jax.tree.map(back, original, new, params, is_leaf=is_none)
    except (ValueError, TypeError):
        return restore_none(original, new)


def restore_none(original: PyTree, new: PyTree) -> PyTree:
    """`new` with `None` wherever `original` (the incoming updates) had it."""
    if not any(x is None for x in jax.tree.leaves(original, is_leaf=is_none)):
        return new
    try:
        return jax.tree.map(
            lambda o, n: None if o is None else n, original, new, is_leaf=is_none
        )
    except (ValueError, TypeError):
        return new


def describe_value(value: Any) -> str:
    """A short description of a value for an error message."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"an array of shape {tuple(value.shape)} and dtype {value.dtype}"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} (a {type(value).__name__})"


def _is_module(x: Any) -> bool:
    return isinstance(x, eqx.Module)


def _is_integer_leaf(x: Any) -> bool:
    """An integer array (not `bool`, not a PRNG key) or a Python `int` (not
    `bool`)."""
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    dtype = getattr(x, "dtype", None)
    return (
        dtype is not None
        and eqx.is_array(x)
        and not is_typed_key(x)
        and jnp.issubdtype(dtype, jnp.integer)
    )


def accumulable(tree: PyTree) -> PyTree:
    """The leaves of `tree` that `optax_ext.MultiSteps` accumulates gradients
    for (the others are `None`).

    Inside an `equinox.Module`: `optimisable` (floating and complex arrays,
    Python `float` and `complex`), so a model's integer buffers, keys and
    functions hold `None`, as `eqx.filter_grad` gives them. Elsewhere (dicts,
    lists, tuples, a bare array): integer arrays and Python `int`s are kept
    too, as `optax.MultiSteps` keeps them (it accumulates integer gradients).
    """

    def keep(x: Any) -> Any:
        if _is_module(x):
            return optimisable(x)
        if _optimised(x) or _is_integer_leaf(x):
            return x
        return None

    return jax.tree.map(keep, tree, is_leaf=_is_module)


def fill_untrained_gaps(updates: PyTree, params: PyTree) -> PyTree:
    """`updates` with a zero where it holds `None` and `params` (as given by
    `accumulable`) a leaf that is not a floating array: a Python number or an
    integer array, which `eqx.filter_grad` does not differentiate but optax
    keeps state for. The caller puts the `None` back with `restore_none`.
    Trees that do not line up are returned unchanged, for the caller's
    structure check to report."""
    if params is None:
        return updates

    def fill(u: Any, p: Any) -> Any:
        if u is None and p is not None and not eqx.is_inexact_array(p):
            return jnp.zeros_like(p)
        return u

    try:
        return jax.tree.map(fill, updates, params, is_leaf=is_none)
    except (ValueError, TypeError):
        return updates


def as_index(value: Any) -> int | None:
    """`value` as a Python int if it is an integer (`int`, a NumPy or JAX
    integer scalar), not a bool; `None` otherwise."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
