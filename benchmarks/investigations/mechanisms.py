"""What each mechanism of the update path buys, on each backend: each
switched off in turn.

    .venv-deviceless/bin/python benchmarks/investigations/mechanisms.py [--quick]

(the deviceless environment of `tests/data/deviceless-requirements.txt`,
which compiles for an H200 and a TPU v5e on this CPU) writes
`benchmarks/results/mechanisms.md` and `.json`; `--quick` is a smoke run
that writes nothing. For each inner optimizer, params layout and form
(drop-in `update` + `optax.apply_updates`, fused `apply_gradients`),
params and state donated, every variant is compiled for XLA:CPU, XLA:GPU
and XLA:TPU and read as `tests/_compiled.py` reads the tests' programs:
whether the conditional is kept (no op of the inner optimizer outside a
branch), copies of a params-leaf-sized array (every step, and inside the
emitting branch), temporary memory over the params' bytes. On XLA:CPU
the mini-step and the emitting step are also timed, candidates
interleaved (`_timing.time_interleaved`). A variant replaces one mechanism by
its plain form in the optimizer's configuration (`xla.configured`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]

import _compiled  # noqa: E402  (JAX_PLATFORMS=cpu, libtpu's lock: set there)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _timing import machine, time_interleaved  # noqa: E402

import optax_ext  # noqa: E402
from optax_ext._accumulate import xla  # noqa: E402

K = 4
INNER = {
    "adamw": (lambda: optax.adamw(1e-3), ("sqrt",)),
    "lion": (lambda: optax.lion(1e-4), ("sign",)),
    "clip+adamw": (
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
        ("sqrt",),
    ),
}
LAYOUTS = {
    "4 x (1024, 1024)": lambda: {f"w{i}": jnp.zeros((1024, 1024)) for i in range(4)},
    "96 x (128, 128)": lambda: {f"w{i:02d}": jnp.zeros((128, 128)) for i in range(96)},
}


# variant: (what it switches off, its `xla.Mechanisms` changes)
VARIANTS = {
    "all": ("every mechanism on", {}),
    "no barrier": (
        "the optimization barrier on the running branch's scalars",
        {"scalar_barrier": False},
    ),
    "no distinct zeros": (
        "zeros of their own for each large leaf (drop-in)",
        {"distinct_zeros": False},
    ),
    "no CPU state order": (
        "on XLA:CPU, a state leaf whose old value the updates read after them",
        {"state_after_updates": False},
    ),
    "no clearing": (
        "on GPUs and TPUs, the drop-in's accumulator zeroed where its window "
        "ends, as optax.MultiSteps does",
        {"clear_when_selected_on": frozenset()},
    ),
    "drop-in in a conditional": (
        "on GPUs and TPUs, the inner optimizer on every mini-step of the "
        "drop-in, its results selected: a conditional instead, as XLA:CPU's",
        {"drop_in_conditional_on": frozenset({"cpu", "cuda", "rocm", "tpu"})},
    ),
}


def configured(opt: optax_ext.MultiSteps, variant: str) -> optax_ext.MultiSteps:
    """`opt` with `variant`'s mechanisms switched off."""
    return xla.configured(opt, **VARIANTS[variant][1])


def _step(opt, form):
    def step(params, state, grads):
        if form == "fused":
            return optax_ext.apply_gradients(opt, grads, state, params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def measure(inner: str, layout: str, backends: list[str], rounds: int) -> dict:
    params = LAYOUTS[layout]()
    big = {
        f"[{','.join(map(str, p.shape))}]" for p in params.values() if p.size >= 1 << 16
    }
    nbytes = sum(p.nbytes for p in params.values())
    out: dict = {}
    runners = []
    for variant in VARIANTS:
        for form in ("drop-in", "fused"):
            for backend in backends:
                opt = configured(optax_ext.MultiSteps(INNER[inner][0](), K), variant)
                compiled = _compiled.compile_step(
                    backend, _step(opt, form), params, opt.init(params), params
                )
                r = _compiled.report(compiled, big, INNER[inner][1])
                out[f"{variant}|{form}|{backend}"] = {
                    "kept": r["conditionals"] >= 1 and r["markers_outside"] == 0,
                    "copies": len(r["copies"]),
                    "branch_copies": len(r["branch_copies"]),
                    "temp": r["temp"] / nbytes,
                }
            if rounds:
                for emit in (False, True):
                    k = 1 if emit else 10**9
                    opt = configured(
                        optax_ext.MultiSteps(INNER[inner][0](), k), variant
                    )
                    fn = jax.jit(_step(opt, form), donate_argnums=(0, 1))
                    fn = fn.lower(params, opt.init(params), params).compile()
                    runners.append(_runner(fn, opt, params, f"{variant}|{form}|{emit}"))
    if rounds:
        time_interleaved(runners, rounds)
        for runner in runners:
            out[f"time|{runner.name}"] = statistics.median(runner.times)
    return out


def _runner(fn, opt, params, name):
    state = {"p": jax.tree.map(jnp.copy, params), "s": opt.init(params)}
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)

    def call() -> float:
        start = time.perf_counter()
        state["p"], state["s"] = fn(state["p"], state["s"], grads)
        jax.block_until_ready(state["p"])
        return time.perf_counter() - start

    return SimpleNamespace(name=name, call=call, times=[])


def write(results: dict, path: Path) -> str:
    lines = [
        "# What each mechanism of the update path buys, per backend",
        "",
        "Written by `benchmarks/investigations/mechanisms.py` (its docstring "
        "says how). "
        f"Measured on: {machine()}. GPU: an H200 target, TPU: a v5e, both "
        "compiled deviceless. A cell: conditional kept (no op of the inner "
        "optimizer outside a branch) / copies of a params-leaf-sized array on "
        "every step + in the emitting branch / temporary memory over the "
        "params; CPU time: mini-step and emitting step in ms, relative to "
        "`all`.",
        "",
        "| variant | what it switches off |",
        "|---|---|",
        *[f"| {v} | {what} |" for v, (what, _) in VARIANTS.items()],
        "",
    ]
    for case, res in results.items():
        lines += [f"## {case}", "", "| variant | form | CPU | GPU | TPU | CPU time |"]
        lines.append("|---|---|---|---|---|---|")
        for variant in VARIANTS:
            for form in ("drop-in", "fused"):
                cells = []
                for backend in ("cpu", "gpu", "tpu"):
                    m = res.get(f"{variant}|{form}|{backend}")
                    cells.append(
                        "-"
                        if m is None
                        else f"{'kept' if m['kept'] else 'GONE'} / "
                        f"{m['copies']}+{m['branch_copies']} / {m['temp']:.2f}x"
                    )
                t = []
                for emit in (False, True):
                    mine = res.get(f"time|{variant}|{form}|{emit}")
                    base = res.get(f"time|all|{form}|{emit}")
                    if mine is not None:
                        t.append(f"{mine * 1e3:.2f} ({mine / base:.2f})")
                time_cell = " / ".join(t) if t else "-"
                lines.append(
                    f"| {variant} | {form} | {' | '.join(cells)} | {time_cell} |"
                )
        lines.append("")
    text = "\n".join(lines)
    path.write_text(text)
    path.with_suffix(".json").write_text(json.dumps(results, indent=1))
    return text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--inner", action="append", choices=list(INNER))
    parser.add_argument("--layout", action="append", choices=list(LAYOUTS))
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    backends = [b for b in ("cpu", "gpu", "tpu") if _compiled.unavailable(b) is None]
    results = {}
    inners = ["adamw"] if args.quick else args.inner or list(INNER)
    layouts = list(LAYOUTS)[:1] if args.quick else args.layout or list(LAYOUTS)
    for inner in inners:
        for layout in layouts:
            key = f"{inner}, {layout}"
            results[key] = measure(
                inner, layout, backends, 2 if args.quick else args.rounds
            )
            print(key, "done", flush=True)
    if args.quick:
        print(json.dumps(results, indent=1)[:3000])
        return
    print(write(results, ROOT / "benchmarks" / "results" / "mechanisms.md"))


if __name__ == "__main__":
    main()
