"""Time per global batch and compiled memory of five ways to train on a batch
of K micro-batches, on one device: the full batch in one step (no
accumulation), `optax_ext.microbatched` and `optax.microbatching.microbatch`
(one jitted step looping over the micro-batches; optax's with its MEAN
accumulator), and `optax_ext.MultiSteps` and `optax.MultiSteps` (K jitted
mini-steps driven from Python, the last one applying adam).

    python benchmarks/microbatched.py

Same MLP, data and adam for all; candidates run interleaved round-robin in
one process (each round times one global batch of each); medians reported.
Memory is the compiled step's `memory_analysis()`: temporaries, and
arguments + outputs - aliased (the live buffers the step holds), for the one
jitted function each candidate calls (for the wrappers, the mini-step).
Writes benchmarks/results/microbatched.md.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pathlib  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from functools import partial  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import optax_ext  # noqa: E402

K = 8
BATCH = 4096
IN, WIDTH, DEPTH = 64, 512, 4
ROUNDS = 15
RESULTS = pathlib.Path(__file__).parent / "results"


def loss(params, batch):
    x, y = batch
    h = x
    for w in params[:-1]:
        h = jax.nn.gelu(h @ w)
    return jnp.mean((h @ params[-1] - y) ** 2)


def problem():
    keys = jax.random.split(jax.random.key(0), DEPTH + 3)
    sizes = [IN] + [WIDTH] * DEPTH + [1]
    params = [
        jax.random.normal(k, (a, b)) / jnp.sqrt(a)
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=False)
    ]
    x = jax.random.normal(keys[-2], (BATCH, IN))
    y = jax.random.normal(keys[-1], (BATCH, 1))
    return params, (x, y)


def candidates(params, batch):
    adam = optax.adam(1e-3)
    grad_fn = jax.grad(loss)
    micro = [jax.tree.map(lambda a, j=j: a[j::K], batch) for j in range(K)]

    def in_step(grad_fn):
        @partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, batch):
            grads = grad_fn(params, batch)
            updates, state = adam.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        def run(params, state):
            return step(params, state, batch)

        return step, run, adam.init(params), batch

    def wrapper(opt):
        @partial(jax.jit, donate_argnums=(0, 1))
        def step(params, state, batch):
            updates, state = opt.update(grad_fn(params, batch), state, params)
            return optax.apply_updates(params, updates), state

        def run(params, state):
            for j in range(K):
                params, state = step(params, state, micro[j])
            return params, state

        return step, run, opt.init(params), micro[0]

    return {
        "full batch": in_step(grad_fn),
        "microbatched": in_step(optax_ext.microbatched(grad_fn, K)),
        "optax.microbatching.microbatch": in_step(
            optax.microbatching.microbatch(
                grad_fn,
                argnums=1,
                microbatch_size=BATCH // K,
                accumulator=optax.microbatching.AccumulationType.MEAN,
            )
        ),
        "optax_ext.MultiSteps": wrapper(optax_ext.MultiSteps(adam, K)),
        "optax.MultiSteps": wrapper(optax.MultiSteps(adam, K)),
    }


def memory(step, params, state, batch):
    stats = step.lower(params, state, batch).compile().memory_analysis()
    live = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )
    return stats.temp_size_in_bytes, live


def main() -> None:
    params, batch = problem()
    cands = candidates(params, batch)
    times = {name: [] for name in cands}
    states = {}
    for name, (_, run, state, _) in cands.items():
        p = jax.tree.map(jnp.copy, params)
        states[name] = jax.block_until_ready(run(p, state))  # compile, warm up
    for _ in range(ROUNDS):
        for name, (_, run, _, _) in cands.items():
            p, s = states[name]
            start = time.perf_counter()
            states[name] = jax.block_until_ready(run(p, s))
            times[name].append(time.perf_counter() - start)
    n_params = sum(p.size for p in params)
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].platform} ({jax.device_count()} device), jax "
        f"{jax.__version__}, optax {optax.__version__}. MLP {IN}-"
        f"{'-'.join([str(WIDTH)] * DEPTH)}-1 (gelu), {n_params / 1e6:.2f}M float32 "
        f"params, global batch {BATCH} rows in K = {K} micro-batches, adam; "
        f"median of {ROUNDS} interleaved rounds.",
        "",
        "| form | ms / global batch | jitted calls / global batch "
        "| compiled temp MiB | args + outputs - aliased MiB |",
        "|---|---|---|---|---|",
    ]
    for name, (step, _, state, example) in cands.items():
        temp, live = memory(step, params, state, example)
        calls = K if name.endswith("MultiSteps") else 1
        lines.append(
            f"| {name} | {1e3 * statistics.median(times[name]):.1f} | {calls} "
            f"| {temp / 2**20:.1f} | {live / 2**20:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "microbatched.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
