"""`skip_when`: skip the inner optimizer on steps chosen at run time."""

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._accumulate.branch import update_if
from ._leaves import (
    differentiated,
    inner_params,
    restore_none,
    updates_for_inner,
    updates_for_params,
)
from ._records import check_state_structure, strong_as_recorded, traced_state_record
from ._static import Configured, config_key
from ._transformations import (
    check_transformation,
    merge_trainable,
    step_and_apply,
    with_extra_args,
)
from ._tree import check_updates_fit_params, describe_value, known_bool

_UPDATE = ("skip_when.update", "state")
_APPLY = ("optax_ext.apply_gradients", "opt_state")


def _run(skip: jax.Array) -> Any:
    """Whether the inner optimizer runs; a Python bool where `skip` is known."""
    known = known_bool(skip)
    return jnp.logical_not(skip) if known is None else not known


class _SkipWhen(Configured):
    """`inner` and the name of the flag; equal when built from equal ones."""

    def __init__(self, inner: optax.GradientTransformation, flag: str = "skip"):
        check_transformation(inner, "inner")
        if not (isinstance(flag, str) and flag.isidentifier()):
            raise ValueError(f"flag must be a keyword argument name, got {flag!r}.")
        self.inner = with_extra_args(inner)
        self._fusable_inner = inner  # as given: see MultiSteps
        self.flag = flag
        # `check_state_structure`'s answers by the avals of its template.
        self._structures: dict = {}
        self._key = config_key(inner, flag)

    def init(self, params: optax.Params) -> optax.OptState:
        params = inner_params(params)
        traced_state_record(self.inner.init, params, self._structures, is_params=True)
        return self.inner.init(params)

    def update(
        self,
        updates: optax.Updates,
        state: optax.OptState,
        params: optax.Params | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, optax.OptState]:
        skip = self._skip(extra_args)
        check_updates_fit_params(updates, params, "skip_when.update")
        filled = updates_for_inner(updates, params)
        given_params = None if params is None else inner_params(params)
        record = self._check_state(state, given_params, filled, *_UPDATE)

        def inner_update(grads, inner_state):
            return self.inner.update(grads, inner_state, given_params, **extra_args)

        new, new_state, _, _ = update_if(_run(skip), inner_update, (filled,), state)
        new_state = strong_as_recorded(new_state, record)
        return updates_for_params(updates, new, params), new_state

    def _apply_gradients(
        self,
        grads: optax.Updates,
        state: optax.OptState,
        params: optax.Params,
        **extra_args: Any,
    ) -> tuple[optax.Params, optax.OptState]:
        """`update` and `apply_updates`, fused: a skipped step returns `params`."""
        skip = self._skip(extra_args)
        check_updates_fit_params(grads, params, _APPLY[0], "grads")
        record = self._check_state(state, inner_params(params), None, *_APPLY)
        # As in `update`; only the arrays with a gradient go through the conditional.
        arrays = restore_none(grads, differentiated(params))

        def inner_apply(filled, inner_state, arrays):
            new_params, new_state = step_and_apply(
                self._fusable_inner,
                filled,
                inner_state,
                inner_params(merge_trainable(params, arrays)),
                **extra_args,
            )
            return restore_none(arrays, new_params), new_state

        filled = updates_for_inner(grads, params)
        new_arrays, new_state, _, _ = update_if(
            _run(skip), inner_apply, (filled,), state, carry=arrays
        )
        new_state = strong_as_recorded(new_state, record)
        return merge_trainable(params, new_arrays), new_state

    def _check_state(self, state: Any, params: Any, updates: Any, *names: str) -> Any:
        """`state`'s record, checked on `params` where given (a misfit: the state's)."""
        return check_state_structure(
            self.inner.init,
            state,
            updates if params is None else params,
            self._structures,
            is_params=params is not None,
            names=(*names, "skip_when"),
        )

    def _skip(self, extra_args: dict[str, Any]) -> Any:
        """Pops the flag from `extra_args`; without it the step runs."""
        given = extra_args.pop(self.flag, False)
        try:
            skip = None if given is None else jnp.asarray(given)
        except TypeError:
            skip = None
        if skip is None or skip.dtype != jnp.bool_ or skip.shape != ():
            raise TypeError(
                f"skip_when: {self.flag} must be a scalar bool (True skips the "
                f"step; leave it out, or pass False, to run it), got "
                f"{describe_value(given)}."
            )
        # A value known while tracing stays one (`jnp.asarray` of it traces).
        return given if known_bool(given) is not None else skip


def skip_when(
    inner: optax.GradientTransformation, flag: str = "skip"
) -> optax.GradientTransformationExtraArgs:
    """Skips `inner` on steps where the extra argument `flag` is true.

    The optimizer-side counterpart of `stop_gradient_where`: the decision is a
    traced bool passed to `update` as a keyword argument (`optax.chain`
    forwards it), so a jitted step compiles once for both outcomes. Without
    the flag (flax's `TrainState.apply_gradients`) the step is not skipped; a
    misspelt flag is forwarded to `inner` and does not skip either.
    On a skipped step the updates are exact zeros in the inner updates' dtype
    and the inner state is returned untouched. The state is `inner`'s own, so
    wrapping changes no checkpoint, for params of floating arrays. As in
    optax, Python `float` params are optimised (their state strongly typed);
    integer and bool arrays hold `None` in the state (where `inner` alone
    may hold a moment), and their update is zero. Compared with
    `optax.transforms.conditionally_mask`: docs/gradient_context.md.

    **Arguments:**

    - `inner`: the optimizer to skip, an `optax.GradientTransformation`.
    - `flag`: the name of the keyword argument of `update` that decides: a
      scalar bool, `True` to skip the step. Default when `update` is called
      without it: `False` (the step is not skipped).

    **Returns:**

    An `optax.GradientTransformationExtraArgs` whose state is `inner`'s.

    **Example:**

    ```python
    opt = optax.chain(
        optax.clip_by_global_norm(1.0), optax_ext.skip_when(optax.adam(1e-3))
    )
    updates, state = opt.update(grads, state, params, skip=loss_is_spiking)
    ```
    """
    return _SkipWhen(inner, flag).as_transformation()
