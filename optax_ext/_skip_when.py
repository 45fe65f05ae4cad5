"""`skip_when`: skip the inner optimizer on steps chosen at run time."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from ._accumulate.branch import known_bool, update_if
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
from ._tree import check_updates_fit_params, describe_value


def _run(skip: jax.Array) -> Any:
    """Whether the inner optimizer runs: a Python bool where `skip` is
    known while tracing (then no conditional is built)."""
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
        # What init built the state from: the params where given (then a
        # state that does not fit is the state's fault, not the updates').
        record = self._check_state(
            state,
            filled if given_params is None else given_params,
            "skip_when.update",
            "state",
            is_params=given_params is not None,
        )

        def inner_update(grads, inner_state):
            return self.inner.update(grads, inner_state, given_params, **extra_args)

        new_updates, new_state, _ = update_if(
            _run(skip), inner_update, (filled,), state
        )
        new_state = strong_as_recorded(new_state, record)
        return updates_for_params(updates, new_updates, params), new_state

    def _apply_gradients(
        self,
        grads: optax.Updates,
        state: optax.OptState,
        params: optax.Params,
        **extra_args: Any,
    ) -> tuple[optax.Params, optax.OptState]:
        """`update` and applying it to `params`, fused: a skipped step
        returns `params` as they came in (see `optax_ext.apply_gradients`)."""
        skip = self._skip(extra_args)
        check_updates_fit_params(grads, params, "optax_ext.apply_gradients", "grads")
        record = self._check_state(
            state,
            inner_params(params),
            "optax_ext.apply_gradients",
            "opt_state",
            is_params=True,
        )
        # The inner step gets what `update` gives it: `updates_for_inner`'s
        # gradients (a zero for a Python number, such as `eqx.nn.Dropout`'s
        # `p`, whose gradient is `None`: its state holds moments) and
        # `inner_params`. Only the arrays with a gradient go through the
        # conditional and come back new; the other leaves stay outside, as
        # `update`'s `None` updates leave them.
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
        new_arrays, new_state, _ = update_if(
            _run(skip), inner_apply, (filled,), state, carry=arrays
        )
        new_state = strong_as_recorded(new_state, record)
        return merge_trainable(params, new_arrays), new_state

    def _check_state(
        self, state: Any, template: Any, who: str, state_name: str, *, is_params: bool
    ) -> Any:
        """Checks `state` against what `inner.init` builds from params like
        `template`; returns the record for `_records.strong_as_recorded`."""
        return check_state_structure(
            self.inner.init,
            state,
            template,
            self._structures,
            is_params=is_params,
            who=who,
            state_name=state_name,
            owner="skip_when",
        )

    def _skip(self, extra_args: dict[str, Any]) -> Any:
        """Pops the flag from `extra_args`. Without it the step is not
        skipped: callers that pass no extra arguments (flax's
        `TrainState.apply_gradients`) run `inner`."""
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
    traced bool passed to `update` as a keyword argument (through
    `optax.chain`, which forwards extra arguments), so a jitted step compiles
    once for both outcomes. The flag is optional: an `update` called without
    it (as flax's `TrainState.apply_gradients` calls it) is not skipped, and
    `inner` runs as if unwrapped (for the params it optimises: below). Mind
    its spelling: a misspelt keyword is forwarded to `inner` like any other
    extra argument, and does not skip.
    On a skipped step the updates are exact zeros in the inner updates' dtype
    and the inner state is returned untouched; on other steps `inner` runs
    as usual. The state is `inner`'s own, so wrapping changes no checkpoint,
    for params of floating arrays. As in optax, Python `float` leaves of the
    params are optimised (their state strongly typed from `init` on); integer
    and bool arrays are not: they hold `None` in the state, where `inner`'s
    own state may hold a moment for them, and their update is zero.

    Compared with `optax.transforms.conditionally_mask(inner, fn,
    forward_extra_args=True)`: its zeros take the dtype of the incoming
    gradients, so an inner optimizer that returns another dtype (float32
    gradients for bfloat16 params) makes its `lax.cond` fail; the flag is
    also forwarded to the inner optimizer; and it wraps the state in a new
    type.

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
