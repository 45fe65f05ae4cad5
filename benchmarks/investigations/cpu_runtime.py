"""Two costs of a call on XLA:CPU that no change to a program's arithmetic
removes, measured on minimal jitted functions (no optax_ext code).

Run with `python benchmarks/investigations/cpu_runtime.py` (`--quick` for a
smoke run that writes nothing). They bound what a `MultiSteps` mini-step can
reach with many small leaves (`docs/design.md`, "What no program change removes"):

- reductions compiled into a `lax.cond` branch that is not taken:
  `cond(False, heavy, identity, xs)` over 96 donated leaves, where `heavy`
  scales each leaf by `k` reductions of it (`k = 0`: doubles it). Every
  candidate hands the same buffers in and out, no copy is compiled anywhere
  (checked), and the branch taken does nothing; only the kernels of the
  branch not taken differ. Leaves of (64, 64) and of (256, 256);
- buffers handed in and out of a donated call: a running sum over 96 leaves
  (the accumulate of a mini-step) that also takes `m` more donated buffers
  a leaf and returns them untouched (an inner optimizer's state passed
  through), with leaves of (64, 64) and of (256, 256).

Every candidate is compiled first, then timed round-robin in a shuffled
order each round (consecutive calls lasting at least `MIN_SECONDS`). Times
are medians over rounds. A cost per kernel or per buffer is the
least-squares slope of one round's times of a series; the median and the
quartiles of those slopes over the rounds are reported.
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

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import machine, time_calls  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "results"
MIN_SECONDS = 0.05
LEAVES = 96
SIDES = (64, 256)


def heavy(k: int) -> Callable:
    """Each leaf scaled by `k` reductions of it (each a kernel of its own);
    with `k = 0`, doubled."""

    def branch(xs):
        out = []
        for x in xs:
            if k == 0:
                out.append(x * 2)
                continue
            s = jnp.sum(x)
            for j in range(1, k):
                s = s + jnp.max(x * (j + 1.5))
            out.append(x * s)
        return out

    return branch


def idle_branch_step(k: int) -> Callable:
    """`cond(flag, heavy(k), identity, xs)`: called with `flag` False."""
    running = heavy(k)
    return lambda xs, flag: lax.cond(flag, running, list, xs)


def kernels(compiled) -> dict[str, int]:
    """Reductions (fusions holding a `reduce`) in the branches of the
    compiled module's conditionals, and copies anywhere."""
    text = compiled.as_text()
    bodies = dict(
        re.findall(r"\n(?:ENTRY )?%([\w.\-]+) \([^\n]*\{\n(.*?)\n\}", text, re.S)
    )
    branches = set()
    for group in re.findall(r"branch_computations=\{([^}]*)\}", text):
        branches |= {name.strip().lstrip("%") for name in group.split(",")}
    reductions = 0
    for name in branches:
        for callee in re.findall(r" fusion\(.*calls=%([\w.\-]+)", bodies.get(name, "")):
            reductions += "reduce(" in bodies.get(callee, "")
    return {"reductions": reductions, "copies": len(re.findall(r" copy\(", text))}


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
        return time_calls(self.call, MIN_SECONDS)


def idle_branch_cases(quick: bool) -> dict[tuple[int, int], tuple[Case, int]]:
    """(side, k) -> (case, reductions in the branches)."""
    flag = jnp.asarray(False)
    cases = {}
    for side in SIDES[:1] if quick else SIDES:
        xs = [jnp.full((side, side), 1.0 + i) for i in range(LEAVES)]
        for k in (0, 2) if quick else (0, 2, 4, 8):
            case = Case(idle_branch_step(k), xs, (flag,))
            found = kernels(case.compiled)
            if found["copies"]:
                raise RuntimeError(
                    f"k={k}, leaves of ({side}, {side}): {found['copies']} copies "
                    "compiled; the candidates would differ by more than the "
                    "branch not taken."
                )
            cases[(side, k)] = (case, found["reductions"])
    return cases


def pass_through_cases(quick: bool) -> dict[tuple[int, int], tuple[Case, int]]:
    """(side, m) -> (case, buffers passed through beyond the running sum's)."""

    def step(bufs):
        acc, g, held = bufs
        return ([a + x for a, x in zip(acc, g, strict=True)], g, held)

    cases = {}
    for side in SIDES[:1] if quick else SIDES:
        acc = [jnp.zeros((side, side)) for _ in range(LEAVES)]
        # The gradients ride along donated too, returned as they came in, so
        # that every candidate hands them back; only `held` grows.
        g = [jnp.ones((side, side)) for _ in range(LEAVES)]
        for m in (0, 2) if quick else (0, 1, 2, 3):
            held = [jnp.zeros((side, side)) for _ in range(m * LEAVES)]
            cases[(side, m)] = (Case(step, (acc, g, held)), m * LEAVES)
    return cases


def run_interleaved(cases: dict, rounds: int) -> None:
    order = [case for case, _ in cases.values()]
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for case in order:
            case.times.append(case.timed())


def median_us(case: Case) -> float:
    return 1e6 * statistics.median(case.times)


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def round_slopes(series: list[tuple[Case, int]]) -> str:
    """The us-per-unit slope of each round's times over `series`, as
    'median (quartiles a to b)'."""
    rounds = len(series[0][0].times)
    per_round = sorted(
        slope([n for _, n in series], [1e6 * case.times[r] for case, _ in series])
        for r in range(rounds)
    )
    if rounds < 4:
        return f"{statistics.median(per_round):.2f}"
    q1, mid, q3 = statistics.quantiles(per_round, n=4)
    return f"{mid:.2f} (quartiles {q1:.2f} to {q3:.2f})"


def series_rows(cases: dict[tuple[int, int], tuple[Case, int]], unit: str) -> list[str]:
    """A table row per case, then the cost of one `unit` per leaf shape."""
    rows = [
        f"| ({side}, {side}) | {k} | {n} | {median_us(case):.1f} |"
        for (side, k), (case, n) in cases.items()
    ]
    rows.append("")
    for side in sorted({side for side, _ in cases}):
        series = [cases[key] for key in cases if key[0] == side]
        rows.append(
            f"- leaves of ({side}, {side}): {unit} adds {round_slopes(series)} us "
            "to every call."
        )
    return rows


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
    run_interleaved(idle, rounds)
    run_interleaved(passing, rounds)

    lines = [
        "# What a call costs on XLA:CPU",
        "",
        "Generated by `python benchmarks/investigations/cpu_runtime.py`; "
        "do not edit by hand.",
        f"Machine: {machine()}.",
        "",
        f"Medians of {rounds} interleaved rounds, microseconds a call; minimal "
        "jitted functions, no optax_ext code (see the script's docstring). A "
        "cost per kernel or per buffer is the slope of each round's times, "
        "median and quartiles over the rounds.",
        "",
        "## Reductions in a conditional's branch that does not run",
        "",
        f"`lax.cond(False, heavy, identity, xs)`, {LEAVES} donated leaves; "
        "`heavy` scales each leaf by k reductions of it. Every row hands the "
        "same buffers in and out, compiles no copy, and takes the branch that "
        "does nothing.",
        "",
        "| leaf shape | k | reductions in the branches | us a call |",
        "|---|---|---|---|",
    ]
    lines += series_rows(idle, "each reduction compiled into the branch not taken")
    lines += [
        "",
        "## Buffers passed through a donated call",
        "",
        f"A running sum over {LEAVES} leaves (reading and writing "
        f"{2 * LEAVES} donated buffers) that also takes m more donated buffers "
        "a leaf and returns them untouched.",
        "",
        "| leaf shape | m | extra buffers passed through | us a call |",
        "|---|---|---|---|",
    ]
    lines += series_rows(passing, "each extra buffer passed through")
    lines.append("")
    text = "\n".join(lines)
    if args.quick:
        print(text)
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_runtime.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
