"""Two costs of a call on XLA:CPU that no change to the program's arithmetic
removes, measured on minimal jitted functions (no optax_ext code).

Run with `python benchmarks/cpu_runtime.py` (`--quick` for a smoke run that
writes nothing). They bound what a `MultiSteps` mini-step can reach with many
small leaves (`docs/design.md`, "What a call costs on XLA:CPU"):

- a `lax.cond` whose running branch is not taken: `cond(False, heavy,
  identity, xs)` over 96 donated leaves of (64, 64), where `heavy` holds `k`
  extra reduction kernels a leaf. The idle branch does the same work in
  every case (none); the time still grows with the kernels compiled into the
  branch that does not run;
- buffers handed in and out of a donated call: a running sum over 96 leaves
  (the accumulate of a mini-step) that also takes `m` more donated buffers
  a leaf and returns them untouched (an inner optimizer's state passed
  through).

Every candidate is compiled first, then timed round-robin in a shuffled
order each round (consecutive calls lasting at least `MIN_SECONDS`),
medians over rounds; the slopes are least-squares fits over the candidates.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).parent))
from run import machine  # noqa: E402

RESULTS = Path(__file__).parent / "results"
MIN_SECONDS = 0.05
LEAVES = 96


HELD = 4  # buffers a leaf that every idle-branch candidate passes through


def heavy(kind: str, k: int) -> Callable:
    """The running branch: each leaf doubled, and `k` more kernels a leaf:
    elementwise ones, each writing one of the held buffers, or reductions of
    the leaf (each a kernel of its own) that scale it."""

    def branch(bufs):
        xs, held = list(bufs[0]), list(bufs[1])
        if kind == "elementwise":
            for j in range(k * len(xs)):
                held[j] = held[j] + xs[j % len(xs)] * (j % 7 + 1.5)
            return [x * 2 for x in xs], held
        out = []
        for x in xs:
            s = jnp.sum(x)
            for j in range(1, k):
                s = s + jnp.max(x * (j + 1.5))
            out.append(x * s)
        return out, held

    return branch


def branch_kernels(compiled) -> dict[str, int]:
    """Kernels in the branches of the compiled module's conditionals, by
    kind: fusions holding a reduction, other fusions, other ops (copies)."""
    text = compiled.as_text()
    bodies = dict(re.findall(r"\n%([\w.\-]+) \([^\n]*\{\n(.*?)\n\}", text, re.S))
    branches = set()
    for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
        branches |= {name.strip().lstrip("%") for name in group.split(",")}
    count = {"reduction": 0, "elementwise": 0, "other": 0}
    for name in branches:
        for line in bodies.get(name, "").splitlines():
            m = re.search(r"= \S+ ([\w\-]+)\(", line)
            if not m or m.group(1) in ("parameter", "get-tuple-element", "tuple"):
                continue
            if m.group(1) in ("constant", "bitcast"):
                continue
            if m.group(1) != "fusion":
                count["other"] += 1
                continue
            callee = re.search(r"calls=%([\w.\-]+)", line)
            body = bodies.get(callee.group(1), "") if callee else ""
            count["reduction" if "reduce(" in body else "elementwise"] += 1
    return count


class Case:
    """One compiled call and the donated buffers it carries between calls."""

    def __init__(self, fn: Callable, args: object, extra: tuple = ()):
        self.args = jax.tree.map(jnp.copy, args)  # donated: the first argument
        self.extra = extra
        self.compiled = jax.jit(fn, donate_argnums=0).lower(self.args, *extra).compile()
        self.times: list[float] = []
        self.call()

    def call(self) -> float:
        start = time.perf_counter()
        self.args = self.compiled(self.args, *self.extra)
        jax.block_until_ready(self.args)
        return time.perf_counter() - start

    def timed(self) -> float:
        total, calls = 0.0, 0
        while total < MIN_SECONDS or calls == 0:
            total += self.call()
            calls += 1
        return total / calls


def idle_branch_step(kind: str, k: int) -> Callable:
    """`cond(flag, heavy, identity, bufs)`: called with `flag` False."""
    running = heavy(kind, k)

    def idle(bufs):
        return list(bufs[0]), list(bufs[1])

    return lambda bufs, flag: lax.cond(flag, running, idle, bufs)


def idle_branch_cases(quick: bool) -> dict[str, tuple[Case, dict[str, int]]]:
    flag = jnp.asarray(False)
    grid = [(64, "elementwise", 0), (64, "elementwise", 4), (64, "reduction", 2)]
    if not quick:
        grid += [
            (64, "elementwise", 2),
            (64, "reduction", 1),
            (64, "reduction", 4),
            (256, "elementwise", 0),
            (256, "reduction", 2),
        ]
    cases = {}
    for side, kind, k in sorted(grid):
        xs = [jnp.full((side, side), 1.0 + i) for i in range(LEAVES)]
        held = [jnp.zeros((side, side)) for _ in range(HELD * LEAVES)]
        case = Case(idle_branch_step(kind, k), (xs, held), (flag,))
        cases[f"{side}:{kind}:{k}"] = (case, branch_kernels(case.compiled))
    return cases


def pass_through_cases(quick: bool) -> dict[str, tuple[Case, int]]:
    def step(bufs):
        acc, g, held = bufs
        return ([a + x for a, x in zip(acc, g, strict=True)], g, held)

    cases = {}
    shape = (64, 64)
    acc = [jnp.zeros(shape) for _ in range(LEAVES)]
    # The gradients ride along donated too, returned as they came in, so
    # that every candidate hands the same buffers back; only `held` grows.
    g = [jnp.ones(shape) for _ in range(LEAVES)]
    for m in (0, 2) if quick else (0, 1, 2, 3):
        held = [jnp.zeros(shape) for _ in range(m * LEAVES)]
        cases[str(m)] = (Case(step, (acc, g, held)), m * LEAVES)
    return cases


def run_interleaved(
    cases: dict[str, tuple[Case, Any]], rounds: int
) -> dict[str, float]:
    order = [case for case, _ in cases.values()]
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for case in order:
            case.times.append(case.timed())
    return {
        name: 1e6 * statistics.median(case.times) for name, (case, _) in cases.items()
    }


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="smoke run, writes nothing"
    )
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds

    idle = idle_branch_cases(args.quick)
    passing = pass_through_cases(args.quick)
    idle_us = run_interleaved(idle, rounds)
    pass_us = run_interleaved(passing, rounds)

    def fit(kind: str) -> float:
        """us a call per kernel of `kind`: the slope over the (64, 64) rows
        that add kernels of that kind (and the row adding none)."""
        rows = [
            n for n in idle if n.startswith("64:") and (kind in n or n.endswith(":0"))
        ]
        return slope([idle[n][1][kind] for n in rows], [idle_us[n] for n in rows])

    per_buffer = slope([passing[n][1] for n in passing], [pass_us[n] for n in passing])

    lines = [
        "# What a call costs on XLA:CPU",
        "",
        "Generated by `python benchmarks/cpu_runtime.py`; do not edit by hand.",
        f"Machine: {machine()}.",
        "",
        f"Medians of {rounds} interleaved rounds, microseconds a call; minimal "
        "jitted functions, no optax_ext code (see the script's docstring).",
        "",
        "## A conditional's branch that does not run",
        "",
        f"`lax.cond(False, heavy, identity, bufs)`, {LEAVES} donated leaves and "
        f"{HELD} more donated buffers a leaf passed through; `heavy` adds k "
        "kernels a leaf, elementwise or reductions. The branch taken does "
        "nothing in every row.",
        "",
        "| leaf shape | extra kernels a leaf | reduction kernels in the branches "
        "| elementwise kernels | other ops | us a call |",
        "|---|---|---|---|---|---|",
    ]
    for name, (_, kernels) in idle.items():
        side, kind, k = name.split(":")
        lines.append(
            f"| ({side}, {side}) | {k} {kind} | {kernels['reduction']} | "
            f"{kernels['elementwise']} | {kernels['other']} | {idle_us[name]:.1f} |"
        )
    lines += [
        "",
        "Each kernel compiled into the branch that does not run adds to every "
        f"call: a reduction {fit('reduction'):.2f} us, an elementwise kernel "
        f"{fit('elementwise'):.2f} us (least-squares slopes over the (64, 64) rows).",
    ]
    if "256:reduction:2" in idle:
        lines.append(
            "Two reductions a leaf add "
            f"{idle_us['64:reduction:2'] - idle_us['64:elementwise:0']:.1f} us "
            "with leaves of (64, 64) and "
            f"{idle_us['256:reduction:2'] - idle_us['256:elementwise:0']:.1f} us "
            "with leaves of (256, 256), 16 times larger."
        )
    lines += [
        "",
        "## Buffers passed through a donated call",
        "",
        f"A running sum over {LEAVES} leaves of (64, 64) that also takes m "
        "more donated buffers a leaf and returns them untouched.",
        "",
        "| m | buffers passed through | us a call |",
        "|---|---|---|",
    ]
    for name, (_, n) in passing.items():
        lines.append(f"| {name} | {n} | {pass_us[name]:.1f} |")
    lines += [
        "",
        f"Each buffer passed through adds {per_buffer:.2f} us to every call "
        "(least-squares slope).",
        "",
    ]
    text = "\n".join(lines)
    if args.quick:
        print(text)
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_runtime.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
