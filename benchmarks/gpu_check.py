"""GPU check: the test suite, and the train step's time and memory, in one command.

    python benchmarks/gpu_check.py          # on a GPU: suite, train step (<= 8 min)
    python benchmarks/gpu_check.py --quick  # smoke run on the CPU (< 1 min)

It writes `benchmarks/results/gpu/<device-kind-slug>.md` and `.json` (`--quick`:
a temporary directory, or `--out`). The suite runs on the GPU without the
multi-device files (they use CPU host devices), capped at `--suite-timeout`; the
train step's cases run in `CASES`' order, each program compiled once before any
is timed; the run ends at `--budget` with the report of what it measured.
`--quick` runs every step and table of one case on tiny shapes, no suite.

The whole train step comes first: a loss, `jax.grad` and each form's step
in one `jax.jit` (params and state donated, the batch an argument), on an MLP
of 4 x (2048, 2048) with a batch of 8, float32 and bfloat16: its time per
step over windows of 4 (host loop), its temporary memory and its compiled
peak (arguments + outputs not aliased + temporaries, `memory_analysis()`),
against optax.MultiSteps and the bare optimizer's step; and the device's
peak after it (`memory_stats()`).

What the report's train-step tables hold:

Each step is a train step jitted with params and optimizer state donated, the
gradients passed in, inner `optax.adamw` (`benchmarks/_steps.py`). The rows:

- `optax`: `optax.MultiSteps`, `update` then `optax.apply_updates`;
- `ext`: `optax_ext.MultiSteps` in the same calls (drop-in);
- `ext fused`: `optax_ext.apply_gradients`, the update applied inside;
- `host-chosen`: `apply_gradients(..., emit=)`, Python choosing whether a step
  closes its window (no conditional compiled);
- `plain`, `plain fused`: a 40-line MultiSteps with one `lax.cond`;
- floors, params untouched: `accumulate` (the gradients folded into a float32
  running mean), `accumulate+state` (that, passing the optimizer's state
  through), `updates floor` (that, plus zero updates that XLA cannot fold added
  by `optax.apply_updates`: the least the drop-in API can cost).

A mini-step folds the gradients in and applies nothing (its window never
closes); an emitting step closes its window and updates the params
(`every_k_schedule=1`); a window is 3 mini-steps and an emitting step
(`every_k_schedule=4`). Times are medians over rounds, each timing every step
once, in a shuffled order. The columns:

- scan ms: per step, K steps in one jitted `lax.scan` (the device's time);
- host ms: per step, K calls of the jitted step from Python (a training loop);
- optax / step: optax.MultiSteps' time over this step's, scan / host (above 1:
  this step is faster);
- floor: the least a mini-step of this form can cost;
- step / floor: this mini-step's time over its floor's, scan / host;
- goal: what this step should reach; met: whether it does, scan / host;
- temporary MiB: what XLA allocates for one compiled step beyond its arguments
  (`memory_analysis()`), the gradients passed in: a window's step (as much as
  a mini-step's or an emitting step's: one program holds both branches), or a
  floor's mini-step;
- / optax: that over optax.MultiSteps' (below 1: less memory).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import functools
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from statistics import median

# One GPU shared by the suite's workers and then this process: allocate as
# needed (set before JAX is imported).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import optax_ext  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _steps import NEVER, floors, fused, multi_steps, params_and_grads, scanned  # noqa: E402
from _timing import machine  # noqa: E402

RESULTS = HERE / "results" / "gpu"
WINDOW = 4
# mode -> (every_k_schedule, the host-chosen `emit` of its steps, what it is).
MODES = {
    "mini": (NEVER, [False], "mini-step"),
    "emit": (1, [True], "emitting step"),
    "window": (WINDOW, [False] * 3 + [True], f"step over a window of {WINDOW}"),
}
CANDIDATES = ("optax", "ext", "ext fused", "host-chosen", "plain", "plain fused")
FLOORS = ("accumulate", "accumulate+state", "updates floor")
# The floor each mini-step is held to: what its form cannot avoid.
FLOOR_OF = {"accumulate+state": "accumulate", "updates floor": "accumulate+state"}
FLOOR_OF |= dict.fromkeys(["optax", "ext", "plain"], "updates floor")
FLOOR_OF |= dict.fromkeys(["ext fused", "host-chosen", "plain fused"], "accumulate")
# (mode, step) -> (reference, bound, faster): the step's time at most `bound`
# times the reference's, or (faster) the step `bound` times faster or more.
GOALS = {("window", "ext"): ("optax", 1.15, True)}
for _step in ("ext", "ext fused", "host-chosen"):
    GOALS["mini", _step] = (FLOOR_OF[_step], 1.1, False)
    GOALS["emit", _step] = ("optax", 1.1, False)
    GOALS.setdefault(("window", _step), ("optax", 1.8, True))
# layout:dtype, in priority order (the time budget drops cases from the end).
CASES = ["gpt2-small:float32", "large:float32", "large:bfloat16", "gpt2-small:bfloat16"]
LEGEND = __doc__.split("train-step tables hold:\n\n")[1]
INNER = functools.partial(optax.adamw, 1e-4)
# The whole train step: its dtypes, in priority order.
WHOLE_CASES = ["float32", "bfloat16"]


def mlp(dtype: str, quick: bool):
    """Params, loss and batch of a params-dominated model (the tests'
    whole-step MLP): square tanh layers, a batch of 8."""
    width, depth = (128, 2) if quick else (2048, 4)
    keys = jax.random.split(jax.random.key(0), depth)
    params = {
        f"w{i}": (jax.random.normal(k, (width, width)) / width**0.5).astype(dtype)
        for i, k in enumerate(keys)
    }

    def loss(p, x):
        h = x
        for i in range(depth):
            h = jnp.tanh(h @ p[f"w{i}"])
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    return params, loss, jnp.ones((8, width), dtype)


def whole_steps(loss, dtype: str) -> dict:
    """form -> (init, a window's steps), each `step(params, state, batch)`
    computing the gradients itself."""
    tx, opt = INNER(), optax.MultiSteps(INNER(), WINDOW)
    ext = optax_ext.MultiSteps(INNER(), WINDOW)

    def drop_in(opt):
        def step(params, state, batch):
            updates, state = opt.update(jax.grad(loss)(params, batch), state, params)
            return optax.apply_updates(params, updates), state

        return step

    def applied(opt, emit=None):
        def step(params, state, batch):
            grads = jax.grad(loss)(params, batch)
            return optax_ext.apply_gradients(opt, grads, state, params, emit=emit)

        return step

    steps = {
        "bare": (tx.init, [drop_in(tx)] * WINDOW),
        "optax": (opt.init, [drop_in(opt)] * WINDOW),
        "drop-in": (ext.init, [drop_in(ext)] * WINDOW),
        "fused": (ext.init, [applied(ext)] * WINDOW),
        "host-chosen": (
            ext.init,
            [applied(ext, False)] * (WINDOW - 1) + [applied(ext, True)],
        ),
    }
    if dtype == "bfloat16":
        ext = optax_ext.MultiSteps(INNER(), WINDOW, accumulator_dtype=None)
        steps["fused, accumulator_dtype=None"] = (ext.init, [applied(ext)] * WINDOW)
    return steps


def whole_windows(steps: int) -> int:
    """`steps` rounded down to whole windows, one window at least."""
    return max(WINDOW, steps // WINDOW * WINDOW)


def timer(programs: list, buffers: list, data):
    """A call that runs `programs` in turn on `buffers` (params and state,
    advanced in place) and `data`, and returns its seconds."""

    def call() -> float:
        t0 = time.perf_counter()
        for program in programs:
            buffers[:] = program(*buffers, data)
        jax.block_until_ready(buffers)
        return time.perf_counter() - t0

    return call


def whole_case(
    dtype: str, quick: bool, n_steps: int, rounds: int, model=None, extra=None
) -> dict:
    """ms per step over windows of 4 (host loop), temporary and compiled
    peak MiB of each form's whole train step, and the device's peak;
    `model(dtype, quick)` gives (params, loss, batch), `mlp` by default.
    `extra(params, loss, batch)`: more forms, timed with the others, as
    {name: (init, the steps of one window of 4 batches, their data)}; e.g.
    one step taking a global batch of 4 batches (`microbatched`)."""
    params, loss, batch = (model or mlp)(dtype, quick)
    steps = {n: (*s, batch) for n, s in whole_steps(loss, dtype).items()}
    steps |= extra(params, loss, batch) if extra else {}
    compiled = {}
    for init, window, data in steps.values():
        for step in window:
            if step not in compiled:
                state = jax.eval_shape(init, params)
                jitted = jax.jit(step, donate_argnums=(0, 1))
                compiled[step] = jitted.lower(params, state, data).compile()

    calls = {}
    for name, (init, window, data) in steps.items():
        copy = jax.tree.map(jnp.copy, params)
        programs = [compiled[step] for step in window] * (n_steps // WINDOW)
        calls[name] = timer(programs, [copy, init(copy)], data)
    times = {name: [call()] for name, call in calls.items()}  # warm-up
    order, rng = list(calls), random.Random(0)
    for _ in range(rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(calls[name]())

    def mib(step, peak: bool) -> float:
        m = compiled[step].memory_analysis()
        held = m.argument_size_in_bytes + m.output_size_in_bytes
        return (m.temp_size_in_bytes + (held - m.alias_size_in_bytes) * peak) / 2**20

    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return {
        "ms": {name: 1e3 * median(t[1:]) / n_steps for name, t in times.items()},
        "temp_mib": {
            n: max(mib(s, False) for s in w) for n, (_, w, _) in steps.items()
        },
        "peak_mib": {n: max(mib(s, True) for s in w) for n, (_, w, _) in steps.items()},
        "device_peak_gib": None if peak is None else round(peak / 2**30, 2),
    }


def whole_table(case: dict) -> list[str]:
    lines = [
        "| form | ms per step | optax / form | temporary MiB | / optax "
        "| compiled peak MiB | / optax |",
        "|---|---|---|---|---|---|---|",
    ]
    ms, temp, peak = case["ms"], case["temp_mib"], case["peak_mib"]
    for name in ms:
        lines.append(
            f"| {name} | {_fmt(ms[name], 3)} | {_fmt(_div(ms['optax'], ms[name]))} "
            f"| {_fmt(temp[name])} | {_fmt(_div(temp[name], temp['optax']))} "
            f"| {_fmt(peak[name])} | {_fmt(_div(peak[name], peak['optax']))} |"
        )
    return [*lines, ""]


def run_suite(timeout_s: float, platform_name: str) -> dict:
    """The test suite on the GPU, without the multi-device files; at the cap,
    pytest is interrupted and still sums up what ran."""
    command = [sys.executable, "-m", "pytest", "-n", "4", "-q", "-rfE", "tests"]
    command += ["--ignore-glob=tests/test_*multidevice*.py"]
    command += ["--ignore=tests/test_multiprocess.py"]
    env = {"JAX_PLATFORMS": platform_name, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    shown = " ".join([*(f"{k}={v}" for k, v in env.items()), "python", *command[1:]])
    print(f"suite: {shown} (cap {timeout_s:.0f} s)", flush=True)
    start = time.monotonic()
    run = subprocess.run(
        ["timeout", "-s", "INT", "-k", "30", f"{timeout_s:.0f}", *command],
        cwd=HERE.parent,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = run.stdout.splitlines()
    found = [x.strip("= ") for x in lines if re.search(r"\d+ (passed|failed)", x)]
    summary = found[-1] if found else "no summary line"
    if run.returncode in (124, 137):  # `timeout` ended it
        summary = f"TIMED OUT after {timeout_s:.0f} s: {summary}"
    seconds = time.monotonic() - start
    print(f"suite: {summary} ({seconds:.0f} s)", flush=True)
    return {
        "command": shown,
        "summary": summary,
        "seconds": round(seconds, 1),
        "failures": [x for x in lines if re.match(r"(FAILED|ERROR) ", x)][:50],
        "tail": [] if found else lines[-15:],
    }


def shapes(layout: str, quick: bool) -> dict:
    """8 large leaves, or GPT-2 small's 148; `quick` scales their sizes down."""
    if layout == "large":
        return {f"w{i}": (128, 128) if quick else (4096, 4096) for i in range(8)}
    vocab, ctx, d = (1000, 64, 32) if quick else (50257, 1024, 768)
    ln = {"g": (d,), "b": (d,)}
    dense = lambda n, m: {"w": (n, m), "b": (m,)}
    attn = {"c_attn": dense(d, 3 * d), "c_proj": dense(d, d)}
    mlp = {"c_fc": dense(d, 4 * d), "c_proj": dense(4 * d, d)}
    block = {"ln_1": ln, "attn": attn, "ln_2": ln, "mlp": mlp}
    h = {f"{i:02d}": block for i in range(12)}
    return {"wte": (vocab, d), "wpe": (ctx, d), "h": h, "ln_f": ln}


def label(case: str, quick: bool) -> str:
    """The case as the report names it."""
    layout, dtype = case.split(":")
    leaves = jax.tree.leaves(shapes(layout, quick), is_leaf=lambda x: type(x) is tuple)
    n = len(leaves)
    what = f"{n} x {leaves[0]}" if layout == "large" else f"{layout} ({n} leaves)"
    return f"{what}{', scaled down' * quick}, {dtype}"


def compile_all(jobs: dict, params, grads, workers: int) -> dict:
    """{step: init} -> {step: compiled}, params and state donated, in threads."""
    spec = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)

    def build(step, init):
        state = jax.eval_shape(init, spec(params))
        jitted = jax.jit(step, donate_argnums=(0, 1))
        return jitted.lower(spec(params), state, spec(grads)).compile()

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {step: pool.submit(build, step, init) for step, init in jobs.items()}
        return {step: f.result() for step, f in futures.items()}


def bench_case(case: str, quick: bool, n_steps: int, rounds: int, workers: int):
    """ms per step {mode: {step: {form: ms}}}, and each step's temporary MiB."""
    layout, dtype = case.split(":")
    params, grads = params_and_grads(shapes(layout, quick), dtype)
    ms_window = optax_ext.MultiSteps(INNER(), WINDOW)
    chosen = {emit: fused(ms_window, emit)[1] for emit in (False, True)}
    floor_steps = floors(INNER)
    plans: dict = {}  # mode -> step -> (init, {form: the programs it calls})
    for mode, (k, emits, _) in MODES.items():
        steps = multi_steps(INNER, k)
        steps.update({name: floor_steps[name] for name in FLOORS * (mode == "mini")})
        steps["host-chosen"] = (ms_window.init, [chosen[emit] for emit in emits])
        for name, (init, step) in steps.items():
            window = step if isinstance(step, list) else [step]
            forms = {"scan": [scanned(window, n_steps)]}
            forms["host"] = window * (n_steps // len(window))
            plans.setdefault(mode, {})[name] = (init, forms)
    jobs = {}  # each program compiled once (host-chosen ones serve every mode)
    for by_step in plans.values():
        for init, forms in by_step.values():
            jobs.update(dict.fromkeys(forms["scan"] + forms["host"], init))
    start = time.monotonic()
    compiled = compile_all(jobs, params, grads, workers)
    compile_s = time.monotonic() - start
    print(f"  compiled {len(jobs)} programs in {compile_s:.1f} s", flush=True)

    ms: dict = {mode: {} for mode in MODES}
    for mode in MODES:  # each mode's buffers freed before the next allocates
        calls = {}
        for name, (init, forms) in plans[mode].items():
            # The scan and host calls of a step share and advance its buffers.
            copy = jax.tree.map(jnp.copy, params)
            buffers = [copy, init(copy)]
            for form, steps in forms.items():
                calls[name, form] = timer([compiled[f] for f in steps], buffers, grads)
        times = {key: [call()] for key, call in calls.items()}  # warm-up
        order, shuffle = list(calls), random.Random(0).shuffle
        for _ in range(rounds):
            shuffle(order)
            for key in order:
                times[key].append(calls[key]())
        for (name, form), t in times.items():
            ms[mode].setdefault(name, {})[form] = 1e3 * median(t[1:]) / n_steps
    memory = {}  # a window's step, or a floor's mini-step
    for mode, names in (("window", CANDIDATES), ("mini", FLOORS)):
        for name in names:
            programs = {compiled[f] for f in plans[mode][name][1]["host"]}
            sizes = [p.memory_analysis().temp_size_in_bytes for p in programs]
            memory[name] = max(sizes) / 2**20
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return {
        "ms": ms,
        "temp_mib": memory,
        "compile_s": round(compile_s, 1),
        "programs": len(jobs),
        "peak_gib": None if peak is None else round(peak / 2**30, 2),
    }


def _fmt(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def time_table(times: dict, mode: str) -> list[str]:
    """One mode's times, their ratios to optax and the floors, and goals."""
    mini = mode == "mini"
    at = lambda name, form: times.get(name, {}).get(form)
    ratios = lambda a, b: [_div(at(a, f), at(b, f)) for f in ("scan", "host")]
    pair = lambda values: " / ".join(map(_fmt, values))
    head = ["step", "scan ms", "host ms", "optax / step"]
    head += ["floor", "step / floor"] * mini + ["goal", "met"]
    lines = [f"Time per {MODES[mode][2]}:", "", f"| {' | '.join(head)} |"]
    lines.append("|---" * len(head) + "|")
    for name in CANDIDATES + FLOORS * mini:
        cells = [name, _fmt(at(name, "scan"), 3), _fmt(at(name, "host"), 3)]
        cells.append(pair(ratios("optax", name)))
        floor = FLOOR_OF.get(name, "")
        cells += [floor, pair(ratios(name, floor)) if floor else ""] * mini
        ref, bound, faster = GOALS.get((mode, name), ("", 0, False))
        values = ratios(ref, name) if faster else ratios(name, ref)
        ok = [
            None if v is None else v >= bound if faster else v <= bound for v in values
        ]
        met = " / ".join({None: "n/a", True: "yes", False: "**no**"}[o] for o in ok)
        goal = f"{bound}x faster than {ref}" if faster else f"at most {bound}x {ref}"
        cells += [goal, met] if ref else ["", ""]
        lines.append(f"| {' | '.join(cells)} |")
    return [*lines, ""]


def render(report: dict) -> str:
    lines = [f"# GPU check: {report['device']}", ""]
    lines += ["Written by `python benchmarks/gpu_check.py`; do not edit by hand.", ""]
    lines += [f"- Device: **{report['device']}** ({report['machine']})"]
    lines += [f"- Date: {report['date']}"]
    lines += [f"- Run: `{report['argv']}` ({report['seconds']:.0f} s in all)", ""]
    suite, bench = report.get("suite"), report.get("bench")
    lines += ["## Test suite", "", f"`{suite['command']}`" if suite else "Not run.", ""]
    if suite:
        lines += [f"**{suite['summary']}** ({suite['seconds']:.0f} s)", ""]
        shown = suite["failures"] or suite["tail"]
        lines += ["```text", *shown, "```", ""] if shown else []
    whole = report.get("whole_step")
    lines += ["## Whole train step", ""]
    if not whole:
        lines += ["Not run.", ""]
    else:
        cfg = whole["config"]
        lines += [
            "Loss, `jax.grad` and the step in one `jax.jit`, params and state "
            f"donated, inner {cfg['inner']}: ms per step over windows of {WINDOW} "
            f"({cfg['steps']} steps a call, host loop, median of {cfg['rounds']} "
            "interleaved rounds); temporary MiB and compiled peak MiB (arguments "
            "+ outputs not aliased + temporaries) from `memory_analysis()`.",
            "",
        ]
    for key, case in (whole or {}).get("cases", {}).items():
        lines += [f"### {key}", ""]
        if "ms" not in case:
            lines += [f"Not run: {case.get('skipped', 'cut off')}.", ""]
            continue
        lines += whole_table(case)
        peak = _fmt(case["device_peak_gib"], 2)
        lines += [f"Device peak after this case, in GiB: {peak}.", ""]
    lines += ["## Train step, gradients passed in", ""]
    lines += [LEGEND if bench else "Not run.\n"]
    cfg = (bench or {}).get("config")
    for key, case in (bench or {}).get("cases", {}).items():
        lines += [f"### {key}", ""]
        if "ms" not in case:
            lines += [f"Not run: {case.get('skipped', 'cut off')}.", ""]
            continue
        lines += [
            f"K = {cfg['steps']}, {cfg['rounds']} rounds; {case['programs']} programs "
            f"compiled in {case['compile_s']:.0f} s; peak device memory in GiB: "
            f"{_fmt(case['peak_gib'], 1)}.",
            "",
        ]
        for mode in MODES:
            lines += time_table(case["ms"][mode], mode)
        lines += ["Temporary memory of each step against optax.MultiSteps:", ""]
        lines += ["| step | temporary MiB | / optax |", "|---|---|---|"]
        mib = case["temp_mib"]
        for name in CANDIDATES + FLOORS:
            vs = _fmt(_div(mib.get(name), mib.get("optax")))
            lines += [f"| {name} | {_fmt(mib.get(name))} | {vs} |"]
        lines += [""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--suite-only", action="store_true")
    which.add_argument("--bench-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run")
    parser.add_argument("--out", type=Path, help="directory for the .md and .json")
    parser.add_argument("--budget", type=float, default=480.0, help="seconds in all")
    parser.add_argument("--suite-timeout", type=float, default=240.0)
    parser.add_argument("--suite-platform", default="cuda", help="its JAX_PLATFORMS")
    parser.add_argument("--case", action="append", choices=CASES, help="repeatable")
    parser.add_argument("--steps", type=int, help="steps per timed call (K)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()
    start = time.monotonic()
    n_steps = whole_windows(args.steps or (4 if args.quick else 16))
    rounds = args.rounds or (2 if args.quick else 7)
    chosen = args.case or (["large:float32"] if args.quick else CASES)
    device = jax.devices()[0]
    if not (args.quick or args.suite_only) and device.platform == "cpu":
        sys.exit("gpu_check: no GPU visible to JAX; use --quick for a CPU smoke run")
    out = args.out or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    name = re.sub(r"[^a-z0-9]+", "-", device.device_kind.lower()).strip("-")
    report: dict = {
        "argv": " ".join(["python benchmarks/gpu_check.py", *sys.argv[1:]]),
        "device": device.device_kind,
        "machine": f"{jax.device_count()} device(s); {machine()}",
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
    }

    def write(final: bool = False) -> None:  # after each part, and at the end
        report["seconds"] = time.monotonic() - start
        (out / f"{name}.md").write_text(render(report))
        (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        if final:
            print(render(report), f"wrote {out / name}.md and .json", sep="\n")

    def cut_off() -> None:  # at the budget, even inside a compile: what is done
        parts = [report.get(part, {}) for part in ("whole_step", "bench")]
        for case in [c for part in parts for c in part.get("cases", {}).values()]:
            if "ms" not in case:
                case.setdefault("skipped", "the time budget (--budget) ended")
        try:
            write(final=True)
        finally:
            os._exit(3)

    watchdog = threading.Timer(args.budget - (time.monotonic() - start), cut_off)
    watchdog.daemon = True
    if not args.quick:
        watchdog.start()
    if not (args.bench_only or args.quick):
        timeout = max(1, min(args.suite_timeout, args.budget - 20))
        report["suite"] = run_suite(timeout, args.suite_platform)
        write()
    config = {"steps": n_steps, "rounds": rounds, "inner": "optax.adamw(1e-4)"}
    if not args.suite_only:
        whole: dict = {}
        report["whole_step"] = {"config": config, "cases": whole}
        size = "2 x (128, 128), scaled down" if args.quick else "4 x (2048, 2048)"
        for dtype in WHOLE_CASES[: 1 if args.quick else None]:
            key = f"MLP of {size}, batch 8, {dtype}"
            print(f"whole train step, {key}:", flush=True)
            whole[key] = {}
            try:
                whole[key] = whole_case(dtype, args.quick, n_steps, rounds)
            except Exception as error:  # report it; the other parts may run
                whole[key]["skipped"] = f"failed: {type(error).__name__}: {error}"
                print(f"  {whole[key]['skipped']}", flush=True)
            write()
    if not args.suite_only:
        skip = {"skipped": "not selected (--case, or --quick)"}
        cases = {label(c, args.quick): {} if c in chosen else skip for c in CASES}
        report["bench"] = {"config": config, "cases": cases}
        for case, key in zip(CASES, list(cases), strict=True):
            if case not in chosen:
                continue
            print(f"{key}:", flush=True)
            t = time.monotonic()
            try:
                cases[key] = bench_case(case, args.quick, n_steps, rounds, args.workers)
            except Exception as error:  # report it; the other cases may run
                cases[key]["skipped"] = f"failed: {type(error).__name__}: {error}"
                print(f"  {cases[key]['skipped']}", flush=True)
            print(f"  done in {time.monotonic() - t:.0f} s", flush=True)
            write()
    write(final=True)


if __name__ == "__main__":
    main()
