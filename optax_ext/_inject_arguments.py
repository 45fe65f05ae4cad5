"""How `inject_hyperparams` sorts a factory's arguments: passed through
(static), injected into `state.hyperparams` (numeric), or evaluated on the
step count (schedules), from the argument itself and the factory's
signature; and the errors it reports about them. The rule is in
`inject_hyperparams`'s docstring.
"""

from __future__ import annotations

import collections.abc
import difflib
import inspect
import numbers
import types
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._tree import is_weak

STATIC, NUMERIC, SCHEDULE, STATEFUL = "static", "numeric", "schedule", "stateful"


def is_mask_name(name: str) -> bool:
    return name == "mask" or name.endswith("_mask")


def called_as_function(mask: Any) -> bool:
    """Whether `optax.masked` calls `mask` with the params: where every leaf
    of it is callable (a function, or an Equinox module holding functions);
    an Equinox model of bools is a tree of bools, though it is callable."""
    leaves = jax.tree.leaves(jax.tree.map(callable, mask))
    return bool(leaves) and all(leaves)


def _is_dtype_like(value: Any) -> bool:
    return isinstance(value, (type, np.dtype))


def _callable_forms(annotation: Any) -> list[tuple[Any, ...]]:
    """The argument lists of every `Callable[[...], ...]` inside `annotation`."""
    found: list[tuple[Any, ...]] = []
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is collections.abc.Callable and args and isinstance(args[0], list):
        found.append(tuple(args[0]))
    for arg in args:
        if not isinstance(arg, list):
            found.extend(_callable_forms(arg))
    return found


def _takes_a_tree(tp: Any) -> bool:
    """Whether a type admits containers (a params tree) rather than a number."""
    if typing.get_origin(tp) in (
        collections.abc.Iterable,
        collections.abc.Mapping,
        collections.abc.Sequence,
        list,
        dict,
        tuple,
    ):
        return True
    if tp is typing.Any:
        return True
    return any(_takes_a_tree(arg) for arg in typing.get_args(tp))


def _annotation_rules_out_schedule(annotation: Any) -> bool:
    """True if the parameter's annotation has `Callable`s but none of them
    takes a single number (the step count), e.g. a mask `Callable[[Params], Any]`."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return False
    forms = _callable_forms(annotation)
    if not forms:
        return False
    return not any(len(f) == 1 and not _takes_a_tree(f[0]) for f in forms)


def _is_int(value: Any) -> bool:
    """A Python or NumPy integer scalar (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def takes_a_float(param: inspect.Parameter) -> bool:
    """Whether the factory takes a float for this parameter, so that an int
    given there is a float hyperparameter: its default is a float
    (`weight_decay=1e-4`), or its annotation names `float` but not `int`
    among its alternatives (optax's `learning_rate: ScalarOrSchedule`)."""
    if isinstance(param.default, float):
        return True
    annotation = param.annotation
    if annotation is param.empty or isinstance(annotation, str):
        return False
    members = (
        typing.get_args(annotation)
        if typing.get_origin(annotation)
        in (
            typing.Union,
            types.UnionType,
        )
        else (annotation,)
    )
    return float in members and int not in members


def _type_args(annotation: Any) -> list[Any]:
    """Every type named inside an annotation (`Union` and generics unpacked)."""
    found = [annotation]
    for arg in typing.get_args(annotation):
        if not isinstance(arg, list):
            found.extend(_type_args(arg))
    return found


def _rejects_str(param: inspect.Parameter) -> bool:
    """Whether the factory's signature says this parameter is a number (or a
    schedule), not a string: its annotation names types but neither `str` nor
    `Any`, or it has no annotation and a number as its default."""
    annotation = param.annotation
    if annotation is param.empty or isinstance(annotation, str):
        default = param.default
        return isinstance(default, (int, float)) and not isinstance(default, bool)
    types = _type_args(annotation)  # a Literal's strings among them
    return not any(
        t is str or t is typing.Any or t is object or isinstance(t, str) for t in types
    )


class ArgumentError(TypeError):
    """A bad argument, reported by us: `init`'s abstract trial lets it through."""


class ArgumentValueError(ValueError):
    """A bad argument value, reported by us (see `ArgumentError`)."""


def classify(name: str, value: Any, param: inspect.Parameter, static: set[str]) -> str:
    if name in static or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        return STATIC
    if isinstance(value, str) and _rejects_str(param):
        raise ArgumentError(
            f"{name}={value!r} is a string, but the factory takes a number, an "
            f"array or a schedule there (its annotation: {param.annotation}, its "
            f"default: {param.default}). Pass a number, e.g. {name}=0.1, not "
            "its text."
        )
    if (
        value is None
        or isinstance(value, (bool, np.bool_, str))
        or _is_dtype_like(value)
    ):
        return STATIC
    if isinstance(value, optax.schedules.StatefulSchedule):
        return STATEFUL
    if is_mask_name(name):
        return STATIC
    if callable(value):
        if param.default is not param.empty and callable(param.default):
            return STATIC
        if _annotation_rules_out_schedule(param.annotation):
            return STATIC
        return SCHEDULE
    if _is_int(value) and _is_int(param.default):
        return STATIC
    if isinstance(value, (numbers.Number, np.ndarray, np.generic, jax.Array)):
        return NUMERIC
    return STATIC


def given_weak(value: Any) -> bool:
    """A Python number, or an array that promotes like one (weakly typed)."""
    return type(value) in (int, float, complex) or is_weak(value)


def check_hyperparam_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as error:
        raise TypeError(
            f"hyperparam_dtype must be a floating dtype such as jnp.float32 or "
            f"None, got {dtype!r}."
        ) from error
    if not jnp.issubdtype(dtype, jnp.floating):
        # optax casts every floating hyperparameter to it: learning_rate=0.1
        # becomes 0 in int32, and the updates are silently zero.
        raise ValueError(
            f"hyperparam_dtype must be a floating dtype (it is applied to the "
            f"floating hyperparameters, which {dtype} cannot hold: 0.1 would "
            f"become {np.asarray(0.1).astype(dtype)!r}); got {dtype}. Use "
            "e.g. jnp.float32, or None to keep each hyperparameter's dtype."
        )
    return dtype


def binding_hint(
    error: TypeError, signature: inspect.Signature, kwargs: dict[str, Any], name: str
) -> str:
    """`error` (from binding the factory's arguments), naming the keyword
    arguments the factory does not take and the names they may stand for: a
    misspelt `learning_rate` is reported as a missing one otherwise."""
    accepts_any = any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    )
    unknown = [] if accepts_any else sorted(set(kwargs) - set(signature.parameters))
    if not unknown:
        return str(error)
    hints = []
    for given in unknown:
        close = difflib.get_close_matches(given, list(signature.parameters), n=1)
        hints.append(f"{given!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"{name}: {error}. It takes no argument named {', '.join(hints)}; "
        f"its arguments are {', '.join(signature.parameters)}."
    )
