"""Compile time of the train step users write, against optax.MultiSteps.

Run with `python benchmarks/compile_time.py` (add `--quick` for a smoke run).
For each number of leaves and each inner optimizer, a fresh process compiles

    def step(params, opt_state, grads):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    jax.jit(step, donate_argnums=(0, 1)).lower(params, opt_state, params).compile()

for each candidate, one compile of each per round, the candidates in a
shuffled order each round (a shared machine slows all alike), and reports
the median over rounds of trace + lower + compile seconds, the compiled HLO
lines (exact) and the ratio to optax.MultiSteps of the same inner optimizer.
Each leaf is a (64, 64) float32 matrix.

Candidates: the bare inner optimizer; optax.MultiSteps and
optax_ext.MultiSteps of it; and for `adamw` the compositions, each beside its
optax counterpart wrapped in optax.MultiSteps: `inject_hyperparams` (a
learning-rate schedule), `zero_nans` in a chain, `skip_when` (against
`optax.apply_if_finite`, optax's conditional skip; its flag is an argument
of the step, as in a training loop).
"""

from __future__ import annotations

import argparse
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

import optax_ext

sys.path.insert(0, str(Path(__file__).parent))
from _timing import machine  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SIZES = (24, 96, 288, 1000)
K = 4

INNER: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "clip+adamw": lambda: optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(1e-3)
    ),
}


def _schedule():
    return optax.linear_schedule(0.0, 1e-3, 100)


# (label, optax candidate, optax_ext candidate, extra update kwargs of ext)
def candidates(inner: str) -> dict[str, tuple[Callable, dict]]:
    make = INNER[inner]
    out: dict[str, tuple[Callable, dict]] = {
        "bare": (make, {}),
        "optax.MultiSteps": (lambda: optax.MultiSteps(make(), K), {}),
        "optax_ext.MultiSteps": (lambda: optax_ext.MultiSteps(make(), K), {}),
    }
    if inner == "adamw":
        out |= {
            "optax inject": (
                lambda: optax.MultiSteps(
                    optax.inject_hyperparams(optax.adamw)(learning_rate=_schedule()),
                    K,
                ),
                {},
            ),
            "optax_ext inject": (
                lambda: optax_ext.MultiSteps(
                    optax_ext.inject_hyperparams(optax.adamw)(
                        learning_rate=_schedule()
                    ),
                    K,
                ),
                {},
            ),
            "optax zero_nans": (
                lambda: optax.MultiSteps(
                    optax.chain(optax.zero_nans(), optax.adamw(1e-3)), K
                ),
                {},
            ),
            "optax_ext zero_nans": (
                lambda: optax_ext.MultiSteps(
                    optax.chain(optax_ext.zero_nans(), optax.adamw(1e-3)), K
                ),
                {},
            ),
            "optax apply_if_finite": (
                lambda: optax.MultiSteps(
                    optax.apply_if_finite(optax.adamw(1e-3), 3), K
                ),
                {},
            ),
            "optax_ext skip_when": (
                lambda: optax_ext.MultiSteps(optax_ext.skip_when(optax.adamw(1e-3)), K),
                {"skip": False},
            ),
        }
    return out


# Which candidate each one is compared with.
BASELINE = {
    "optax_ext.MultiSteps": "optax.MultiSteps",
    "optax_ext inject": "optax inject",
    "optax_ext zero_nans": "optax zero_nans",
    "optax_ext skip_when": "optax apply_if_finite",
}


def compile_once(
    make: Callable, extra: dict, n_leaves: int
) -> tuple[float, float, int]:
    opt = make()
    params = {f"w{i:04d}": jnp.zeros((64, 64), jnp.float32) for i in range(n_leaves)}
    state = opt.init(params)
    # Extra arguments (skip_when's flag) are arguments of the step, traced
    # as in a training loop.
    kwargs = {k: jnp.asarray(v) for k, v in extra.items()}

    def step(params, opt_state, grads, kwargs):
        updates, opt_state = opt.update(grads, opt_state, params, **kwargs)
        return optax.apply_updates(params, updates), opt_state

    start, cpu_start = time.perf_counter(), time.process_time()
    jitted = jax.jit(step, donate_argnums=(0, 1))
    compiled = jitted.lower(params, state, params, kwargs).compile()
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return seconds, cpu, len(compiled.as_text().splitlines())


def bench(inner: str, n_leaves: int, rounds: int) -> dict[str, dict[str, float]]:
    cands = candidates(inner)
    names = list(cands)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    lines: dict[str, int] = {}
    rng = random.Random(0)
    for _ in range(rounds):
        rng.shuffle(names)
        for name in names:
            s, c, n = compile_once(*cands[name], n_leaves)
            seconds[name].append(s)
            cpu[name].append(c)
            lines[name] = n
    return {
        n: {
            "seconds": statistics.median(seconds[n]),
            "cpu_seconds": statistics.median(cpu[n]),
            "lines": lines[n],
        }
        for n in cands
    }


def bench_in_subprocess(inner: str, n_leaves: int, rounds: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--case", inner, str(n_leaves), str(rounds)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def ROUNDS(n: int) -> int:  # noqa: N802
    # Small sizes compile in a fraction of a second, where a shared machine
    # scatters single compiles most: more rounds there.
    return 15 if n <= 96 else 7 if n <= 288 else 3


def summary(results: dict, sizes) -> list[str]:
    """Per size: the range of optax_ext / optax compile-time ratios and how
    many are at most 1; per candidate: HLO lines added per leaf."""
    out = [
        "## Summary",
        "",
        "| leaves | optax_ext / optax compile time, range | cases at most 1.0 |",
        "|---|---|---|",
    ]
    for n in sizes:
        ratios = [
            r[name]["seconds"] / r[base]["seconds"]
            for key, r in results.items()
            if key.endswith(f"/{n}")
            for name, base in BASELINE.items()
            if name in r
        ]
        if ratios:
            out.append(
                f"| {n} | {min(ratios):.2f} to {max(ratios):.2f} | "
                f"{sum(x <= 1.0 for x in ratios)} of {len(ratios)} |"
            )
    out += [
        "",
        "Compiled HLO lines added per leaf, between consecutive sizes "
        "(constant: linear growth):",
        "",
        "| inner | candidate | "
        + " | ".join(f"{a} to {b}" for a, b in zip(sizes, sizes[1:], strict=False))
        + " |",
        "|" + "---|" * (1 + len(sizes)),
    ]
    for inner in INNER:
        for name in candidates(inner):
            cells = []
            for a, b in zip(sizes, sizes[1:], strict=False):
                ra, rb = results.get(f"{inner}/{a}"), results.get(f"{inner}/{b}")
                if ra is None or rb is None:
                    cells.append("")
                else:
                    per = (rb[name]["lines"] - ra[name]["lines"]) / (b - a)
                    cells.append(f"{per:.1f}")
            if any(cells):
                out.append(f"| {inner} | {name} | " + " | ".join(cells) + " |")
    return out + [""]


def write_table(
    results: dict, sizes, path: Path, measured_on: str | None = None
) -> str:
    lines = [
        "# Compile time of the train step",
        "",
        "Generated by `python benchmarks/compile_time.py`; do not edit by hand.",
        f"Machine: {measured_on or machine()}.",
        "",
        "`jax.jit(step, donate_argnums=(0, 1)).lower(...).compile()` of the train "
        "step (update + `optax.apply_updates`), every_k_schedule=4, leaves of "
        "(64, 64) float32; median seconds (trace + lower + compile) over "
        "interleaved rounds, each size in a fresh process; HLO lines of the "
        "compiled module. Ratio: optax_ext over its optax counterpart "
        "(below 1: optax_ext compiles faster).",
        "",
        *summary(results, sizes),
        "## All cases",
        "",
        "| inner | candidate | optax counterpart | "
        + " | ".join(f"{n} leaves s (ratio)" for n in sizes)
        + " | "
        + " | ".join(f"{n} leaves HLO lines" for n in sizes)
        + " |",
        "|" + "---|" * (3 + 2 * len(sizes)),
    ]
    for inner in INNER:
        for name in candidates(inner):
            row = [inner, name, BASELINE.get(name, "")]
            for n in sizes:
                r = results.get(f"{inner}/{n}")
                if r is None:
                    row.append("")
                    continue
                s = r[name]["seconds"]
                base = BASELINE.get(name)
                ratio = f" ({s / r[base]['seconds']:.2f})" if base else ""
                row.append(f"{s:.2f}{ratio}")
            for n in sizes:
                r = results.get(f"{inner}/{n}")
                row.append("" if r is None else f"{r[name]['lines']:,}")
            lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "Rounds per size: " + ", ".join(f"{n}: {ROUNDS(n)}" for n in sizes) + ".",
    ]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="24 and 96 leaves, adamw")
    parser.add_argument("--sizes", type=int, nargs="*", default=None)
    parser.add_argument("--inner", nargs="*", default=None, choices=list(INNER))
    parser.add_argument(
        "--from-json", type=Path, help="rewrite the tables of a saved run"
    )
    args = parser.parse_args()
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        cases = saved.get("cases", saved)
        found = sorted({int(k.split("/")[1]) for k in cases})
        print(
            write_table(cases, found, RESULTS / "compile_time.md", saved.get("machine"))
        )
        return
    if args.case:
        inner, n, rounds = args.case[0], int(args.case[1]), int(args.case[2])
        print(json.dumps(bench(inner, n, rounds)))
        return
    sizes = args.sizes or ((24, 96) if args.quick else SIZES)
    inners = args.inner or (["adamw"] if args.quick else list(INNER))

    def rounds_of(n: int) -> int:
        return 1 if args.quick else ROUNDS(n)

    results = {}
    for n in sizes:
        for inner in inners:
            results[f"{inner}/{n}"] = bench_in_subprocess(inner, n, rounds_of(n))
            print(inner, n, json.dumps(results[f"{inner}/{n}"]), flush=True)
    if args.quick:  # a smoke run: nothing is written to results/
        return
    RESULTS.mkdir(exist_ok=True)
    saved = {"machine": machine(), "cases": results}
    (RESULTS / "compile_time.json").write_text(json.dumps(saved, indent=1))
    print(write_table(results, sizes, RESULTS / "compile_time.md", saved["machine"]))


if __name__ == "__main__":
    main()
