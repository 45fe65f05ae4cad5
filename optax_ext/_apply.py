"""`apply_gradients`: an optimizer step and its application to the params in
one call, fused for `MultiSteps` and `skip_when` so that a step that does
not update never builds a tree of zero updates."""

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
    """`emit` as a Python bool; raises unless it is a host bool and `found`
    (the optimizer's `owner`) a `MultiSteps`."""
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

    with the same operations and dtypes (compiled apart, a float may differ
    in the last bit). `params` may be a whole Equinox model: a leaf whose
    gradient is `None` is kept as it is, as `eqx.apply_updates` does.

    For `optax_ext.MultiSteps` (and its `gradient_transformation()`) and
    `optax_ext.skip_when`, nested to any depth, the step is fused: the params
    go into the `lax.cond` that decides whether the inner optimizer runs, and
    a step that does not update returns them as they came in, with no tree of
    zero updates built. An `optax.chain` (a closure) is applied unfused: put
    `MultiSteps` outermost, around the chain.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation`, or an
      `optax_ext.MultiSteps`.
    - `grads`: the gradients, with the structure of `params` (or `None`
      where `params` holds no floating array).
    - `opt_state`: the optimizer's state.
    - `params`: the params (or Equinox model) to update.
    - `emit`: for an `optax_ext.MultiSteps` only, a Python or NumPy bool
      chosen on the host (`step % k == k - 1`): `True` closes the window on
      this step, whatever `every_k_schedule` says, and runs the inner
      optimizer on its mean; `False` only accumulates, even past `k`. Each
      compiles without a conditional; weights, skip functions and
      `axis_name` work as without it. `None` (the default): the window
      decides, in one conditional. `MultiSteps.emits_next(state)` checks the
      host's choice (docs/multi_steps.md, "The fused train step").
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
