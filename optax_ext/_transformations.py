"""What the wrappers share about the optimizer they wrap: the check, extra
arguments, and one step applied to the params (`step_and_apply`), fused for
this package's own."""

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
    """`optax.apply_updates`' arithmetic, keeping a param whose update is
    `None` (as `eqx.apply_updates`)."""

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


def owner(optimizer: Any) -> Configured | None:
    """The object of this package behind `optimizer` (itself, or its
    `Method`s' owner), if any."""
    owner = optimizer
    if isinstance(getattr(optimizer, "update", None), Method):
        owner = optimizer.update.owner
    return owner if isinstance(owner, Configured) else None


def with_extra_args(opt: Any) -> optax.GradientTransformationExtraArgs:
    """`optax.with_extra_args_support(opt)`, except that an optimizer of this
    package keeps its extra arguments (`skip=`, `value=`) when nested."""
    if owner(opt) is not None and not isinstance(
        opt, optax.GradientTransformationExtraArgs
    ):
        return optax.GradientTransformationExtraArgs(opt.init, opt.update)
    return optax.with_extra_args_support(opt)


def fused_owner(optimizer: Any, params: Any, grads: Any) -> Any:
    """The `owner` that fuses `optimizer`'s step, if any; None where a Python
    number of `params` has a gradient (a conditional cannot return it as a
    number), so that step is applied unfused."""
    found = owner(optimizer)
    if not hasattr(found, "_apply_gradients"):
        return None

    def number_with_gradient(g: Any, p: Any) -> bool:
        return g is not None and isinstance(p, (int, float, complex))

    try:
        flags = jax.tree.map(number_with_gradient, grads, params, is_leaf=is_none)
    except (ValueError, TypeError):
        return found  # its own checks say what does not fit
    return None if any(jax.tree.leaves(flags)) else found


def step_and_apply(
    optimizer: Any,
    grads: optax.Updates,
    opt_state: optax.OptState,
    params: optax.Params,
    **extra_args: Any,
) -> tuple[optax.Params, optax.OptState]:
    """`optimizer.update` then `apply_updates`, or `fused_owner`'s fused step."""
    found = fused_owner(optimizer, params, grads)
    if found is not None:
        return found._apply_gradients(grads, opt_state, params, **extra_args)
    updates, opt_state = optimizer.update(grads, opt_state, params, **extra_args)
    return apply_updates(params, updates), opt_state
