"""`apply_gradients`: an optimizer step and its application to the params in
one call, fused for `MultiSteps` and `skip_when` so that a step that does
not update never builds a tree of zero updates."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jaxtyping import PyTree

from ._leaves import is_none
from ._static import Configured, Method
from ._tree import is_transformation


def check_transformation(value: Any, name: str) -> None:
    """Raises a `TypeError` unless `value` has callable `init` and `update`."""
    if not is_transformation(value):
        hint = (
            " A factory such as `optax.adam` must be called to build one: "
            "`optax.adam(1e-3)`."
            if callable(value)
            else ""
        )
        raise TypeError(
            f"{name} must be an optax.GradientTransformation (with `init` and "
            f"`update`), got {value!r} of type {type(value).__name__}.{hint}"
        )


def apply_updates(params: optax.Params, updates: optax.Updates) -> optax.Params:
    """`optax.apply_updates`' arithmetic (`p + u` cast back to the dtype of
    `p`) with `eqx.apply_updates`' tree handling: where `updates` holds
    `None` (what `eqx.filter_grad` gives for a leaf that is not a floating
    array: a function, an integer buffer) the params leaf is kept as it is.
    """

    def apply(u: Any, p: Any) -> Any:
        if u is None:
            return p
        return jnp.asarray(p + u).astype(jnp.asarray(p).dtype)

    return jax.tree.map(apply, updates, params, is_leaf=is_none)


def merge_trainable(params: PyTree, new: PyTree) -> PyTree:
    """`params` with each leaf that `new` holds (not `None`) replaced by it."""
    return jax.tree.map(
        lambda n, p: p if n is None else n, new, params, is_leaf=is_none
    )


def _owner(optimizer: Any) -> Configured | None:
    """The object of this package behind `optimizer`, if any: a `MultiSteps`
    itself, or the owner behind the `Method`s of
    `MultiSteps.gradient_transformation()` and `skip_when(...)`."""
    owner = optimizer
    if isinstance(getattr(optimizer, "update", None), Method):
        owner = optimizer.update.owner
    return owner if isinstance(owner, Configured) else None


def with_extra_args(opt: Any) -> optax.GradientTransformationExtraArgs:
    """`opt` as an `optax.GradientTransformationExtraArgs` that forwards extra
    keyword arguments wherever `apply_gradients` forwards them: as
    `optax.with_extra_args_support`, except that an optimizer of this
    package (a `MultiSteps`, a `skip_when`, in any form) keeps them, so a
    nested one still gets `skip=` and `value=` (as its `update` does when
    called directly)."""
    if _owner(opt) is not None and not isinstance(
        opt, optax.GradientTransformationExtraArgs
    ):
        return optax.GradientTransformationExtraArgs(opt.init, opt.update)
    return optax.with_extra_args_support(opt)


def _fused(optimizer: Any, params: Any) -> Any:
    """The object whose `_apply_gradients` fuses `optimizer`'s step, if any
    (`_owner`). None when `params` holds a Python number, which cannot pass
    through a `cond` as itself (such a step is applied unfused)."""
    owner = _owner(optimizer)
    if not hasattr(owner, "_apply_gradients"):
        return None
    if any(isinstance(x, (int, float, complex)) for x in jax.tree.leaves(params)):
        return None
    return owner


def apply_gradients(
    optimizer: optax.GradientTransformation,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
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
    owner = _fused(optimizer, params)
    if owner is not None:
        return owner._apply_gradients(grads, opt_state, params, **extra_args)
    updates, opt_state = optimizer.update(grads, opt_state, params, **extra_args)
    return apply_updates(params, updates), opt_state
