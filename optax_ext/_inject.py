"""`inject_hyperparams`: the factory's arguments, sorted by rules 1 to 7."""

from __future__ import annotations

import difflib
import functools
import inspect
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from . import _injection
from ._injection import NUMBER_TYPES, NUMERIC, SCHEDULE, STATEFUL, STATIC
from ._static import snapshot
from ._tree import describe_value

_CONTAINERS = (Iterable, Mapping, Sequence, list, dict, tuple)


def _type_args(annotation: Any) -> list[Any]:
    """Every type named inside an annotation (`Union` and generics unpacked)."""
    found = [annotation]
    for arg in typing.get_args(annotation):
        if not isinstance(arg, list):
            found.extend(_type_args(arg))
    return found


def _takes_a_tree(tp: Any) -> bool:
    """Whether a type admits containers (a params tree) rather than a number."""
    if tp is typing.Any or typing.get_origin(tp) in _CONTAINERS:
        return True
    return any(_takes_a_tree(arg) for arg in typing.get_args(tp))


def _annotation_rules_out_schedule(annotation: Any) -> bool:
    """Rule 5: the annotation names `Callable`s, none taking one number."""
    if annotation is inspect.Parameter.empty or isinstance(annotation, str):
        return False
    forms = [
        typing.get_args(t)[0]
        for t in _type_args(annotation)
        if typing.get_origin(t) is Callable
        and isinstance((typing.get_args(t) or (None,))[0], list)
    ]
    return bool(forms) and not any(
        len(f) == 1 and not _takes_a_tree(f[0]) for f in forms
    )


def _is_int(value: Any) -> bool:
    """A Python or NumPy integer scalar (not a bool)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _rejects_str(param: inspect.Parameter) -> bool:
    """Whether `param`'s annotation (else its default) says a number, not a `str`."""
    annotation = param.annotation
    if annotation is param.empty or isinstance(annotation, str):
        default = param.default
        return isinstance(default, (int, float)) and not isinstance(default, bool)
    types = _type_args(annotation)  # a Literal's strings among them
    return not any(
        t is str or t is typing.Any or t is object or isinstance(t, str) for t in types
    )


def classify(name: str, value: Any, param: inspect.Parameter, static: set[str]) -> str:
    """Rules 1 to 7 of `inject_hyperparams`' docstring, in order."""
    if name in static or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        return STATIC
    if isinstance(value, str) and _rejects_str(param):
        raise _injection.ArgumentError(
            f"{name}={value!r} is a string, but the factory takes a number, an array "
            f"or a schedule there (its annotation: {param.annotation}, its default: "
            f"{param.default}). Pass a number, e.g. {name}=0.1, not its text."
        )
    if value is None or isinstance(value, (bool, np.bool_, str, type, np.dtype)):
        return STATIC
    if isinstance(value, optax.schedules.StatefulSchedule):
        return STATEFUL
    if _injection.is_mask_name(name):
        return STATIC
    if callable(value):
        if param.default is not param.empty and callable(param.default):
            return STATIC
        if _annotation_rules_out_schedule(param.annotation):
            return STATIC
        return SCHEDULE
    if _is_int(value) and _is_int(param.default):
        return STATIC
    return NUMERIC if isinstance(value, NUMBER_TYPES) else STATIC


def _check_hyperparam_dtype(dtype: Any) -> Any:
    if dtype is None:
        return None
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as error:
        raise TypeError(
            f"hyperparam_dtype must be a floating dtype such as jnp.float32 or None, "
            f"got {dtype!r}."
        ) from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"hyperparam_dtype must be a floating dtype (it is applied to the floating "
            f"hyperparameters, which {dtype} cannot hold: 0.1 would become "
            f"{np.asarray(0.1).astype(dtype)!r}); got {dtype}. Use e.g. jnp.float32, "
            "or None to keep each hyperparameter's dtype."
        )
    return dtype


def _not_taken(names: Iterable[str], signature: inspect.Signature) -> list[str]:
    """The `names` that `signature` takes neither by name nor by `**kwargs`."""
    if any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        return []
    return sorted(set(names) - set(signature.parameters))


def _binding_hint(
    error: TypeError, signature: inspect.Signature, kwargs: dict[str, Any], name: str
) -> str:
    """`error`, naming the keywords the factory does not take and close matches."""
    if not (unknown := _not_taken(kwargs, signature)):
        return str(error)
    hints = []
    for given in unknown:
        close = difflib.get_close_matches(given, list(signature.parameters), n=1)
        hints.append(f"{given!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return (
        f"{name}: {error}. It takes no argument named {', '.join(hints)}; "
        f"its arguments are {', '.join(signature.parameters)}."
    )


def inject_hyperparams(
    inner_factory: Callable[..., optax.GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any = None,
) -> Callable[..., optax.GradientTransformationExtraArgs]:
    """Makes the hyperparameters of an optimizer factory part of its state.

    A drop-in for `optax.inject_hyperparams` with the same signature and state,
    `optax.InjectStatefulHyperparamsState`: numeric hyperparameters can be read
    and written in `state.hyperparams`, schedules are evaluated on the step
    count, and `jax.grad` with respect to `state.hyperparams["learning_rate"]`
    gives hypergradients.

    **How each argument of the factory is treated** (first rule that applies;
    details in docs/inject_hyperparams.md):

    1. named in `static_args`, or a `*args` / `**kwargs` entry: passed through;
    2. `None`, a bool, a string, or a dtype or other class: passed through;
    3. an `optax.schedules.StatefulSchedule`: a stateful schedule;
    4. a parameter named `mask` or ending in `_mask`: passed through, a
       pytree or a function `params -> mask` (optax #1373);
    5. any other callable where the factory's default is a callable, or whose
       annotation names callables none taking one number: passed through;
    6. any other callable: a schedule, called with the step count;
    7. a Python or NumPy int where the factory's default is an int (a size or
       count): passed through (optax #412);
    8. any other number or array: injected into `state.hyperparams`, unless
       traced on its own in an abstract trial of the factory's init and update
       it raises a concretization error (`scale_by_sm3`'s `b2`): passed through.

    To make an argument a schedule against rules 4-5, wrap it in a `lambda`;
    to pass one through against rules 6-8, name it in `static_args`.

    **Numerics:** a numeric hyperparameter is stored strongly typed, in
    `hyperparam_dtype` if given (a strong JAX array keeps its dtype), else in
    its given dtype; a Python number, weak array or schedule value is handed to
    the factory weakly typed. The updates are the bare factory's given each
    number rounded to its stored dtype. Values rounded to 0, 1 or infinity, and
    names written into `state.hyperparams` that are not injected, are refused.

    **Arguments:**

    - `inner_factory`: a function returning an `optax.GradientTransformation`,
      e.g. `optax.adamw`.
    - `static_args`: names of parameters to pass through unchanged.
    - `hyperparam_dtype`: optional floating dtype for floating hyperparameters.

    **Returns:**

    A function with `inner_factory`'s signature returning an
    `optax.GradientTransformationExtraArgs`.

    **Example:**

    ```python
    opt = optax_ext.inject_hyperparams(optax.adamw)(
        learning_rate=optax.cosine_decay_schedule(1e-3, 1000),
        mask=eqx_model_of_bools,  # no static_args needed
    )
    state = opt.init(params)
    state.hyperparams["weight_decay"] = 1e-2  # takes effect at the next update
    ```
    """
    if not callable(inner_factory):
        raise TypeError(
            "inner_factory must be a function returning an "
            f"optax.GradientTransformation, such as optax.adam; got "
            f"{describe_value(inner_factory)}."
        )
    hyperparam_dtype = _check_hyperparam_dtype(hyperparam_dtype)
    static = {static_args} if isinstance(static_args, str) else set(static_args)
    try:  # resolve `from __future__ import annotations` strings if possible
        signature = inspect.signature(inner_factory, eval_str=True)
    except Exception:  # noqa: BLE001 - unresolvable names: use them as strings
        signature = inspect.signature(inner_factory)
    if unknown := _not_taken(static, signature):
        raise ValueError(
            f"static_args names {unknown}, which "
            f"{getattr(inner_factory, '__name__', inner_factory)} does not take; "
            f"its parameters are {list(signature.parameters)}."
        )

    @functools.wraps(inner_factory)
    def wrapped_factory(
        *args: Any, **kwargs: Any
    ) -> optax.GradientTransformationExtraArgs:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            name = getattr(inner_factory, "__name__", repr(inner_factory))
            raise TypeError(_binding_hint(error, signature, kwargs, name)) from None
        bound.apply_defaults()
        # A copy: a mask changed later changes neither this optimizer nor its equals.
        arguments = {n: snapshot(v) for n, v in bound.arguments.items()}
        params = signature.parameters
        kinds = {n: classify(n, v, params[n], static) for n, v in arguments.items()}
        injection = _injection.Injection(
            inner_factory, signature, arguments, kinds, static, hyperparam_dtype
        )
        return injection.as_transformation()

    return wrapped_factory
