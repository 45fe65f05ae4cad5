"""MultiSteps in the train step users write, against optax and the floors.

Run with `python benchmarks/train_step.py` (`--quick` for a smoke run that
writes nothing). Each case (inner optimizer, params layout, dtype) runs in a
fresh process; within it every candidate is compiled first, then timed
round-robin in a shuffled order each round (one timing of each candidate
per round: consecutive calls lasting at least `_timing.MIN_SECONDS`), and the
median over rounds is reported, so that a noisy shared machine slows all
candidates alike and the ratios stay meaningful.

Every candidate is a train step jitted with params and optimizer state
donated, the gradients passed in (not donated: they are reused), built by
`_steps.py` (shared with `gpu_check.py`) but for the Equinox and
`update` forms:

- `accumulate`: fold the gradients into a running mean in place, return the
  params untouched: the least a mini-step can cost (the floor of the fused
  step);
- `accumulate+state`: `accumulate` that also takes the inner optimizer's
  state and returns it untouched (donated): the least a mini-step of any
  optimizer holding that state can cost. With many small leaves JAX's
  per-buffer cost of each call dominates: merely passing Adam's two moments
  through doubles the time of 300 (64, 64) leaves;
- `floor`: `accumulate+state` plus `optax.apply_updates(params, zeros)`
  (XLA folds `p + 0` away, so it costs what `accumulate+state` does);
- `updates floor`: `accumulate+state`, then a zero updates tree that XLA
  cannot fold (each leaf written by a `lax.cond` on a traced `False`, as
  any API handing back updates must write them), then
  `optax.apply_updates`: the least the drop-in `update` API can cost;
- `bare`: the inner optimizer's own step, `update` + `apply_updates`;
- `optax` / `ext`: `opt.update` + `optax.apply_updates` with
  optax.MultiSteps / optax_ext.MultiSteps;
- `ext fused`: `optax_ext.apply_gradients`;
- `optax eqx` / `ext eqx`: the same on an Equinox module holding the params
  and an activation function, with `eqx.apply_updates`;
- `optax update` / `ext update`: `jax.jit(opt.update, donate_argnums=1)`,
  the state donated and the params not (the form some code bases use);
- `plain` / `plain fused`: `_steps.plain_multi_steps`, the simplest
  accumulation one would write with a `lax.cond` (the fold outside it, the inner
  optimizer inside, the accumulator cleared by selection; zero updates in
  the idle branch, or the params carried through it): what optax_ext's
  ordering machinery must beat to pay for itself.

each as a mini-step (`every_k_schedule` never reached) and as an emitting
step (`every_k_schedule=1`). Compiled temporary memory is
`memory_analysis().temp_size_in_bytes`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import optax_ext

sys.path.insert(0, str(Path(__file__).parent))
from _steps import (  # noqa: E402
    NEVER,
    floors,
    multi_steps,
    params_and_grads,
    train_step,
)
from _timing import machine, time_interleaved  # noqa: E402

RESULTS = Path(__file__).parent / "results"

INNER: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "sgd nesterov": lambda: optax.sgd(1e-3, momentum=0.9, nesterov=True),
}
LAYOUTS = {
    "8 x (1000, 500)": (8, (1000, 500)),
    "96 x (64, 64)": (96, (64, 64)),
    "300 x (64, 64)": (300, (64, 64)),
}


class Model(eqx.Module):
    """Params as an Equinox model: the arrays and a non-array leaf."""

    weights: list
    activation: Callable = eqx.field(static=False, default=jax.nn.relu)


def steps(inner: str, emit: bool) -> dict[str, tuple[Callable, Callable]]:
    """name -> (init(params), step(params, state, grads) -> (params, state))."""
    make = INNER[inner]
    k = 1 if emit else NEVER

    def update_only(opt):
        def step(params, state, grads):
            updates, state = opt.update(grads, state, params)
            return updates, state  # params are not donated in this form

        return opt.init, step

    def eqx_step(opt):
        def init(params):
            return opt.init(eqx.filter(Model(list(params.values())), eqx.is_array))

        def step(params, state, grads):
            model = Model(list(params.values()))
            g = Model(list(grads.values()), activation=None)
            updates, state = opt.update(g, state, eqx.filter(model, eqx.is_array))
            model = eqx.apply_updates(model, updates)
            return dict(zip(params, model.weights, strict=True)), state

        return init, step

    out = multi_steps(make, k)
    out["optax eqx"] = eqx_step(optax.MultiSteps(make(), k))
    out["ext eqx"] = eqx_step(optax_ext.MultiSteps(make(), k))
    out["optax update"] = update_only(optax.MultiSteps(make(), k))
    out["ext update"] = update_only(optax_ext.MultiSteps(make(), k))
    if emit:
        out["bare"] = train_step(make())
    else:
        out.update(floors(make))
    return out


class Runner:
    """One compiled step and the params and state it carries between calls."""

    def __init__(self, init, step, params, grads, donate):
        self.params = jax.tree.map(jnp.copy, params)
        self.grads = grads
        self.donate_params = 0 in donate
        self.state = init(self.params)
        jitted = jax.jit(step, donate_argnums=donate)
        self.compiled = jitted.lower(self.params, self.state, grads).compile()
        self.temp_bytes = self.compiled.memory_analysis().temp_size_in_bytes
        self.times: list[float] = []
        self.call()

    def call(self) -> float:
        start = time.perf_counter()
        out, self.state = self.compiled(self.params, self.state, self.grads)
        jax.block_until_ready((out, self.state))
        if self.donate_params:
            self.params = out
        return time.perf_counter() - start


def bench(inner: str, layout: str, dtype: str, rounds: int) -> dict:
    n, shape = LAYOUTS[layout]
    params, grads = params_and_grads({f"w{i:03d}": shape for i in range(n)}, dtype)
    runners = {}
    for emit in (False, True):
        for name, (init, step) in steps(inner, emit).items():
            donate = (1,) if name.endswith("update") else (0, 1)
            label = f"{name} {'emit' if emit else 'mini'}"
            runners[label] = Runner(init, step, params, grads, donate)
    time_interleaved(list(runners.values()), rounds)
    return {
        name: {
            "ms": 1e3 * statistics.median(r.times),
            "temp_mb": r.temp_bytes / 2**20,
        }
        for name, r in runners.items()
    }


def cases(quick: bool) -> list[tuple[str, str, str]]:
    if quick:
        return [("adam", "96 x (64, 64)", "float32")]
    out = [(i, lay, "float32") for lay in LAYOUTS for i in INNER]
    out += [(i, "8 x (1000, 500)", "bfloat16") for i in INNER]
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}"


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:.2f}" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f} to {hi:.2f}"


def summary(results: dict) -> list[str]:
    """The ranges over all cases, and how many cases meet each target."""
    ms = [{k: v["ms"] for k, v in r.items()} for r in results.values()]
    n = len(ms)

    def emit_floor(m):
        return m["bare emit"] + m["accumulate mini"]

    rows = [
        (
            "optax mini-step / optax_ext mini-step (drop-in)",
            [m["optax mini"] / m["ext mini"] for m in ms],
            lambda r: r >= 1.0,
            "optax_ext at least as fast",
        ),
        (
            "optax emitting step / optax_ext emitting step (drop-in)",
            [m["optax emit"] / m["ext emit"] for m in ms],
            lambda r: r >= 1.0,
            "optax_ext at least as fast",
        ),
        (
            "fused mini-step / bare accumulate",
            [m["ext fused mini"] / m["accumulate mini"] for m in ms],
            lambda r: r <= 1.1,
            "at most 1.1",
        ),
        (
            "fused mini-step / accumulate passing the inner state through",
            [m["ext fused mini"] / m["accumulate+state mini"] for m in ms],
            lambda r: r <= 1.1,
            "at most 1.1",
        ),
        (
            "accumulate passing the inner state through / bare accumulate",
            [m["accumulate+state mini"] / m["accumulate mini"] for m in ms],
            lambda r: True,
            "",
        ),
        (
            "drop-in mini-step / floor",
            [m["ext mini"] / m["floor mini"] for m in ms],
            lambda r: r <= 2.0,
            "at most 2.0",
        ),
        (
            "drop-in mini-step / updates floor (the zero updates written)",
            [m["ext mini"] / m["updates floor mini"] for m in ms],
            lambda r: True,
            "",
        ),
        (
            "updates floor / floor (the least a drop-in `update` can cost)",
            [m["updates floor mini"] / m["floor mini"] for m in ms],
            lambda r: True,
            "",
        ),
        (
            "fused emitting step / (bare train step + accumulate)",
            [m["ext fused emit"] / emit_floor(m) for m in ms],
            lambda r: r <= 1.15,
            "at most 1.15",
        ),
        (
            "drop-in emitting step / (bare train step + accumulate)",
            [m["ext emit"] / emit_floor(m) for m in ms],
            lambda r: r <= 1.2,
            "at most 1.2",
        ),
        (
            "`jit(update, donate_argnums=1)` mini-step / floor, optax_ext",
            [m["ext update mini"] / m["floor mini"] for m in ms],
            lambda r: True,
            "",
        ),
        (
            "`jit(update, donate_argnums=1)` mini-step / floor, optax",
            [m["optax update mini"] / m["floor mini"] for m in ms],
            lambda r: True,
            "",
        ),
    ]
    if all("plain mini" in m for m in ms):
        for form, ext, plain in (
            ("drop-in", "ext", "plain"),
            ("fused", "ext fused", "plain fused"),
        ):
            for step in ("mini", "emit"):
                rows.append(
                    (
                        f"plain `lax.cond` {form} {step}-step / optax_ext {form}",
                        [m[f"{plain} {step}"] / m[f"{ext} {step}"] for m in ms],
                        lambda r: r >= 1.0,
                        "optax_ext at least as fast",
                    )
                )
    out = [
        "## Summary",
        "",
        f"Over all {n} cases (inner optimizer, params layout, dtype):",
        "",
        "| ratio | range | cases meeting the target | target |",
        "|---|---|---|---|",
    ]
    for label, values, ok, target in rows:
        met = f"{sum(map(ok, values))} of {n}" if target else ""
        out.append(f"| {label} | {_span(values)} | {met} | {target} |")
    return out + [""]


def write_tables(results: dict, path: Path, measured_on: str | None = None) -> str:
    """One small table per question, from the medians."""
    rows = [(key.split(" | "), r) for key, r in results.items()]
    head = [
        "# MultiSteps in the train step",
        "",
        "Generated by `python benchmarks/train_step.py`; do not edit by hand.",
        f"Machine: {measured_on or machine()}.",
        "",
        "Train step jitted with params and state donated (see the script's "
        "docstring for each candidate); medians of interleaved rounds, each "
        "case in a fresh process. ms per step.",
        "",
    ]
    t1 = [
        "## Drop-in `update` + `optax.apply_updates`: optax_ext against optax",
        "",
        "| inner | params | dtype | optax mini | ext mini | optax / ext mini "
        "| optax emit | ext emit | optax / ext emit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    t2 = [
        "## Against the floors",
        "",
        "mini: a non-emitting step over its floor (fused: over a bare donated "
        "accumulate, and over one that also passes the inner state through, "
        "which costs accumulate+state / accumulate more than a bare one; "
        "drop-in: over that + `apply_updates(params, zeros)`, which XLA "
        "folds away, and over the updates floor, which writes the zeros and "
        "adds them; updates floor / floor is what writing and adding the "
        "zeros costs, which no drop-in `update` avoids). "
        "emit: an emitting step over (bare inner train step + accumulate).",
        "",
        "| inner | params | dtype | fused mini / accumulate "
        "| fused mini / accumulate+state | accumulate+state / accumulate "
        "| drop-in mini / floor "
        "| drop-in mini / updates floor | updates floor / floor "
        "| fused emit / (bare + acc.) | drop-in emit / (bare + acc.) "
        "| ext eqx mini / floor | optax mini / floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    t3 = [
        "## Other forms",
        "",
        "`jax.jit(opt.update, donate_argnums=1)` (state donated, params not), "
        "mini-step over the drop-in floor; temporary memory of the compiled "
        "mini-step in MiB (`memory_analysis()`: one allocation for both "
        "branches of the conditional, so it includes what the emitting "
        "branch needs).",
        "",
        "| inner | params | dtype | ext update mini / floor "
        "| optax update mini / floor | temp: ext fused | temp: ext drop-in "
        "| temp: optax |",
        "|---|---|---|---|---|---|---|---|",
    ]
    t4 = [
        "## Against a plain `lax.cond` MultiSteps",
        "",
        "`plain_multi_steps` (`benchmarks/_steps.py`): time ratios plain / optax_ext "
        "(above 1: optax_ext faster) and compiled temporary memory in MiB.",
        "",
        "| inner | params | dtype | drop-in mini | drop-in emit | fused mini "
        "| fused emit | temp: plain drop-in | temp: ext drop-in "
        "| temp: plain fused | temp: ext fused |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (inner, layout, dtype), r in rows:
        ms = {k: v["ms"] for k, v in r.items()}
        if "plain mini" in ms:
            tm = {k: v["temp_mb"] for k, v in r.items()}
            t4.append(
                f"| {inner} | {layout} | {dtype} | "
                f"{_ratio(ms['plain mini'], ms['ext mini'])} | "
                f"{_ratio(ms['plain emit'], ms['ext emit'])} | "
                f"{_ratio(ms['plain fused mini'], ms['ext fused mini'])} | "
                f"{_ratio(ms['plain fused emit'], ms['ext fused emit'])} | "
                f"{tm['plain mini']:.2f} | {tm['ext mini']:.2f} | "
                f"{tm['plain fused mini']:.2f} | {tm['ext fused mini']:.2f} |"
            )
        temp = {k: v["temp_mb"] for k, v in r.items()}
        key = f"| {inner} | {layout} | {dtype} |"
        t1.append(
            f"{key} {ms['optax mini']:.3f} | {ms['ext mini']:.3f} | "
            f"{_ratio(ms['optax mini'], ms['ext mini'])} | {ms['optax emit']:.3f} | "
            f"{ms['ext emit']:.3f} | {_ratio(ms['optax emit'], ms['ext emit'])} |"
        )
        emit_floor = ms["bare emit"] + ms["accumulate mini"]
        t2.append(
            f"{key} {_ratio(ms['ext fused mini'], ms['accumulate mini'])} | "
            f"{_ratio(ms['ext fused mini'], ms['accumulate+state mini'])} | "
            f"{_ratio(ms['accumulate+state mini'], ms['accumulate mini'])} | "
            f"{_ratio(ms['ext mini'], ms['floor mini'])} | "
            f"{_ratio(ms['ext mini'], ms['updates floor mini'])} | "
            f"{_ratio(ms['updates floor mini'], ms['floor mini'])} | "
            f"{_ratio(ms['ext fused emit'], emit_floor)} | "
            f"{_ratio(ms['ext emit'], emit_floor)} | "
            f"{_ratio(ms['ext eqx mini'], ms['floor mini'])} | "
            f"{_ratio(ms['optax mini'], ms['floor mini'])} |"
        )
        t3.append(
            f"{key} {_ratio(ms['ext update mini'], ms['floor mini'])} | "
            f"{_ratio(ms['optax update mini'], ms['floor mini'])} | "
            f"{temp['ext fused mini']:.2f} | {temp['ext mini']:.2f} | "
            f"{temp['optax mini']:.2f} |"
        )
    tables = t1 + [""] + t2 + [""] + t3
    if len(t4) > 7:
        tables += [""] + t4
    text = "\n".join(head + summary(results) + tables) + "\n"
    path.write_text(text)
    return text


def plot(results: dict, path: Path, measured_on: str | None = None) -> None:
    """Mini-step time per case, log scale: optax, optax_ext drop-in and
    fused, and the three floors (needs matplotlib: the `bench` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = {
        "optax mini": "optax.MultiSteps",
        "ext mini": "optax_ext drop-in",
        "ext fused mini": "optax_ext apply_gradients",
        "updates floor mini": "floor of the drop-in API (zero updates written)",
        "accumulate+state mini": "accumulate, inner state passed through",
        "accumulate mini": "bare accumulate",
    }
    cases = list(results)
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(12, 4.6))
    for j, (key, label) in enumerate(names.items()):
        ax.bar(
            [i + (j - len(names) / 2 + 0.5) * width for i in range(len(cases))],
            [results[c][key]["ms"] for c in cases],
            width,
            label=label,
        )
    ax.set_xticks(range(len(cases)))
    labels = [
        c.replace(" | ", "\n").replace(" x ", "x").replace(", ", ",") for c in cases
    ]
    ax.set_xticklabels(labels, fontsize=6.5)
    ax.set_yscale("log")
    ax.set_ylabel("ms per mini-step")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncols=3, loc="upper center", bbox_to_anchor=(0.5, 1.2))
    fig.suptitle(
        "Non-emitting train step, params and state donated "
        f"({measured_on or machine()})",
        fontsize=8,
        y=0.02,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument(
        "--from-json", type=Path, help="rewrite the tables of a saved run"
    )
    parser.add_argument(
        "--name",
        default="train_step",
        help="the results' file names in benchmarks/results (NAME.md, .json, "
        ".png): another JAX's run beside the default one",
    )
    args = parser.parse_args()
    name = args.name
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        text = write_tables(saved["cases"], RESULTS / f"{name}.md", saved["machine"])
        plot(saved["cases"], RESULTS / f"{name}.png", saved["machine"])
        print(text)
        return
    if args.case:
        inner, layout, dtype, rounds = args.case
        print(json.dumps(bench(inner, layout, dtype, int(rounds))))
        return
    results = {}
    for inner, layout, dtype in cases(args.quick):
        rounds = 3 if args.quick else args.rounds
        out = subprocess.run(
            [sys.executable, __file__, "--case", inner, layout, dtype, str(rounds)],
            check=True,
            capture_output=True,
            text=True,
        )
        results[f"{inner} | {layout} | {dtype}"] = json.loads(
            out.stdout.splitlines()[-1]
        )
        print(inner, layout, dtype, flush=True)
    if args.quick:
        print(write_tables(results, Path("/dev/null")))
        return
    RESULTS.mkdir(exist_ok=True)
    saved = {"machine": machine(), "cases": results}
    (RESULTS / f"{name}.json").write_text(json.dumps(saved, indent=1))
    # The commit as measured: the files written here would make it "-dirty".
    print(write_tables(results, RESULTS / f"{name}.md", saved["machine"]))
    plot(results, RESULTS / f"{name}.png", saved["machine"])


if __name__ == "__main__":
    main()
