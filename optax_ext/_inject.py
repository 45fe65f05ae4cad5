"""`inject_hyperparams`: a drop-in for `optax.inject_hyperparams`.

Which arguments become schedules, which are injected into
`state.hyperparams`, and which are passed through unchanged is decided once,
when the wrapped factory is called (`_inject_arguments.py`); the `init` and
`update` built from them are `_injection.Injection`'s.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import optax

from ._inject_arguments import binding_hint, check_hyperparam_dtype
from ._injection import Injection
from ._tree import describe_value


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
    an int given where the factory takes a float, by its default or its
    annotation, as a float: `weight_decay=0`, `learning_rate=1`), so the
    state's avals survive checkpoints. Where it is handed to the factory, a
    hyperparameter given as a Python number or a weakly typed array, and
    every schedule value, is made weakly typed, so it promotes as the Python
    number would: with bfloat16 params `b2=0.999` is not rounded to bfloat16
    (`1.0`) and the updates have the bare optimizer's dtype. The updates are
    bit for bit those of the bare factory given each injected number rounded
    to its stored dtype (`b2=float(np.float32(0.999))`). They
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
    mask that does not fit the params, a value given or written that its
    storage dtype rounds to 0, 1 or infinity (`b2=0.999` in bfloat16: Adam's
    updates would be NaN; a schedule's values are not checked) (at `init`,
    or `update` where known); a name written into
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
    hyperparam_dtype = check_hyperparam_dtype(hyperparam_dtype)
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
                binding_hint(
                    error,
                    signature,
                    kwargs,
                    getattr(inner_factory, "__name__", repr(inner_factory)),
                )
            ) from None
        bound.apply_defaults()
        injection = Injection(
            inner_factory, signature, bound.arguments, static, hyperparam_dtype
        )
        return injection.as_transformation()

    return wrapped_factory
