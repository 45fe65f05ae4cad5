"""Train a bfloat16 Equinox MLP with gradient accumulation through a NaN batch.

The optimizer is a composition that plain optax cannot run on this setup:

    optax_ext.MultiSteps(
        optax.chain(
            optax_ext.zero_nans(),
            optax_ext.inject_hyperparams(optax.adamw)(
                learning_rate=<warmup-cosine schedule>,
                weight_decay=...,
                mask=<the model as a tree of bools: weights True, biases False>,
            ),
        ),
        every_k_schedule=4,
    )

What the run shows:

- the whole Equinox model, activation functions included, goes to
  `opt.init(model)` and `opt.update(grads, state, model)`, with no
  `eqx.filter(model, eqx.is_array)`;
- the weight-decay mask is itself an `eqx.nn.MLP` (a callable pytree) and is
  passed with no `static_args`;
- the parameters are bfloat16 and stay bfloat16, Adam's `b2=0.999` is not
  rounded to 1.0, and the jitted train step is traced once;
- one micro-batch has a NaN in its inputs, so its gradients are NaN.
  `zero_nans` zeroes them when that window's update is emitted, the
  accumulator starts the next window clean, and training carries on;
- the first lines of output show what plain optax does with the same pieces.

The data is synthetic, made with `jax.random`. From the repository root:

    python examples/train_equinox.py [--steps N] [--seed S]

Exits non-zero if the final loss is not well below the initial loss, if a
parameter is not finite or not bfloat16, or if the train step was retraced.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

import optax_ext

DTYPE = jnp.bfloat16
IN_SIZE = 8
WIDTH = 64
DEPTH = 2
NUM_SAMPLES = 4096
MICRO_BATCH = 64
EVERY_K = 4  # micro-batches per optimizer update
PEAK_LR = 1e-2
WEIGHT_DECAY = 1e-2
LOG_EVERY = 20  # steps between progress-bar refreshes (each reads back the loss)


@jax.jit
def make_dataset(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Float32 inputs of shape (NUM_SAMPLES, IN_SIZE) and scalar targets."""
    kx, kw, kn = jax.random.split(key, 3)
    x = jax.random.normal(kx, (NUM_SAMPLES, IN_SIZE))
    w = jax.random.normal(kw, (2, IN_SIZE)) / jnp.sqrt(IN_SIZE)
    y = jnp.sin(2.0 * x @ w[0]) + 0.5 * (x @ w[1]) ** 2
    return x, y + 0.05 * jax.random.normal(kn, y.shape)


@functools.partial(jax.jit, static_argnames="num_steps")
def sample_micro_batches(
    key: jax.Array, x: jax.Array, y: jax.Array, num_steps: int, nan_step: int
) -> tuple[jax.Array, jax.Array]:
    """`num_steps` stacked micro-batches; one input of batch `nan_step` is NaN."""
    idx = jax.random.randint(key, (num_steps, MICRO_BATCH), 0, x.shape[0])
    return x[idx].at[nan_step, 0, 0].set(jnp.nan), y[idx]


def weight_decay_mask(model: eqx.nn.MLP) -> eqx.nn.MLP:
    """The model with a bool at every leaf: `True` at the weight matrices only.

    Biases and the non-array leaves (the activation functions) get `False`.
    The mask is an `eqx.nn.MLP` too, so it is callable, and
    `optax.inject_hyperparams` takes it for a schedule (optax issue #1373).
    """
    mask = jax.tree.map(lambda _: False, model)
    weights = lambda m: [layer.weight for layer in m.layers]
    return eqx.tree_at(weights, mask, replace=[True] * len(model.layers))


def loss_fn(model: eqx.nn.MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean squared error; the model runs in bfloat16, the mean in float32."""
    pred = jax.vmap(model)(x.astype(DTYPE))
    return jnp.mean((pred.astype(jnp.float32) - y) ** 2)


def make_optimizer(
    model: eqx.nn.MLP, num_updates: int
) -> tuple[optax_ext.MultiSteps, optax.Schedule]:
    # inject_hyperparams evaluates the schedule on its own step count, which
    # MultiSteps advances once per emitted update, not once per micro-batch.
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=PEAK_LR / 10,  # the first update already moves the model
        peak_value=PEAK_LR,
        warmup_steps=max(1, num_updates // 10),
        decay_steps=num_updates,
        end_value=PEAK_LR / 20,
    )
    adamw = optax_ext.inject_hyperparams(optax.adamw)(
        learning_rate=schedule,
        weight_decay=WEIGHT_DECAY,
        mask=weight_decay_mask(model),
    )
    optimizer = optax_ext.MultiSteps(
        optax.chain(optax_ext.zero_nans(), adamw), every_k_schedule=EVERY_K
    )
    return optimizer, schedule


def make_train_step(optimizer: optax_ext.MultiSteps):
    """The jitted train step, closing over `optimizer`, and its trace count."""
    num_traces = 0

    @eqx.filter_jit
    def train_step(model, opt_state, x, y):
        nonlocal num_traces
        num_traces += 1  # Python side effect: runs when tracing, not per call.

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = optimizer.update(grads, opt_state, model)
        model = eqx.apply_updates(model, updates)

        zero_nans_state, adamw_state = opt_state.inner_opt_state
        emitted = optimizer.has_updated(opt_state)
        # The inner state changes only when an update is emitted: `found_nan`
        # says whether the update emitted on this step had NaN zeroed.
        found_nan = jnp.any(jnp.stack(jax.tree.leaves(zero_nans_state.found_nan)))
        metrics = {
            "loss": loss,
            "nan_grads": sum(jnp.isnan(g).sum() for g in jax.tree.leaves(grads)),
            "emitted": emitted,
            "found_nan": emitted & found_nan,
            "lr": adamw_state.hyperparams["learning_rate"],
        }
        return model, opt_state, metrics

    return train_step, lambda: num_traces


def train(train_step, model, opt_state, xs, ys):
    """Runs `train_step` on each micro-batch; returns the metrics stacked."""
    history = []
    with tqdm(range(len(xs)), unit="step", ncols=88) as progress:
        for step in progress:
            model, opt_state, metrics = train_step(model, opt_state, xs[step], ys[step])
            history.append(metrics)  # device arrays: no host sync here
            if step % LOG_EVERY == 0 or step == len(xs) - 1:
                progress.set_postfix(
                    loss=f"{float(metrics['loss']):.4f}",
                    lr=f"{float(metrics['lr']):.2e}",
                )
    history = jax.tree.map(lambda *m: np.stack(m), *jax.device_get(history))
    return model, opt_state, history


def error_type(fn: Callable[[], object]) -> str:
    """The name of the exception `fn()` raises, or 'no error'."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - report whatever optax raises
        return type(e).__name__
    return "no error"


def nan_count(tree) -> str:
    """'NaN entries/all entries' over the array leaves of `tree`."""
    leaves = jax.device_get(jax.tree.leaves(tree))
    return f"{sum(np.isnan(x).sum() for x in leaves)}/{sum(x.size for x in leaves)}"


def show_plain_optax(model, schedule, grads, nan_grads) -> None:
    """What plain optax does with the same model and optimizer pieces."""
    mask = weight_decay_mask(model)
    params = eqx.filter(model, eqx.is_array)
    multi_steps = optax.MultiSteps(optax.adamw(schedule), EVERY_K)
    adamw = optax.inject_hyperparams(optax.adamw)(schedule, WEIGHT_DECAY, mask=mask)
    print("plain optax, same model and optimizer:")
    print(
        "  optax.MultiSteps(...).init(model):            ",
        error_type(lambda: multi_steps.init(model)),
        "(non-array leaves; equinox #590)",
    )
    print(
        "  optax.inject_hyperparams(adamw)(mask=eqx_mask):",
        error_type(lambda: adamw.init(params)),
        "(calls the mask as a schedule; optax #1373)",
    )

    # With both workarounds, eqx.filter and static_args="mask":
    adamw = optax.inject_hyperparams(optax.adamw, static_args="mask")(
        schedule, WEIGHT_DECAY, mask=mask
    )
    updates, _ = jax.jit(adamw.update)(grads, adamw.init(params), params)
    print(
        f"  ...with static_args='mask', eqx.filter:        first update "
        f"{nan_count(updates)} NaN, {jax.tree.leaves(updates)[0].dtype} "
        "(b2=0.999 is 1.0 in bf16)"
    )

    # A NaN micro-batch, then a clean window: 0 * nan == nan keeps it.
    multi_steps = optax.MultiSteps(
        optax.chain(optax.zero_nans(), optax.sgd(PEAK_LR)), EVERY_K
    )
    update = jax.jit(multi_steps.update)
    state = multi_steps.init(params)
    for g in [nan_grads] + [grads] * (2 * EVERY_K - 1):
        _, state = update(g, state, params)
    print(
        f"  optax.MultiSteps, a window after the NaN batch: "
        f"{nan_count(state.acc_grads)} accumulator entries still NaN, for good"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=800, help="micro-batches (default: 800)"
    )
    parser.add_argument("--seed", type=int, default=0, help="PRNG seed (default: 0)")
    args = parser.parse_args()
    if args.steps < 4 * EVERY_K:
        parser.error(f"--steps must be at least {4 * EVERY_K}")

    data_key, model_key, batch_key = jax.random.split(jax.random.key(args.seed), 3)
    x, y = make_dataset(data_key)
    model = eqx.nn.MLP(IN_SIZE, "scalar", WIDTH, DEPTH, dtype=DTYPE, key=model_key)
    # The bad micro-batch is the second of its window, about a third of the way in.
    nan_step = args.steps // 3 // EVERY_K * EVERY_K + 1
    xs, ys = sample_micro_batches(batch_key, x, y, args.steps, nan_step)
    optimizer, schedule = make_optimizer(model, num_updates=args.steps // EVERY_K)

    grad_fn = eqx.filter_jit(eqx.filter_grad(loss_fn))
    show_plain_optax(
        model,
        schedule,
        grads=grad_fn(model, xs[0], ys[0]),
        nan_grads=grad_fn(model, xs[nan_step], ys[nan_step]),
    )

    print(
        f"\noptax_ext: {args.steps} micro-batches of {MICRO_BATCH}, an update every "
        f"{EVERY_K}; micro-batch {nan_step} has a NaN input"
    )
    # The whole model, not eqx.filter'ed. Jitted only because one compile is
    # quicker than dispatching the init op by op.
    opt_state = eqx.filter_jit(optimizer.init)(model)
    train_step, num_traces = make_train_step(optimizer)
    full_batch_loss = eqx.filter_jit(loss_fn)
    initial_loss = float(full_batch_loss(model, x, y))

    start = time.perf_counter()
    model, opt_state, history = train(train_step, model, opt_state, xs, ys)
    elapsed = time.perf_counter() - start
    final_loss = float(full_batch_loss(model, x, y))

    _, adamw_state = opt_state.inner_opt_state
    params = jax.device_get(jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    num_params = sum(p.size for p in params)
    nan_steps = np.flatnonzero(history["nan_grads"]).tolist()
    found_nan_steps = np.flatnonzero(history["found_nan"]).tolist()
    lr = float(adamw_state.hyperparams["learning_rate"])
    print(f"full-batch loss:       {initial_loss:.4f} -> {final_loss:.4f}")
    print(
        f"updates emitted:       {int(history['emitted'].sum())} "
        f"(state.gradient_step = {int(opt_state.gradient_step)})"
    )
    print(
        f"NaN gradient entries:  {int(history['nan_grads'].sum())} of {num_params} "
        f"params, at micro-batch {nan_steps}, zeroed by zero_nans"
    )
    print(f"found_nan was True at: the update emitted on step {found_nan_steps}")
    print(f"learning rate now:     {lr:.3e} (state.hyperparams)")
    print(f"train step traced:     {num_traces()}x; loop {elapsed:.1f}s incl. compile")

    failures = []
    if not final_loss < 0.2 * initial_loss:
        failures.append(
            f"final loss {final_loss:.4f} is not below 0.2 x initial {initial_loss:.4f}"
        )
    if not all(np.isfinite(p).all() for p in params):
        failures.append("some parameters are not finite")
    if any(p.dtype != DTYPE for p in params):
        dtypes = sorted({str(p.dtype) for p in params})
        failures.append(f"parameters are {dtypes}, not only bfloat16")
    if num_traces() != 1:
        failures.append(f"the train step was traced {num_traces()} times, not once")
    if failures:
        sys.exit("FAILED: " + "; ".join(failures))
    print("OK: loss down, all parameters finite and bfloat16, one trace.")


if __name__ == "__main__":
    main()
