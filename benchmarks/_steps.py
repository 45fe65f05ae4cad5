"""The train steps the benchmarks time, and their inputs, built once for all.

A step is `(init(params) -> state, step(params, state, grads) -> (params,
state))`, jitted by the caller with params and state donated. `make` is a
function returning a fresh inner optimizer.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import optax_ext

NEVER = 1_000_000_000  # every_k_schedule of a window that never closes
Step = tuple[Callable, Callable]


def params_and_grads(shapes, dtype: str):
    """Params of `shapes` (a pytree of shape tuples) in `dtype`, and
    gradients for them (the same every step: they are passed in, not donated)."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    normal = lambda key, shape: (0.01 * jax.random.normal(key, shape)).astype(dtype)
    make, key = jax.jit(normal, static_argnums=1), jax.random.key(0)
    params = [make(jax.random.fold_in(key, i), s) for i, s in enumerate(leaves)]
    params = treedef.unflatten(params)
    cos = lambda p: jax.tree.map(lambda x: jnp.cos(100 * x).astype(x.dtype), p)
    return params, jax.jit(cos)(params)


def accumulate_transform() -> optax.GradientTransformation:
    """A running mean in a float32 buffer, `acc + (g - acc) / (n + 1)`: the
    arithmetic of a MultiSteps mini-step (`update` returns the new state)."""

    def init(params):
        acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return jnp.zeros((), jnp.int32), acc

    def fold(grads, state):
        n, acc = state
        acc = jax.tree.map(
            lambda a, g: a + (g.astype(a.dtype) - a) / (n + 1).astype(a.dtype),
            acc,
            grads,
        )
        return n + 1, acc

    return optax.GradientTransformation(init, fold)


def plain_multi_steps(inner: optax.GradientTransformation, k: int):
    """A ~40-line MultiSteps with one plain `lax.cond`: `(init, update,
    apply)`, `apply` returning the new params (the fused form)."""

    def init(params):
        acc = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return jnp.zeros((), jnp.int32), acc, inner.init(params)

    def fold(grads, state):
        n, acc, inner_state = state

        def one(a, g):
            g = g.astype(a.dtype)
            return jnp.where(n == 0, g, a + (g - a) / (n + 1).astype(a.dtype))

        return n, jax.tree.map(one, acc, grads), inner_state, n + 1 >= k

    def mean(acc, params):
        return jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)

    def finish(n, acc, emit, inner_state):
        acc = jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a), acc)
        return jnp.where(emit, 0, n + 1), acc, inner_state

    def update(grads, state, params):
        n, acc, inner_state, emit = fold(grads, state)

        def run(acc, inner_state):
            return inner.update(mean(acc, params), inner_state, params)

        def idle(acc, inner_state):
            return jax.tree.map(jnp.zeros_like, params), inner_state

        updates, inner_state = jax.lax.cond(emit, run, idle, acc, inner_state)
        return updates, finish(n, acc, emit, inner_state)

    def apply(grads, state, params):
        n, acc, inner_state, emit = fold(grads, state)

        def run(acc, inner_state, params):
            updates, inner_state = inner.update(mean(acc, params), inner_state, params)
            return optax.apply_updates(params, updates), inner_state

        def idle(acc, inner_state, params):
            return params, inner_state

        params, inner_state = jax.lax.cond(emit, run, idle, acc, inner_state, params)
        return params, finish(n, acc, emit, inner_state)

    return init, update, apply


def train_step(opt, apply=optax.apply_updates) -> Step:
    """The drop-in form: `opt.update`, then `apply(params, updates)`."""

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return apply(params, updates), state

    return opt.init, step


def fused(opt, emit: bool | None = None) -> Step:
    """`optax_ext.apply_gradients`; `emit` chosen by the host when given."""
    kwargs = {} if emit is None else {"emit": emit}
    return opt.init, lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p, **kwargs)


def multi_steps(make: Callable[[], optax.GradientTransformation], k: int) -> dict:
    """name -> step of every MultiSteps with `every_k_schedule=k`: `optax`
    and `ext` (drop-in), `ext fused`, `plain` and `plain fused`."""
    p_init, p_update, p_apply = plain_multi_steps(make(), k)

    def plain(params, state, grads):
        updates, state = p_update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return {
        "optax": train_step(optax.MultiSteps(make(), k)),
        "ext": train_step(optax_ext.MultiSteps(make(), k)),
        "ext fused": fused(optax_ext.MultiSteps(make(), k)),
        "plain": (p_init, plain),
        "plain fused": (p_init, lambda p, s, g: p_apply(g, s, p)),
    }


def floors(make: Callable[[], optax.GradientTransformation]) -> dict[str, Step]:
    """The least a mini-step can cost, params returned untouched:

    - `accumulate`: the gradients folded into the running mean, alone;
    - `accumulate+state`: that, the inner optimizer's state passed through;
    - `floor`: that plus `optax.apply_updates(params, zeros)` (XLA folds
      `p + 0` away, so it costs what `accumulate+state` does);
    - `updates floor`: `accumulate+state`, then zero updates XLA cannot fold
      (each leaf written under a `lax.cond` on a traced `False`, as any API
      handing back updates writes them) added by `optax.apply_updates`: the
      least the drop-in `update` API can cost.
    """
    acc = accumulate_transform()
    held = make()

    def accumulate(params, state, grads):
        return params, acc.update(grads, state)

    def init_holding(params):
        return acc.init(params), held.init(params)

    def accumulate_holding(params, state, grads):
        acc_state, inner_state = state
        return params, (acc.update(grads, acc_state), inner_state)

    def floor(params, state, grads):
        params, state = accumulate_holding(params, state, grads)
        zeros = jax.tree.map(jnp.zeros_like, params)
        return optax.apply_updates(params, zeros), state

    def updates_floor(params, state, grads):
        params, state = accumulate_holding(params, state, grads)
        never = state[0][0] < 0  # the count: a traced False

        def zeros(never):
            # One scalar per leaf, so XLA writes each leaf once (no copies).
            leaves, treedef = jax.tree.flatten(params)
            return treedef.unflatten(
                [
                    jnp.full(p.shape, jnp.where(never, i + 1, 0), p.dtype)
                    for i, p in enumerate(leaves)
                ]
            )

        updates = jax.lax.cond(never, zeros, zeros, never)
        return optax.apply_updates(params, updates), state

    return {
        "accumulate": (acc.init, accumulate),
        "accumulate+state": (init_holding, accumulate_holding),
        "floor": (init_holding, floor),
        "updates floor": (init_holding, updates_floor),
    }


def scanned(steps: Callable | list[Callable], n_steps: int) -> Callable:
    """`n_steps` steps in one `lax.scan`, each iteration running `steps` in
    order (one step, or a window of them)."""
    steps = steps if isinstance(steps, list) else [steps]

    def run(params, state, grads):
        def body(carry, _):
            for step in steps:
                carry = step(*carry, grads)
            return carry, None

        length = n_steps // len(steps)
        return jax.lax.scan(body, (params, state), None, length=length)[0]

    return run
