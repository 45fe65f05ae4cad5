"""`inject_hyperparams`: the factory's arguments, sorted by rules 1 to 7."""

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
    types = _type_args(tp)
    return any(t is typing.Any or typing.get_origin(t) in _CONTAINERS for t in types)


def _annotation_rules_out_schedule(annotation: Any) -> bool:
    """Rule 5: the annotation names `Callable`s, none taking one number."""
    forms = [
        typing.get_args(t)[0]
        for t in _type_args(annotation)
        if typing.get_origin(t) is Callable
        and isinstance((typing.get_args(t) or (None,))[0], list)
    ]
    of_one_number = [len(f) == 1 and not _takes_a_tree(f[0]) for f in forms]
    return bool(forms) and not any(of_one_number)


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
    return not any(t in (str, typing.Any, object) or isinstance(t, str) for t in types)


def classify(name: str, value: Any, param: inspect.Parameter, static: set[str]) -> str:
    """Rules 1 to 7 of docs/inject_hyperparams.md, in order."""
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
        function_default = param.default is not param.empty and callable(param.default)
        if function_default or _annotation_rules_out_schedule(param.annotation):
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
    gives hypergradients. A hyperparameter is stored strongly typed (in
    `hyperparam_dtype` if given) and handed to the factory weakly typed where
    given so; one its dtype rounds to 0, 1 or inf is refused.

    **Which arguments are injected** (rules 1 to 8 of docs/inject_hyperparams.md,
    the first that applies): a name in `static_args`, a `*args` / `**kwargs` entry,
    `None`, a bool, a string, a class, a mask (`mask`, `*_mask`: optax #1373), a
    callable where the factory's default is one or whose annotation rules out a
    number, an int where the default is an int (a size: optax #412), and a number
    the factory cannot take traced (`scale_by_sm3`'s `b2`) are passed through as
    given. Another callable is a schedule, called with the step count; any other
    number or array is injected. Wrap an argument in a `lambda` to make it a
    schedule; name it in `static_args` to pass it through.

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
        return _injection.Injection(
            inner_factory, signature, arguments, kinds, static, hyperparam_dtype
        ).as_transformation()

    return wrapped_factory
