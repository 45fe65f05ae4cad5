"""`inject_hyperparams`: a drop-in for `optax.inject_hyperparams`.

Which arguments become schedules, which are injected into
`state.hyperparams`, and which are passed through unchanged is decided once,
when the wrapped factory is called, from the argument itself and the
factory's signature. The rule is in `inject_hyperparams`'s docstring.
"""

from __future__ import annotations

import collections.abc
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
from ._static import ConfigKey, Method, config_key
from ._tree import as_weak, saturating_increment, trainable

_STATIC, _NUMERIC, _SCHEDULE, _STATEFUL = "static", "numeric", "schedule", "stateful"


def _is_mask_name(name: str) -> bool:
    return name == "mask" or name.endswith("_mask")


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


def _classify(name: str, value: Any, param: inspect.Parameter, static: set[str]) -> str:
    if name in static or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
        return _STATIC
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


def _as_hyperparam(value: Any, dtype: Any, weak: bool) -> jax.Array:
    """A numeric hyperparameter as it is stored and handed to the factory.

    `weak` is decided once per name: true for hyperparameters given as Python
    numbers or schedules. Those are made weakly typed on every step, so they
    promote exactly as the Python float given to the bare factory would, even
    after a checkpoint round trip has made them strong. Arrays the user typed
    explicitly keep their dtype. `dtype`, if given, is applied to floating
    values, as optax does.
    """
    array = jnp.asarray(value)
    if dtype is not None and jnp.issubdtype(array.dtype, jnp.floating):
        return array.astype(dtype)
    return as_weak(array) if weak else array


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

    **Numerics:** injecting never changes the arithmetic of the optimizer.
    Python numbers and schedule outputs are stored as weakly typed arrays,
    which promote exactly as the Python float given to the bare factory
    would: with bfloat16 params, `b2=0.999` is not rounded to `1.0` before
    the bias correction, and the updates have the bare optimizer's dtype.
    Arrays given explicitly keep their dtype. `hyperparam_dtype`, if given,
    casts every floating hyperparameter to it, as in optax.

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
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        injection = _Injection(
            inner_factory, signature, bound.arguments, static, hyperparam_dtype
        )
        return optax.GradientTransformationExtraArgs(
            Method(injection, "init"), Method(injection, "update")
        )

    return wrapped_factory


class _Injection:
    """One call of a wrapped factory: its arguments, sorted by kind, and the
    `init` and `update` functions built from them. Two injections compare
    equal when built from the same factory and equal arguments."""

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
        # Given as Python numbers: made weak on every step (see _as_hyperparam).
        self.weak = {
            n for n, v in self.numeric.items() if type(v) in (int, float, complex)
        }
        self.schedules = {
            n: v if kinds[n] == _STATEFUL else optax.schedules.WrappedSchedule(v)
            for n, v in arguments.items()
            if kinds[n] in (_SCHEDULE, _STATEFUL)
        }
        self._key = (
            config_key(factory, dtype, tuple(sorted(static))),
            tuple((n, ConfigKey(v)) for n, v in arguments.items()),
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Injection) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def _build(
        self, hyperparams: dict[str, Any]
    ) -> optax.GradientTransformationExtraArgs:
        call = inspect.BoundArguments(self.signature, self.arguments.copy())  # type: ignore[arg-type]
        call.arguments.update(hyperparams)
        call.arguments.update(self.passed)
        return optax.with_extra_args_support(self.factory(*call.args, **call.kwargs))

    def _hyperparams(
        self,
        numeric: dict[str, Any],
        schedule_states: dict[str, Any],
        **extra_args: Any,
    ) -> dict[str, Any]:
        # Only the names in `numeric` are injected: `init` leaves out those
        # the factory cannot take traced (see `_traceable`), and `update`
        # follows the state.
        hyperparams = {
            n: _as_hyperparam(numeric[n], self.dtype, weak=n in self.weak)
            for n in self.numeric
            if n in numeric
        }
        for n, schedule in self.schedules.items():
            value = schedule(schedule_states[n], **extra_args)
            hyperparams[n] = _as_hyperparam(value, self.dtype, weak=True)
        return hyperparams

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
            def run(traced):
                tx = self._build(traced)
                state = tx.init(params)
                return tx.update(jax.tree.map(jnp.zeros_like, params), state, params)

            values = {
                n: _as_hyperparam(self.numeric[n], self.dtype, n in self.weak)
                for n in names
            }
            try:
                jax.eval_shape(run, values)
            except jax.errors.ConcretizationTypeError:
                return False
            except Exception:  # noqa: BLE001 - e.g. an update that needs `value=`:
                return True  # not ours to judge; the real call will say
            return True

        if not self.numeric or trial(self.numeric):
            return dict(self.numeric)
        return {n: v for n, v in self.numeric.items() if trial([n])}

    def init(self, params: Any) -> optax.InjectStatefulHyperparamsState:
        params = trainable(params)
        schedule_states = {n: s.init() for n, s in self.schedules.items()}
        hyperparams = self._hyperparams(self._traceable(params), schedule_states)
        return optax.InjectStatefulHyperparamsState(
            count=jnp.zeros((), jnp.int32),
            hyperparams=hyperparams,
            hyperparams_states=schedule_states,
            inner_state=mirror_param_sharding(
                self._build(hyperparams).init(params), params
            ),
        )

    def update(
        self,
        updates: Any,
        state: optax.InjectStatefulHyperparamsState,
        params: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, optax.InjectStatefulHyperparamsState]:
        if params is not None:
            params = trainable(params)
        hyperparams = self._hyperparams(
            state.hyperparams, state.hyperparams_states, **extra_args
        )
        schedule_states = {
            n: s.update(state.hyperparams_states[n], **extra_args)
            for n, s in self.schedules.items()
        }
        updates, inner_state = self._build(hyperparams).update(
            updates, state.inner_state, params, **extra_args
        )
        count = saturating_increment(state.count)
        return updates, optax.InjectStatefulHyperparamsState(
            count=count.astype(jnp.int32),
            hyperparams=hyperparams,
            hyperparams_states=schedule_states,
            inner_state=inner_state,
        )
