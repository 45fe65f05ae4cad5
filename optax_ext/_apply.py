"""`apply_gradients`: an optimizer step and its application to the params in
one call, fused for `MultiSteps` and `skip_when` so that a step that does
not update never builds a tree of zero updates."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from ._transformations import (
    check_transformation,
    fused_owner,
    owner,
    step_and_apply,
)


def _host_emit(emit: Any, optimizer: Any, found: Any) -> bool:
    """`emit` as a Python bool: a Python or NumPy bool (what
    `step % k == k - 1` gives for a NumPy step), a host value. Raises for
    anything else, and unless `found` (the optimizer's `owner`) is a
    `MultiSteps`."""
    numpy_bool = isinstance(emit, (np.bool_, np.ndarray)) and np.shape(emit) == ()
    if not (isinstance(emit, bool) or (numpy_bool and emit.dtype == np.bool_)):
        array = isinstance(emit, jax.Array)
        raise TypeError(
            "optax_ext.apply_gradients: emit must be a bool known on the host "
            "(a Python or NumPy bool, e.g. `step % k == k - 1`), or None, got "
            f"{emit!r} of type {type(emit).__name__}: it chooses which program "
            "to compile"
            + (
                ", so it cannot be a JAX array (traced, or on a device: read "
                "the loop's own step count instead). Under a jitted train "
                "step, make emit static (`jax.jit(..., static_argnames="
                "'emit')`) or, with `eqx.filter_jit`, which traces NumPy "
                "values, pass a Python bool (`bool(step % k == k - 1)`)."
                if array
                else "."
            )
        )
    if not getattr(found, "takes_emit", False):
        raise TypeError(
            "optax_ext.apply_gradients: emit= chooses where an "
            "optax_ext.MultiSteps window ends, so the optimizer must be one "
            f"(or its gradient_transformation()), got {optimizer!r}."
        )
    return bool(emit)


def apply_gradients(
    optimizer: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    *,
    emit: bool | None = None,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """One optimizer step applied to `params`: `optimizer.update` followed by
    `optax.apply_updates`, in one call.

    For any optimizer the result is that of

        updates, opt_state = optimizer.update(grads, opt_state, params, **extra_args)
        params = optax.apply_updates(params, updates)

    with the same operations and dtypes; XLA compiles the one call apart from
    the two, so a float result may differ from theirs in the last bit (an
    ulp). `params` may be a whole Equinox model: a leaf whose gradient is
    `None` (what `eqx.filter_grad` gives for leaves that are not floating
    arrays) is kept as it is, as `eqx.apply_updates` does.

    For `optax_ext.MultiSteps` (and its `gradient_transformation()`) and
    `optax_ext.skip_when`, nested in each other to any depth, the step is
    fused: the params go into the `lax.cond` that decides whether the inner
    optimizer runs, and a step that does not update (a mini-step of a window,
    a skipped step) returns them as they came in. No tree of zero updates is
    built and none is added: with params and state donated, a mini-step
    costs what accumulating the gradients costs. Inside `optax.chain` the
    parts cannot be reached (a chain is a closure), so a chain is applied
    unfused, correctly: put `MultiSteps` outermost, around the chain, as
    usual.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation`, or an
      `optax_ext.MultiSteps`.
    - `grads`: the gradients, with the structure of `params` (or `None`
      where `params` holds no floating array).
    - `opt_state`: the optimizer's state.
    - `params`: the params (or Equinox model) to update.
    - `emit`: for an `optax_ext.MultiSteps` only, a Python or NumPy bool
      from a training loop that knows on the host which step ends a window
      (`step % k == k - 1`): `False` compiles a step that only
      accumulates, `True` one that accumulates and runs the inner
      optimizer on the window's mean, neither with a conditional. The host
      decides: `True` closes the window on this step, whatever
      `every_k_schedule` says (the mean is over the mini-steps it holds),
      and `False` never runs the inner optimizer, even past `k`. Weights,
      skip functions and `axis_name` work as without it; a skipped step or
      a window of weight 0 leaves the params and the inner state as they
      were. `None` (the default): the window decides, in one conditional.
      A loop resumed from a checkpoint must count from the state's
      `mini_step`; `MultiSteps.emits_next(state)` tells whether the window
      would end on the next step, to check the host's choice against.
    - `**extra_args`: passed to `update` (`skip=` for `skip_when`,
      `weight=` for `MultiSteps(weighted=True)`, `value=` for
      `optax.contrib.reduce_on_plateau`, ...).

    **Returns:**

    `(new_params, new_opt_state)`.

    **Example:**

    ```python
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(params, opt_state, batch):
        grads = jax.grad(loss)(params, batch)
        return optax_ext.apply_gradients(opt, grads, opt_state, params)
    ```
    """
    check_transformation(optimizer, "optax_ext.apply_gradients: optimizer")
    if params is None:
        raise TypeError(
            "optax_ext.apply_gradients: params is None; it returns the params "
            "updated, so pass them (a pytree or an Equinox model). For the "
            "updates alone, call optimizer.update(grads, opt_state)."
        )
    if emit is None:
        return step_and_apply(optimizer, grads, opt_state, params, **extra_args)
    emit = _host_emit(emit, optimizer, owner(optimizer))
    fused = fused_owner(optimizer, params, grads)
    if fused is None:
        raise TypeError(
            "optax_ext.apply_gradients(emit=...): a Python number of `params` "
            "has a gradient, so its update would make it an array; store it "
            "as a JAX array (`jnp.asarray`) to choose the window on the host."
        )
    return fused._apply_gradients(grads, opt_state, params, emit=emit, **extra_args)
