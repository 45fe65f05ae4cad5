"""`inject_hyperparams`: a drop-in for `optax.inject_hyperparams`.

Which arguments become schedules, which are injected into
`state.hyperparams`, and which are passed through unchanged is decided once,
when the wrapped factory is called, from the argument itself and the
factory's signature. The rule is in `inject_hyperparams`'s docstring.
"""

from __future__ import annotations

import collections.abc
import difflib
import functools
import inspect
import numbers
import typing
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._sharding import mirror_param_sharding
from ._static import ConfigKey, Configured, config_key
from ._tree import (
    as_weak,
    avals_key,
    check_updates_fit_params,
    describe_value,
    fill_scalar_gaps,
    is_weak,
    optimisable,
    restore_untrained,
    saturating_increment,
    strong_scalars,
)

_STATIC, _NUMERIC, _SCHEDULE, _STATEFUL = "static", "numeric", "schedule", "stateful"


def _is_mask_name(name: str) -> bool:
    return name == "mask" or name.endswith("_mask")


def _called_as_function(mask: Any) -> bool:
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


class _ArgumentError(TypeError):
    """A bad argument, reported by us: `init`'s abstract trial lets it through."""


class _ArgumentValueError(ValueError):
    """A bad argument value, reported by us (see `_ArgumentError`)."""


def _classify(name: str, value: Any, param: inspect.Parameter, static: set[str]) -> str:
    if name in static or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        return _STATIC
    if isinstance(value, str) and _rejects_str(param):
        raise _ArgumentError(
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
        return _STATIC
    if isinstance(value, optax.schedules.StatefulSchedule):
        return _STATEFUL
    if _is_mask_name(name):
        return _STATIC
    if callable(value):
        if param.default is not param.empty and callable(param.default):
            return _STATIC
        if _annotation_rules_out_schedule(param.annotation):
            return _STATIC
        return _SCHEDULE
    if _is_int(value) and _is_int(param.default):
        return _STATIC
    if isinstance(value, (numbers.Number, np.ndarray, np.generic, jax.Array)):
        return _NUMERIC
    return _STATIC


def _given_weak(value: Any) -> bool:
    """A Python number, or an array that promotes like one (weakly typed)."""
    return type(value) in (int, float, complex) or is_weak(value)


def _check_hyperparam_dtype(dtype: Any) -> Any:
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


def inject_hyperparams(
    inner_factory: Callable[..., optax.GradientTransformation],
    static_args: str | Iterable[str] = (),
    hyperparam_dtype: Any = None,
) -> Callable[..., optax.GradientTransformationExtraArgs]:
    """Makes the hyperparameters of an optimizer factory part of its state.

    A drop-in for `optax.inject_hyperparams` with the same signature and the
    same state, `optax.InjectStatefulHyperparamsState`: numeric
    hyperparameters can be read and written in `state.hyperparams`, schedules
    are evaluated on the step count, and `jax.grad` with respect to
    `state.hyperparams["learning_rate"]` gives hypergradients.

    **How each argument of the factory is treated** (first rule that applies):

    1. named in `static_args`, or a `*args` / `**kwargs` entry: passed through;
    2. `None`, a bool, a string, or a dtype or other class: passed through;
    3. an `optax.schedules.StatefulSchedule`: a stateful schedule;
    4. a parameter named `mask` or ending in `_mask`: passed through, whether a
       plain pytree, a callable pytree (an Equinox model), or a function
       `params -> mask` (optax issue #1373);
    5. any other callable is passed through when the factory's default for that
       parameter is itself a callable (e.g. `optax.contrib.adopt`'s
       `clip_value_fn`), or when the parameter's annotation names callables
       but none that takes a single number (e.g. `Callable[[Params], Any]`);
    6. any other callable is a schedule, called with the step count (a plain
       function, an optax schedule, or a callable pytree such as an Equinox
       module with `__call__`);
    7. a Python or NumPy int where the factory's default is an int (a size or
       count, such as adafactor's `min_dim_size_to_factor` or muon's
       `ns_steps`) is passed through, since the factory may use it in Python
       control flow (optax issue #412);
    8. any other number or array is injected into `state.hyperparams`, except
       one the factory cannot take as a traced value: `init` traces the
       factory's init and update abstractly and passes through each number
       that raises a concretization error on its own (`scale_by_sm3` tests
       `b2 != 1.0` in Python, `reduce_on_plateau` checks `factor`). Such a
       number is absent from `state.hyperparams`.

    To make an argument a schedule against rules 4-5, wrap it in a `lambda`;
    to pass one through against rules 6-8, name it in `static_args`.

    **Numerics:** a numeric hyperparameter is stored in `state.hyperparams`
    as a strongly typed array, in `hyperparam_dtype` if given, else in the
    dtype of the value given (float32 for a Python float, float64 under x64;
    an int given where the factory's default is a float, `weight_decay=0`,
    as a float), so the state's avals survive checkpoints. Where it is
    handed to the factory, a hyperparameter given as a Python number or a
    weakly typed array, and every schedule value, is made weakly typed, so
    it promotes as the Python number would: with bfloat16 params
    `b2=0.999` is not rounded to bfloat16 (`1.0`) and the updates have the
    bare optimizer's dtype. The
    updates are bit for bit those of the bare factory given each injected
    number rounded to its stored dtype (`b2=float(np.float32(0.999))`). They
    differ from the bare factory given the unrounded Python numbers where the
    factory does arithmetic on hyperparameters in Python (float64): adam's
    `1 - b2`. Name a hyperparameter in `static_args` to keep it a Python
    number. `hyperparam_dtype`, if given, must be a floating dtype: floating
    hyperparameters are stored and handed in it, strongly typed, as in optax;
    as in optax too, one given as a strongly typed JAX array
    (`jnp.float32(1e-3)`, or the value of an optax schedule) keeps its dtype.

    **Errors**, each naming the argument: a number given as a string, a
    non-floating `hyperparam_dtype` (at construction); a factory that does not
    return a transformation, a schedule whose value is not a scalar number, a
    mask that does not fit the params (at `init`); a name written into
    `state.hyperparams` that is not injected (a `KeyError`), a float written
    into an integer hyperparameter, a state built by another optimizer (a
    `TypeError`), updates whose tree does not fit the params passed with
    them (a `ValueError`, even for a factory that does not read the params:
    optax's contract is one structure) (at `update`, while tracing).

    **Arguments:**

    - `inner_factory`: a function returning an `optax.GradientTransformation`,
      e.g. `optax.adamw`.
    - `static_args`: names of parameters to pass through unchanged.
    - `hyperparam_dtype`: optional dtype for floating hyperparameters.

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
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    unknown = set() if takes_kwargs else static - set(signature.parameters)
    if unknown:
        raise ValueError(
            f"static_args names {sorted(unknown)}, which "
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
            raise TypeError(
                _binding_hint(
                    error,
                    signature,
                    kwargs,
                    getattr(inner_factory, "__name__", repr(inner_factory)),
                )
            ) from None
        bound.apply_defaults()
        injection = _Injection(
            inner_factory, signature, bound.arguments, static, hyperparam_dtype
        )
        return injection.as_transformation()

    return wrapped_factory


def _binding_hint(
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


class _Injection(Configured):
    """One call of a wrapped factory: its arguments, sorted by kind, and the
    `init` and `update` functions built from them. Two injections compare
    equal when built from the same factory and equal arguments.

    A numeric hyperparameter lives in two forms. In `state.hyperparams` it is
    *stored* as a strongly typed array of a fixed dtype, so that the state's
    avals survive a checkpoint round trip (serialisation forgets weak types:
    a weak state would come back strong and retrace the train step). Where it
    is *handed* to the factory, a hyperparameter given as a Python number (or
    a weakly typed array, or a schedule returning one) is made weakly typed,
    so that it promotes as the Python number given to the bare factory would.
    """

    def __init__(
        self,
        factory: Callable[..., optax.GradientTransformation],
        signature: inspect.Signature,
        arguments: dict[str, Any],
        static: set[str],
        dtype: Any,
    ):
        self.factory, self.signature, self.dtype = factory, signature, dtype
        self.arguments = dict(arguments)
        kinds = {
            n: _classify(n, v, signature.parameters[n], static)
            for n, v in arguments.items()
        }
        self.passed = {n: v for n, v in arguments.items() if kinds[n] == _STATIC}
        self.numeric = {n: v for n, v in arguments.items() if kinds[n] == _NUMERIC}
        self.weak = {n for n, v in self.numeric.items() if _given_weak(v)}
        self.schedules = {
            n: v if kinds[n] == _STATEFUL else optax.schedules.WrappedSchedule(v)
            for n, v in arguments.items()
            if kinds[n] in (_SCHEDULE, _STATEFUL)
        }
        # `_traceable`'s answers by `avals_key` of the params (it traces the
        # factory's init and update, once per kind of params).
        self._traceable_names: dict[tuple, tuple[str, ...]] = {}
        self._key = (
            config_key(factory, dtype, tuple(sorted(static))),
            tuple((n, ConfigKey(v)) for n, v in arguments.items()),
        )

    @property
    def _name(self) -> str:
        return getattr(self.factory, "__name__", repr(self.factory))

    def _build(
        self, hyperparams: dict[str, Any]
    ) -> optax.GradientTransformationExtraArgs:
        call = inspect.BoundArguments(self.signature, self.arguments.copy())  # type: ignore[arg-type]
        call.arguments.update(hyperparams)
        call.arguments.update(self.passed)
        tx = self.factory(*call.args, **call.kwargs)
        if not (
            callable(getattr(tx, "init", None))
            and callable(getattr(tx, "update", None))
        ):
            raise _ArgumentError(
                f"inner_factory {self._name} returned {describe_value(tx)}; "
                "inject_hyperparams expects it to return an "
                "optax.GradientTransformation (an object with init and update), "
                "as optax.adam does."
            )
        return optax.with_extra_args_support(tx)

    # -- the two forms of a hyperparameter ----------------------------------

    def _storage_dtype(self, name: str, value: jax.Array, given: Any) -> Any:
        """The dtype a hyperparameter is stored in: `hyperparam_dtype` for a
        floating one if given, unless it was `given` as a strongly typed JAX
        array (a `jnp.float32(...)`, what an optax schedule returns), which
        keeps its dtype, as in optax; else the dtype of the value as given
        (float32 for a Python float; float64 under x64)."""
        strong_array = isinstance(given, jax.Array) and not is_weak(given)
        if (
            self.dtype is not None
            and jnp.issubdtype(value.dtype, jnp.floating)
            and not strong_array
        ):
            return self.dtype
        return value.dtype

    def _as_given(self, name: str, given: Any) -> jax.Array:
        """A number given to the wrapped factory, as an array. An integer
        given where the factory's default is a float (`weight_decay=0` for
        adamw) is a float hyperparameter, as a Python float would be, where
        that float holds it exactly."""
        value = jnp.asarray(given)
        default = self.signature.parameters[name].default
        if (
            isinstance(default, float)
            and jnp.issubdtype(value.dtype, jnp.integer)
            and value.dtype != jnp.bool_
        ):
            as_float = np.asarray(given, jnp.result_type(float))
            if as_float == np.asarray(given):
                return jnp.asarray(as_float)
        return value

    def _store(self, name: str, value: Any, dtype: Any, where: str) -> jax.Array:
        """`value` as a strongly typed array of `dtype`; a cast to another
        kind (a float into an int hyperparameter, a bool into a number) is
        refused: it would change the value silently. So is another shape
        than the value given to the factory (written into the state, it
        would broadcast into the updates and the params)."""
        given = f"the value given to {self._name}: {self.arguments.get(name)!r}"
        try:
            array = jnp.asarray(value)
        except TypeError:
            raise _ArgumentError(
                f"{where} holds {describe_value(value)}, but {name} is a numeric "
                f"hyperparameter of dtype {dtype} ({given}). Write a number or "
                "an array."
            ) from None
        shape = jnp.shape(self.numeric[name]) if name in self.numeric else ()
        if array.shape != shape:
            raise _ArgumentValueError(
                f"{where} holds {describe_value(array)}, but {name} has shape "
                f"{shape} ({given}); another shape would broadcast into the "
                f"updates and the params. Write a value of shape {shape}."
            )
        if array.dtype == jnp.bool_ and dtype != jnp.bool_:
            raise _ArgumentError(
                f"{where} holds {describe_value(array)}, but {name} is a "
                f"hyperparameter of dtype {dtype} ({given}); a bool would be "
                "taken as 0 or 1. Write a number."
            )
        if array.dtype != dtype and not jnp.can_cast(
            array.dtype, dtype, casting="same_kind"
        ):
            raise _ArgumentError(
                f"{where} holds {describe_value(array)}, but {name} is a "
                f"hyperparameter of dtype {dtype} (fixed by the value given to "
                f"{self._name}: {self.arguments[name]!r}); casting would change "
                f"the value. Write a value of dtype {dtype}, or build the "
                f"optimizer with {name} given as a value of the dtype you need."
            )
        return jnp.asarray(array, dtype)  # strong: no weak type to lose

    def _hand(self, name: str, stored: jax.Array, weak: bool) -> jax.Array:
        """A stored hyperparameter as the factory receives it."""
        if self.dtype is not None and jnp.issubdtype(stored.dtype, jnp.floating):
            return stored  # hyperparam_dtype: strong, as optax hands it
        return as_weak(stored) if weak else stored

    def _schedule_value(self, name: str, schedule: Any, state: Any, **extra):
        value = schedule(state, **extra)
        if (
            value is None
            or isinstance(value, str)
            or not (
                isinstance(value, (numbers.Number, np.ndarray, np.generic, jax.Array))
            )
        ):
            raise _ArgumentError(
                f"The schedule given as {name} returned {describe_value(value)}; "
                "a schedule must return a scalar number (a Python number or a "
                "0-d array) for each step count."
            )
        array = jnp.asarray(value)
        if array.shape != ():
            raise _ArgumentValueError(
                f"The schedule given as {name} returned {describe_value(array)}; "
                "a schedule must return a scalar (shape ()) for each step count."
            )
        if not jnp.issubdtype(array.dtype, jnp.number):
            raise _ArgumentError(
                f"The schedule given as {name} returned {describe_value(array)}; "
                "a schedule must return a number (int, float or complex)."
            )
        return self._store(name, array, self._storage_dtype(name, array, value), name)

    def _hyperparams(
        self,
        numeric: dict[str, Any],
        schedule_states: dict[str, Any],
        where: str,
        **extra_args: Any,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The stored and the handed form of every injected hyperparameter.

        Only the names in `numeric` are injected: `init` leaves out those the
        factory cannot take traced (see `_traceable`), and `update` follows
        the state.
        """
        stored, handed = {}, {}
        for n, given in self.numeric.items():
            if n not in numeric:
                continue
            dtype = self._storage_dtype(n, self._as_given(n, given), given)
            stored[n] = self._store(n, numeric[n], dtype, f"{where}[{n!r}]")
            handed[n] = self._hand(n, stored[n], n in self.weak)
        for n, schedule in self.schedules.items():
            stored[n] = self._schedule_value(
                n, schedule, schedule_states[n], **extra_args
            )
            # Always weak: the bare factory casts a schedule's value to each
            # update's dtype (`optax.scale_by_schedule`), as a weak value is.
            handed[n] = self._hand(n, stored[n], weak=True)
        return stored, handed

    def _traceable(self, params: Any) -> dict[str, Any]:
        """The numeric hyperparameters the factory accepts as traced values.

        Some factories branch on a number in Python (`reduce_on_plateau`
        checks `factor` at construction, `scale_by_sm3` tests `b2 != 1.0` in
        its update). Injected, such a number is a tracer and the branch
        raises. This traces one init and update abstractly (no computation)
        and leaves out, as passed through unchanged, every name that raises a
        concretization error when traced alone.
        """

        def trial(names: Iterable[str]) -> bool:
            def run(numeric):
                _, handed = self._hyperparams(numeric, schedule_states, "arguments")
                tx = self._build(handed)
                state = tx.init(params)
                return tx.update(jax.tree.map(jnp.zeros_like, params), state, params)

            try:
                jax.eval_shape(run, {n: self.numeric[n] for n in names})
            except jax.errors.ConcretizationTypeError:
                return False
            except (_ArgumentError, _ArgumentValueError):
                raise  # our own report on a bad argument
            except Exception:  # noqa: BLE001 - e.g. an update that needs `value=`:
                return True  # not ours to judge; the real call will say
            return True

        key = avals_key(params)
        if key is not None and key in self._traceable_names:  # decided before
            return {n: self.numeric[n] for n in self._traceable_names[key]}
        schedule_states = {n: s.init() for n, s in self.schedules.items()}
        if not self.numeric or trial(self.numeric):
            traceable = dict(self.numeric)
        else:
            traceable = {n: v for n, v in self.numeric.items() if trial([n])}
        if key is not None:
            self._traceable_names[key] = tuple(traceable)
        return traceable

    def _check_masks(self, params: Any) -> None:
        """A mask argument must fit the params (optax.masked would fail deep
        inside the factory's init, naming neither the mask nor the params)."""
        for name, mask in self.passed.items():
            if not _is_mask_name(name) or mask is None:
                continue
            tree = mask(params) if _called_as_function(mask) else mask
            try:
                jax.tree.map(lambda m, *_: m, tree, params)
            except (ValueError, TypeError) as error:
                raise _ArgumentValueError(
                    f"{name} does not match the params given to init: the mask "
                    f"has the structure {jax.tree.structure(tree)}, the params "
                    f"{jax.tree.structure(params)} ({error}). {name} must be a "
                    "tree of bools with the structure of the params (or a prefix "
                    "of it), or a function params -> such a tree."
                ) from None

    def _check_names(self, hyperparams: Any, params: Any) -> None:
        """A name written into `state.hyperparams` that is not injected would
        be ignored silently (optax ignores it): refuse it. So is a number the
        factory branches on in Python (`_traceable`, asked of `params` as
        `init` asks it)."""
        unknown = sorted(set(hyperparams) - set(self.numeric) - set(self.schedules))
        written = set(hyperparams) & set(self.numeric)
        untraceable = written - set(self._traceable(params)) if written else set()
        written_untraceable = sorted(untraceable)
        if not (unknown or written_untraceable):
            return
        injected = (set(self.numeric) - untraceable) | set(self.schedules)
        missing = sorted(injected - set(hyperparams))
        if unknown and missing:
            raise TypeError(
                f"inject_hyperparams({self._name}).update's `state` was not "
                f"built by this optimizer: its hyperparams are "
                f"{sorted(hyperparams)}, where this optimizer injects "
                f"{sorted(injected)}. Pass the state that this optimizer's "
                "init returned (not one built by another optimizer)."
            )
        static = sorted(set(self.passed) & set(unknown))
        raise KeyError(
            f"state.hyperparams holds {unknown or written_untraceable}, which "
            f"{self._name} does not take as an injected hyperparameter: the "
            f"injected ones are {sorted(set(self.numeric) - untraceable)} "
            f"and the schedules {sorted(self.schedules)}"
            + (
                f"; {static} are passed to the factory unchanged (static)"
                if static
                else ""
            )
            + (
                f"; {written_untraceable} are numbers the factory branches on "
                "in Python, passed through unchanged"
                if written_untraceable
                else ""
            )
            + ". A value written there would be ignored. Give the value when "
            "building the optimizer instead."
        )

    def init(self, params: Any) -> optax.InjectStatefulHyperparamsState:
        params = strong_scalars(optimisable(params))
        self._check_masks(params)
        schedule_states = {n: s.init() for n, s in self.schedules.items()}
        stored, handed = self._hyperparams(
            self._traceable(params), schedule_states, "arguments"
        )
        return optax.InjectStatefulHyperparamsState(
            count=jnp.zeros((), jnp.int32),
            hyperparams=stored,
            hyperparams_states=schedule_states,
            inner_state=mirror_param_sharding(self._build(handed).init(params), params),
        )

    def update(
        self,
        updates: Any,
        state: optax.InjectStatefulHyperparamsState,
        params: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, optax.InjectStatefulHyperparamsState]:
        if not isinstance(state, optax.InjectStatefulHyperparamsState):
            raise TypeError(
                f"state must be the optax.InjectStatefulHyperparamsState "
                f"returned by this optimizer's init or update; got "
                f"{describe_value(state)}."
            )
        kept = None if params is None else optimisable(params)
        check_updates_fit_params(
            updates, kept, f"inject_hyperparams({self._name}).update"
        )
        filled = fill_scalar_gaps(updates, params)
        inner_params = None if kept is None else strong_scalars(kept)
        self._check_names(
            state.hyperparams, filled if inner_params is None else inner_params
        )
        stored, handed = self._hyperparams(
            state.hyperparams,
            state.hyperparams_states,
            "state.hyperparams",
            **extra_args,
        )
        schedule_states = {
            n: s.update(state.hyperparams_states[n], **extra_args)
            for n, s in self.schedules.items()
        }
        new_updates, inner_state = self._build(handed).update(
            filled, state.inner_state, inner_params, **extra_args
        )
        count = saturating_increment(state.count)
        return restore_untrained(
            updates, new_updates, params
        ), optax.InjectStatefulHyperparamsState(
            count=count.astype(jnp.int32),
            hyperparams=stored,
            hyperparams_states=schedule_states,
            inner_state=inner_state,
        )
