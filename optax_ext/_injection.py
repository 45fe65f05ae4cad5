"""The optimizer `inject_hyperparams(factory)(...)` returns: the two forms of
a numeric hyperparameter (stored in the state, handed to the factory), rule
8 of the argument rules (numbers the factory cannot take traced), and the
`init` and `update` built from them.
"""

from __future__ import annotations

import inspect
import numbers
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ._leaves import inner_params, updates_for_inner, updates_for_params
from ._records import avals_key
from ._sharding import mirror_param_sharding
from ._static import ConfigKey, Configured, config_key
from ._transformations import with_extra_args
from ._tree import (
    as_weak,
    check_updates_fit_params,
    describe_value,
    is_transformation,
    is_weak,
    saturating_increment,
)

STATIC, NUMERIC, SCHEDULE, STATEFUL = "static", "numeric", "schedule", "stateful"
NUMBER_TYPES = (numbers.Number, np.ndarray, np.generic, jax.Array)


class ArgumentError(TypeError):
    """A bad argument, reported by us: rule 8's abstract trial lets it through."""


class ArgumentValueError(ValueError):
    """A bad argument value, reported by us (see `ArgumentError`)."""


def is_mask_name(name: str) -> bool:
    return name == "mask" or name.endswith("_mask")


def _called_as_function(mask: Any) -> bool:
    """Whether `optax.masked` calls `mask` with the params: every leaf is
    callable (an Equinox model of bools is callable, but its leaves are not)."""
    leaves = jax.tree.leaves(jax.tree.map(callable, mask))
    return bool(leaves) and all(leaves)


def _takes_a_float(param: inspect.Parameter) -> bool:
    """Whether an int given for `param` is a float hyperparameter: its default
    is a float, or its annotation names `float` but not `int`."""
    if isinstance(param.default, float):
        return True
    annotation = param.annotation
    if annotation is param.empty or isinstance(annotation, str):
        return False
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    return float in members and int not in members


def _wider_hint(hyperparam_dtype: Any) -> str:
    """The first words of `_check_kept`'s advice: how to store a wider value."""
    if hyperparam_dtype is not None:
        return (
            "Store the hyperparameters in a wider dtype (a wider "
            "hyperparam_dtype, or None to keep each value's own), name"
        )
    if not jax.config.jax_enable_x64:
        return "Enable float64 (`jax.config.update('jax_enable_x64', True)`), name"
    return "Name"


class Injection(Configured):
    """One call of a wrapped factory: its arguments, sorted by kind, and the
    `init` and `update` built from them; equal when built from the same
    factory and equal arguments. Why a hyperparameter is stored strong and
    handed weak: docs/inject_hyperparams.md, "Numerics".
    """

    def __init__(
        self,
        factory: Callable[..., optax.GradientTransformation],
        signature: inspect.Signature,
        arguments: dict[str, Any],
        kinds: dict[str, str],
        static: set[str],
        dtype: Any,
    ):
        self.factory, self.signature, self.dtype = factory, signature, dtype
        self.arguments = dict(arguments)
        self.passed = {n: v for n, v in arguments.items() if kinds[n] == STATIC}
        self.numeric = {n: v for n, v in arguments.items() if kinds[n] == NUMERIC}
        self.weak = {
            n
            for n, v in self.numeric.items()
            if type(v) in (int, float, complex) or is_weak(v)
        }
        self.schedules = {
            n: v if kinds[n] == STATEFUL else optax.schedules.WrappedSchedule(v)
            for n, v in arguments.items()
            if kinds[n] in (SCHEDULE, STATEFUL)
        }
        # `_traceable`'s answers by `avals_key` of the params.
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
        if not is_transformation(tx):
            raise ArgumentError(
                f"inner_factory {self._name} returned {describe_value(tx)}; "
                "inject_hyperparams expects it to return an "
                "optax.GradientTransformation (an object with init and update), "
                "as optax.adam does."
            )
        return with_extra_args(tx)

    # -- the two forms of a hyperparameter ----------------------------------

    def _storage_dtype(self, value: jax.Array, given: Any) -> Any:
        """`hyperparam_dtype` for a floating value not given as a strong JAX
        array (which keeps its dtype, as in optax); else `value`'s dtype."""
        floating = jnp.issubdtype(value.dtype, jnp.floating)
        strong_array = isinstance(given, jax.Array) and not is_weak(given)
        if self.dtype is not None and floating and not strong_array:
            return self.dtype
        return value.dtype

    def _as_given(self, name: str, given: Any) -> jax.Array:
        """`given` as an array; an int where the factory takes a float as the
        float, where that holds it exactly."""
        value = jnp.asarray(given)
        if (
            _takes_a_float(self.signature.parameters[name])
            and jnp.issubdtype(value.dtype, jnp.integer)
            and value.dtype != jnp.bool_
        ):
            as_float = np.asarray(given, jnp.result_type(float))
            if as_float == np.asarray(given):
                return jnp.asarray(as_float)
        return value

    def _as_state_value(
        self, name: str, value: Any, dtype: Any, where: str, check: bool = True
    ) -> jax.Array:
        """`value` as a strong array of `dtype`; refuses a cast to another
        kind and another shape than the value given (both change it silently)."""
        given = f"the value given to {self._name}: {self.arguments.get(name)!r}"
        try:
            array = jnp.asarray(value)
        except (TypeError, ValueError):  # jax raises ValueError for None
            raise ArgumentError(
                f"{where} holds {describe_value(value)}, but {name} is a numeric "
                f"hyperparameter of dtype {dtype} ({given}). Write a number or "
                "an array."
            ) from None
        shape = jnp.shape(self.numeric[name]) if name in self.numeric else ()
        if array.shape != shape:
            raise ArgumentValueError(
                f"{where} holds {describe_value(array)}, but {name} has shape "
                f"{shape} ({given}); another shape would broadcast into the "
                f"updates and the params. Write a value of shape {shape}."
            )
        if array.dtype == jnp.bool_ and dtype != jnp.bool_:
            raise ArgumentError(
                f"{where} holds {describe_value(array)}, but {name} is a "
                f"hyperparameter of dtype {dtype} ({given}); a bool would be "
                "taken as 0 or 1. Write a number."
            )
        if array.dtype != dtype and not jnp.can_cast(
            array.dtype, dtype, casting="same_kind"
        ):
            raise ArgumentError(
                f"{where} holds {describe_value(array)}, but {name} is a "
                f"hyperparameter of dtype {dtype} (fixed by the value given to "
                f"{self._name}: {self.arguments[name]!r}); casting would change "
                f"the value. Write a value of dtype {dtype}, or build the "
                f"optimizer with {name} given as a value of the dtype you need."
            )
        if check:
            self._check_kept(name, value, dtype, where)
        return jnp.asarray(array, dtype)  # strong: no weak type to lose

    def _check_kept(self, name: str, value: Any, dtype: Any, where: str) -> None:
        """Refuses a known floating value that `dtype` rounds to 0 (from
        nonzero), 1 (from within (0, 1)) or infinity."""
        floating = jnp.issubdtype(dtype, jnp.floating)
        if isinstance(value, jax.core.Tracer) or not floating:
            return
        wanted = np.asarray(value, np.float64)
        with np.errstate(over="ignore"):  # an overflow is reported below
            stored = wanted.astype(dtype).astype(np.float64)
        for lost, becomes in (
            ((wanted != 0) & (stored == 0), "0"),
            ((wanted > 0) & (wanted < 1) & (stored == 1), "1"),
            (np.isfinite(wanted) & ~np.isfinite(stored), "infinity"),
        ):
            if np.any(lost):
                raise ArgumentValueError(
                    f"{where} holds {value!r}, which {jnp.dtype(dtype)} "
                    f"rounds to {becomes}: stored so, it would change what "
                    f"{self._name} computes (a decay rate of 1 averages "
                    f"nothing, an eps of 0 divides by 0). "
                    f"{_wider_hint(self.dtype)} {name} in "
                    f"static_args (handed to {self._name} as given), or give "
                    f"it a value that {jnp.dtype(dtype)} holds."
                )

    def _as_factory_argument(self, stored: jax.Array, weak: bool) -> jax.Array:
        if self.dtype is not None and jnp.issubdtype(stored.dtype, jnp.floating):
            return stored  # hyperparam_dtype: strong, as optax hands it
        return as_weak(stored) if weak else stored

    def _schedule_value(self, name: str, schedule: Any, state: Any, **extra):
        value = schedule(state, **extra)
        if isinstance(value, str) or not isinstance(value, NUMBER_TYPES):
            raise ArgumentError(
                f"The schedule given as {name} returned {describe_value(value)}; "
                "a schedule must return a scalar number (a Python number or a "
                "0-d array) for each step count."
            )
        array = jnp.asarray(value)
        if array.shape != ():
            raise ArgumentValueError(
                f"The schedule given as {name} returned {describe_value(array)}; "
                "a schedule must return a scalar (shape ()) for each step count."
            )
        if not jnp.issubdtype(array.dtype, jnp.number):
            raise ArgumentError(
                f"The schedule given as {name} returned {describe_value(array)}; "
                "a schedule must return a number (int, float or complex)."
            )
        dtype = self._storage_dtype(array, value)
        return self._as_state_value(name, array, dtype, name, check=False)

    def _hyperparams(
        self,
        numeric: dict[str, Any],
        schedule_states: dict[str, Any],
        where: str,
        **extra_args: Any,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The stored and the handed form of every injected hyperparameter
        (of the numeric ones, those named in `numeric`)."""
        stored, handed = {}, {}
        for n, given in self.numeric.items():
            if n not in numeric:
                continue
            dtype = self._storage_dtype(self._as_given(n, given), given)
            stored[n] = self._as_state_value(n, numeric[n], dtype, f"{where}[{n!r}]")
            handed[n] = self._as_factory_argument(stored[n], n in self.weak)
        for n, schedule in self.schedules.items():
            stored[n] = self._schedule_value(
                n, schedule, schedule_states[n], **extra_args
            )
            # Always weak: the bare factory casts a schedule's value to each
            # update's dtype (`optax.scale_by_schedule`), as a weak value is.
            handed[n] = self._as_factory_argument(stored[n], weak=True)
        return stored, handed

    def _traceable(self, params: Any) -> dict[str, Any]:
        """Rule 8: the numeric hyperparameters the factory takes traced, by an
        abstract trial of its init and update; cached by the params' avals."""

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
            except (ArgumentError, ArgumentValueError):
                raise  # our own report on a bad argument
            except Exception:  # noqa: BLE001 - e.g. an update that needs `value=`:
                return True  # not ours to judge; the real call will say
            return True

        key = avals_key(params)
        names = None if key is None else self._traceable_names.get(key)
        if names is None:
            schedule_states = {n: s.init() for n, s in self.schedules.items()}
            if not self.numeric or trial(self.numeric) or not trial(()):
                # All pass; or the trace fails with every number known (a
                # schedule that branches in Python): then no number is the
                # cause, and none is kept static.
                names = tuple(self.numeric)
            else:
                names = tuple(n for n in self.numeric if trial([n]))
            if key is not None:
                self._traceable_names[key] = names
        return {n: self.numeric[n] for n in names}

    def _check_masks(self, params: Any) -> None:
        """A mask argument must fit the params (`optax.masked` would fail deep
        in the factory's init, naming neither)."""
        if not jax.tree.leaves(params):
            # Nothing to mask; `optax.tree_utils.tree_map_params` calls
            # `init` on a tree with no leaves, which `optax.masked` accepts.
            return
        for name, mask in self.passed.items():
            if not is_mask_name(name) or mask is None:
                continue
            tree = mask(params) if _called_as_function(mask) else mask
            try:
                jax.tree.map(lambda m, *_: m, tree, params)
            except (ValueError, TypeError) as error:
                raise ArgumentValueError(
                    f"{name} does not match the params given to init: the mask "
                    f"has the structure {jax.tree.structure(tree)}, the params "
                    f"{jax.tree.structure(params)} ({error}). {name} must be a "
                    "tree of bools with the structure of the params (or a prefix "
                    "of it), or a function params -> such a tree."
                ) from None

    def _check_names(self, hyperparams: Any, params: Any) -> None:
        """Refuses a name written into `state.hyperparams` that is not injected
        (optax ignores it silently), or a number rule 8 keeps static."""
        unknown = sorted(set(hyperparams) - set(self.numeric) - set(self.schedules))
        written = set(hyperparams) & set(self.numeric)
        untraceable = written - set(self._traceable(params)) if written else set()
        written_untraceable = sorted(untraceable)
        if not (unknown or written_untraceable):
            return
        injected = (set(self.numeric) - untraceable) | set(self.schedules)
        if unknown and injected - set(hyperparams):
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
        params = inner_params(params)
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
        check_updates_fit_params(
            updates, params, f"inject_hyperparams({self._name}).update"
        )
        given_params = None if params is None else inner_params(params)
        filled = updates_for_inner(updates, params)
        self._check_names(
            state.hyperparams, filled if given_params is None else given_params
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
            filled, state.inner_state, given_params, **extra_args
        )
        return updates_for_params(
            updates, new_updates, params
        ), optax.InjectStatefulHyperparamsState(
            count=saturating_increment(state.count).astype(jnp.int32),
            hyperparams=stored,
            hyperparams_states=schedule_states,
            inner_state=inner_state,
        )
