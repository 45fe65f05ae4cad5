"""MultiSteps side by side: optax_ext against optax.MultiSteps and the floor.

Run with `nox -s bench` (or `python benchmarks/investigations/run.py`). Everything is
measured in one process, interleaved round-robin (one call of each candidate
per round, in a shuffled order, medians over rounds), so that a noisy shared
machine slows all candidates alike and the ratios stay meaningful. Within a
round a candidate is timed over consecutive calls lasting at least
`_timing.MIN_SECONDS` (one call of a slow one). Each (inner optimizer, size) case
runs in a fresh process.

Candidates, for each inner optimizer and size:

- floor: the least this API can do on a mini-step: fold the gradients into a
  running-mean buffer and return a zero updates tree, both in place (see
  `floor_transform`: written naively, XLA copies every gradient first);
- bare: the inner optimizer's own update;
- optax / ext, mini: a non-emitting step of optax.MultiSteps / optax_ext;
- optax / ext, emit: an emitting step (every_k_schedule=1).

Each step is jitted with the gradients and the state donated, as in a train
step where both are dead after the update. (Donating the state alone makes
JAX pair the returned zero updates with the first params-sized state buffers
it finds, here the inner optimizer's moments, so every candidate that carries
an inner state pays for copying it; see docs/multi_steps.md.)

Also reported: compiled temporary memory (`memory_analysis()`) and the
compile time of the jitted update (median of 15 fresh compiles, interleaved).
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from jax import lax

import optax_ext

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import MIN_SECONDS, machine, time_calls  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
LEAVES = 8
NEVER = 1_000_000_000  # every_k_schedule for steps that never emit

INNER: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "muon": lambda: optax.contrib.muon(1e-3),
}


def make_params(n_params: int) -> dict[str, jax.Array]:
    """`LEAVES` 2-D float32 leaves (muon needs matrices), n_params in all."""
    per_leaf = n_params // LEAVES
    rows = 1 << ((per_leaf.bit_length() - 1) // 2)
    return {f"w{i}": jnp.zeros((rows, per_leaf // rows)) for i in range(LEAVES)}


def _true_after(x: jax.Array) -> jax.Array:
    """A scalar `True` that XLA can only compute once `x` is: one element
    of `x` read by a `reduce_window` (not fused with the loop that makes
    `x`), bit-cast so that no value, NaN included, makes it false."""
    one = lax.reduce_window(x, 0.0, lax.add, (1,) * x.ndim, x.shape, "VALID")
    return (lax.bitcast_convert_type(one.reshape(()), jnp.uint32) | 1) != 0


def floor_transform() -> optax.GradientTransformation:
    """Folds the gradients into a running mean in place and returns zeros.

    The zeros go into the donated gradients' buffers, so they must be
    written after the running-mean loops have read the gradients; written
    as constants, nothing orders them and XLA copies every gradient first.
    Each zero is therefore selected from its gradient on a flag computed
    from the new running mean."""

    def init(params):
        return (jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params=None):
        del params
        n, acc = state
        acc = jax.tree.map(
            lambda a, g: a + (g - a) / (n + 1).astype(a.dtype), acc, grads
        )
        done = functools.reduce(
            jnp.logical_and, [_true_after(a) for a in jax.tree.leaves(acc)]
        )
        zeros = jax.tree.map(lambda g: jnp.where(done, jnp.zeros_like(g), g), grads)
        return zeros, (n + 1, acc)

    return optax.GradientTransformation(init, update)


def candidates(inner: str) -> dict[str, optax.GradientTransformation]:
    make = INNER[inner]
    return {
        "floor": floor_transform(),
        "bare": make(),
        "optax mini": optax.MultiSteps(make(), NEVER).gradient_transformation(),
        "ext mini": optax_ext.MultiSteps(make(), NEVER).gradient_transformation(),
        "optax emit": optax.MultiSteps(make(), 1).gradient_transformation(),
        "ext emit": optax_ext.MultiSteps(make(), 1).gradient_transformation(),
    }


class Runner:
    """One jitted, donated update and the state it carries between calls."""

    def __init__(self, tx: optax.GradientTransformation, params, grads):
        self.params, self.grads = params, grads
        self.step = jax.jit(lambda g, s: tx.update(g, s, params), donate_argnums=(0, 1))
        self.state = tx.init(params)
        start = time.perf_counter()
        self.compiled = self.step.lower(self.fresh_grads(), self.state).compile()
        self.compile_s = time.perf_counter() - start
        self.temp_bytes = self.compiled.memory_analysis().temp_size_in_bytes
        self.times: list[float] = []
        self.call()  # warm up

    def fresh_grads(self):
        return jax.block_until_ready(jax.tree.map(jnp.copy, self.grads))

    def call(self) -> float:
        grads = self.fresh_grads()
        start = time.perf_counter()
        updates, self.state = self.compiled(grads, self.state)
        jax.block_until_ready((updates, self.state))
        return time.perf_counter() - start

    def timed(self, min_seconds: float) -> float:
        return time_calls(self.call, min_seconds)


def compile_time(tx: optax.GradientTransformation, params, grads) -> float:
    """Trace, lower and compile a fresh jit of the update (no cache hit)."""
    state = tx.init(params)
    fn = jax.jit(lambda g, s: tx.update(g, s, params), donate_argnums=(0, 1))
    start = time.perf_counter()
    fn.lower(grads, state).compile()
    return time.perf_counter() - start


def bench(inner: str, n_params: int, rounds: int) -> dict[str, dict[str, float]]:
    params = make_params(n_params)
    key = jax.random.key(0)
    grads = {
        k: jax.random.normal(jax.random.fold_in(key, i), p.shape)
        for i, (k, p) in enumerate(params.items())
    }
    runners = {
        name: Runner(tx, params, grads) for name, tx in candidates(inner).items()
    }
    # Round-robin, in a new order each round, so that no candidate always
    # runs right after a heavy one (muon's emitting steps take seconds).
    order = list(runners.values())
    shuffle = random.Random(n_params).shuffle
    for _ in range(rounds):
        shuffle(order)
        for runner in order:
            runner.times.append(runner.timed(MIN_SECONDS))
    compile_times: dict[str, list[float]] = {"optax mini": [], "ext mini": []}
    for _ in range(15):
        for name in compile_times:
            compile_times[name].append(
                compile_time(candidates(inner)[name], params, grads)
            )
    out = {}
    for name, runner in runners.items():
        out[name] = {
            "ms": 1e3 * statistics.median(runner.times),
            "temp_mb": runner.temp_bytes / 2**20,
            "temp_bytes": runner.temp_bytes,
            "compile_s": statistics.median(compile_times.get(name, [runner.compile_s])),
        }
    return out


def write_table(results, path: Path) -> str:
    lines = [
        f"Machine: {machine()}. Medians of interleaved rounds; "
        "donated grads and state.",
        "",
        "| inner | params | floor ms | bare ms | optax mini ms | ext mini ms "
        "| ext mini / floor | optax mini / floor | optax emit ms | ext emit ms "
        "| ext emit / (bare + floor) | temp MiB optax / ext (mini) "
        "| temp ext - optax (bytes) | compile s optax / ext |",
        "|" + "---|" * 14,
    ]
    for (inner, n), r in results.items():
        ms = {k: v["ms"] for k, v in r.items()}
        lines.append(
            f"| {inner} | {n / 1e6:g}M | {ms['floor']:.2f} | {ms['bare']:.2f} "
            f"| {ms['optax mini']:.2f} | {ms['ext mini']:.2f} "
            f"| **{ms['ext mini'] / ms['floor']:.2f}** "
            f"| {ms['optax mini'] / ms['floor']:.2f} "
            f"| {ms['optax emit']:.2f} | {ms['ext emit']:.2f} "
            f"| **{ms['ext emit'] / (ms['bare'] + ms['floor']):.2f}** "
            f"| {r['optax mini']['temp_mb']:.1f} / {r['ext mini']['temp_mb']:.1f} "
            f"| {r['ext mini']['temp_bytes'] - r['optax mini']['temp_bytes']:+,d} "
            f"| {r['optax mini']['compile_s']:.2f} / {r['ext mini']['compile_s']:.2f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    inners = sorted({inner for inner, _ in results}, key=list(INNER).index)
    fig, axes = plt.subplots(
        1, len(inners), figsize=(4.2 * len(inners), 3.8), squeeze=False
    )
    for ax, inner in zip(axes[0], inners, strict=True):
        sizes = sorted(n for i, n in results if i == inner)
        for name in candidates(inner):
            ax.plot(
                [n / 1e6 for n in sizes],
                [results[inner, n][name]["ms"] for n in sizes],
                marker="o",
                linestyle="--" if name.startswith("optax") else "-",
                label=name,
            )
        ax.set(
            title=f"inner: {inner}", xlabel="params (millions)", ylabel="ms per step"
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"MultiSteps step time ({machine()})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bench_in_subprocess(inner: str, n_params: int, rounds: int) -> dict:
    """`bench` in a fresh Python process, so that what earlier cases left in
    memory (allocator state, compiled programs) does not weigh on this one."""
    out = subprocess.run(
        [sys.executable, __file__, "--case", f"{inner}:{n_params}:{rounds}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,4e6,16e6")
    parser.add_argument("--inner", default=",".join(INNER))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--case", help="inner:n_params:rounds, run here (internal)")
    args = parser.parse_args()
    if args.case:
        inner, n, rounds = args.case.split(":")
        print(json.dumps(bench(inner, int(n), int(rounds))))
        return
    results = {}
    for inner in args.inner.split(","):
        for n in (int(float(s)) for s in args.sizes.split(",")):
            results[inner, n] = bench_in_subprocess(inner, n, args.rounds)
            r = results[inner, n]
            print(
                f"{inner:10s} {n / 1e6:5g}M  "
                + "  ".join(f"{k}={v['ms']:.2f}ms" for k, v in r.items()),
                flush=True,
            )
    RESULTS.mkdir(exist_ok=True)
    print(write_table(results, RESULTS / "multi_steps.md"))
    plot(results, RESULTS / "multi_steps.png")


if __name__ == "__main__":
    main()
