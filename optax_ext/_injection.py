"""The optimizer `inject_hyperparams(factory)(...)` returns, and rule 8."""

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

from . import _tree
from ._leaves import inner_params, updates_for_inner, updates_for_params
from ._records import avals_key
from ._sharding import mirror_param_sharding
from ._static import ConfigKey, Configured, config_key
from ._transformations import with_extra_args
from ._tree import as_weak, describe_value, is_transformation, is_weak

STATIC, NUMERIC, SCHEDULE, STATEFUL = "static", "numeric", "schedule", "stateful"
NUMBER_TYPES = (numbers.Number, np.ndarray, np.generic, jax.Array)


class ArgumentError(TypeError):
    """A bad argument, reported by us: rule 8's abstract trial lets it through."""


class ArgumentValueError(ValueError):
    """A bad argument value, reported by us (see `ArgumentError`)."""


def is_mask_name(name: str) -> bool:
    return name == "mask" or name.endswith("_mask")


def _takes_a_float(param: inspect.Parameter) -> bool:
    """Whether `param`'s default is a float or its annotation has `float`, not `int`."""
    annotation = param.annotation
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = typing.get_args(annotation) if union else (annotation,)
    return isinstance(param.default, float) or (float in members and int not in members)


def _wider_hint(hyperparam_dtype: Any) -> str:
    """The first words of `_check_kept`'s advice: how to store a wider value."""
    if hyperparam_dtype is not None:
        return "Use a wider hyperparam_dtype (None keeps each value's dtype), name"
    if not jax.config.jax_enable_x64:
        return "Enable float64 (`jax.config.update('jax_enable_x64', True)`), name"
    return "Name"


class Injection(Configured):
    """One call of a wrapped factory; equal to one of the same factory and arguments."""

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
        self._name = getattr(factory, "__name__", repr(factory))
        self.arguments = dict(arguments)
        self.passed = {n: v for n, v in arguments.items() if kinds[n] == STATIC}
        self.numeric = {n: v for n, v in arguments.items() if kinds[n] == NUMERIC}
        weak = lambda v: type(v) in (int, float, complex) or is_weak(v)
        self.weak = {n for n, v in self.numeric.items() if weak(v)}
        wrap = {SCHEDULE: optax.schedules.WrappedSchedule, STATEFUL: lambda s: s}
        self.schedules = {
            n: wrap[kinds[n]](v) for n, v in arguments.items() if kinds[n] in wrap
        }
        self._traceable_names: dict[tuple, tuple[str, ...]] = {}
        self._key = (
            config_key(factory, dtype, tuple(sorted(static))),
            tuple((n, ConfigKey(v)) for n, v in arguments.items()),
        )

    def _build(
        self, hyperparams: dict[str, Any]
    ) -> optax.GradientTransformationExtraArgs:
        arguments = {**self.arguments, **hyperparams, **self.passed}
        call = inspect.BoundArguments(self.signature, arguments)  # type: ignore[arg-type]
        tx = self.factory(*call.args, **call.kwargs)
        if not is_transformation(tx):
            raise ArgumentError(
                f"inner_factory {self._name} returned {describe_value(tx)}; it must "
                "return an optax.GradientTransformation (an object with init and "
                "update), as optax.adam does."
            )
        return with_extra_args(tx)

    def _storage_dtype(self, value: jax.Array, given: Any) -> Any:
        """`hyperparam_dtype` for a floating value unless a strong JAX array's."""
        floating = jnp.issubdtype(value.dtype, jnp.floating)
        strong_array = isinstance(given, jax.Array) and not is_weak(given)
        cast = self.dtype is not None and floating and not strong_array
        return self.dtype if cast else value.dtype

    def _as_given(self, name: str) -> jax.Array:
        """`name`'s given value as an array; an int for a float as a float, if exact."""
        given = self.numeric[name]
        value = jnp.asarray(given)
        integer = jnp.issubdtype(value.dtype, jnp.integer)  # a bool is not
        if integer and _takes_a_float(self.signature.parameters[name]):
            as_float = np.asarray(given, jnp.result_type(float))
            if as_float == np.asarray(given):
                return jnp.asarray(as_float)
        return value

    def _as_state_value(self, name: str, value: Any, where: str) -> jax.Array:
        """`value` as numeric `name`'s strong array; refuses another kind or shape."""
        dtype = self._storage_dtype(self._as_given(name), self.numeric[name])
        given = f"the value given to {self._name}: {self.numeric[name]!r}"
        holds = lambda v: f"{where} holds {describe_value(v)}, but {name}"
        try:
            array = jnp.asarray(value)
        except (TypeError, ValueError):  # jax raises ValueError for None
            raise ArgumentError(
                f"{holds(value)} is a numeric hyperparameter of dtype {dtype} "
                f"({given}). Write a number or an array."
            ) from None
        shape = jnp.shape(self.numeric[name])
        if array.shape != shape:
            raise ArgumentValueError(
                f"{holds(array)} has shape {shape} ({given}); another shape would "
                f"broadcast into the updates and params. Write one of shape {shape}."
            )
        as_number = array.dtype == jnp.bool_ and dtype != jnp.bool_
        kept = array.dtype == dtype or jnp.can_cast(array.dtype, dtype, "same_kind")
        if as_number or not kept:
            why = "casting would change the value"
            why = "a bool would be taken as 0 or 1" if as_number else why
            raise ArgumentError(
                f"{holds(array)} is a hyperparameter of dtype {dtype} (fixed by "
                f"{given}); {why}. Write a value of dtype {dtype}, or build the "
                f"optimizer with {name} given as a value of the dtype you need."
            )
        self._check_kept(name, value, dtype, where)
        return jnp.asarray(array, dtype)  # strong: no weak type to lose

    def _check_kept(self, name: str, value: Any, dtype: Any, where: str) -> None:
        """Refuses a known value `dtype` rounds to 0, 1 (from below) or infinity."""
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
                    f"{where} holds {value!r}, which {dtype} rounds to {becomes}: "
                    f"stored so, it would change what {self._name} computes (a decay "
                    "rate of 1 averages nothing, an eps of 0 divides by 0). "
                    f"{_wider_hint(self.dtype)} {name} in static_args (handed to "
                    f"{self._name} as given), or give it a value that {dtype} holds."
                )

    def _as_factory_argument(self, stored: jax.Array, weak: bool) -> jax.Array:
        if self.dtype is not None and jnp.issubdtype(stored.dtype, jnp.floating):
            return stored  # hyperparam_dtype: strong, as optax hands it
        return as_weak(stored) if weak else stored

    def _schedule_value(self, name: str, state: Any, **extra: Any) -> jax.Array:
        value = self.schedules[name](state, **extra)
        number = isinstance(value, NUMBER_TYPES) and not isinstance(value, str)
        array = jnp.asarray(value) if number else None
        if array is None or array.shape or not jnp.issubdtype(array.dtype, jnp.number):
            error = ArgumentValueError if number and array.shape else ArgumentError
            raise error(
                f"The schedule given as {name} returned {describe_value(value)}; a "
                "schedule must return a number of shape () for each step count: a "
                "Python number, or an int, float or complex array."
            )
        # A number of shape (): nothing for `_as_state_value` to refuse
        return jnp.asarray(array, self._storage_dtype(array, value))

    def _hyperparams(
        self,
        numeric: dict[str, Any],
        schedule_states: dict[str, Any],
        where: str,
        **extra_args: Any,
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The stored and handed forms of the schedules and of `numeric`'s names."""
        stored, handed = {}, {}
        for n in [m for m in self.numeric if m in numeric]:
            stored[n] = self._as_state_value(n, numeric[n], f"{where}[{n!r}]")
            handed[n] = self._as_factory_argument(stored[n], n in self.weak)
        for n in self.schedules:
            stored[n] = self._schedule_value(n, schedule_states[n], **extra_args)
            # Weak, as optax.scale_by_schedule casts it to each update's dtype
            handed[n] = self._as_factory_argument(stored[n], weak=True)
        return stored, handed

    def _traceable(self, params: Any) -> dict[str, Any]:
        """Rule 8: the numbers an abstract trial shows the factory takes traced."""

        def run(numeric):
            _, handed = self._hyperparams(numeric, schedule_states, "arguments")
            tx = self._build(handed)
            state = tx.init(params)
            return tx.update(jax.tree.map(jnp.zeros_like, params), state, params)

        def trial(names: Iterable[str]) -> bool:
            try:
                jax.eval_shape(run, {n: self.numeric[n] for n in names})
            except (ArgumentError, ArgumentValueError):
                raise  # our own report on a bad argument
            except Exception as error:  # noqa: BLE001 - the real call reports it
                return not isinstance(error, jax.errors.ConcretizationTypeError)
            return True

        key = avals_key(params)
        names = self._traceable_names.get(key)
        if names is None:
            schedule_states = {n: s.init() for n, s in self.schedules.items()}
            # All pass; or all fail with every number known (a schedule that
            # branches in Python), so that no number is the cause: none static.
            every = not self.numeric or trial(self.numeric) or not trial(())
            names = tuple(n for n in self.numeric if every or trial([n]))
            if key is not None:
                self._traceable_names[key] = names
        return {n: self.numeric[n] for n in names}

    def _check_masks(self, params: Any) -> None:
        """A mask must fit the params (`optax.masked` would fail deep in init)."""
        if not jax.tree.leaves(params):  # `optax.tree_utils.tree_map_params` calls
            return  # init on no leaves, which `optax.masked` accepts: nothing to mask
        for name, mask in self.passed.items():
            if not is_mask_name(name) or mask is None:
                continue
            # optax.masked calls it if every leaf is (an Equinox model's are not)
            called = jax.tree.leaves(jax.tree.map(callable, mask))
            tree = mask(params) if called and all(called) else mask
            try:
                jax.tree.map(lambda m, *_: m, tree, params)
            except (ValueError, TypeError) as error:
                raise ArgumentValueError(
                    f"{name} does not match the params given to init: the mask has "
                    f"the structure {jax.tree.structure(tree)}, the params "
                    f"{jax.tree.structure(params)} ({error}). {name} must be a tree of "
                    "bools with the structure of the params (or a prefix of it), or a "
                    "function params -> such a tree."
                ) from None

    def _check_names(self, hyperparams: Any, params: Any) -> None:
        """Refuses a name in `state.hyperparams` not injected (optax ignores it)."""
        unknown = sorted(set(hyperparams) - set(self.numeric) - set(self.schedules))
        written = set(hyperparams) & set(self.numeric)
        untraceable = written - set(self._traceable(params)) if written else set()
        if not (unknown or untraceable):
            return
        numeric = sorted(set(self.numeric) - untraceable)
        injected = sorted({*numeric, *self.schedules})
        if unknown and set(injected) - set(hyperparams):
            raise TypeError(
                f"inject_hyperparams({self._name}).update's `state` was not built by "
                f"this optimizer: its hyperparams are {sorted(hyperparams)}, where "
                f"this optimizer injects {injected}. Pass the state its init returned."
            )
        notes, branched = [], sorted(untraceable)
        if static := sorted(set(self.passed) & set(unknown)):
            notes.append(f"; {static} are passed to the factory unchanged (static)")
        if branched:
            notes.append(
                f"; {branched} are numbers the factory branches on in Python, passed "
                "through unchanged"
            )
        raise KeyError(
            f"state.hyperparams holds {unknown or branched}, which {self._name} "
            f"does not take as an injected hyperparameter: the injected ones are "
            f"{numeric} and the schedules {sorted(self.schedules)}{''.join(notes)}. A "
            "value written there is ignored: give it when building the optimizer."
        )

    def init(self, params: Any) -> optax.InjectStatefulHyperparamsState:
        params = inner_params(params)
        self._check_masks(params)
        schedule_states = {n: s.init() for n, s in self.schedules.items()}
        numeric = self._traceable(params)
        stored, handed = self._hyperparams(numeric, schedule_states, "arguments")
        inner_state = mirror_param_sharding(self._build(handed).init(params), params)
        return optax.InjectStatefulHyperparamsState(
            jnp.zeros((), jnp.int32), stored, schedule_states, inner_state
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
                f"state must be the optax.InjectStatefulHyperparamsState returned by "
                f"this optimizer's init or update; got {describe_value(state)}."
            )
        where = f"inject_hyperparams({self._name}).update"
        _tree.check_updates_fit_params(updates, params, where)
        given_params = inner_params(params)
        filled = updates_for_inner(updates, params)
        self._check_names(state.hyperparams, filled if params is None else given_params)
        schedule_states = state.hyperparams_states
        stored, handed = self._hyperparams(
            state.hyperparams, schedule_states, "state.hyperparams", **extra_args
        )
        next_states = {
            n: s.update(schedule_states[n], **extra_args)
            for n, s in self.schedules.items()
        }
        new_updates, inner = self._build(handed).update(
            filled, state.inner_state, given_params, **extra_args
        )
        count = _tree.saturating_increment(state.count).astype(jnp.int32)
        state = optax.InjectStatefulHyperparamsState(count, stored, next_states, inner)
        return updates_for_params(updates, new_updates, params), state
