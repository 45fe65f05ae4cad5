"""GPU check: the test suite and the train step's device time, in one command.

Run on a machine with a GPU and JAX's CUDA build (issue 33, item 7):

    python benchmarks/gpu_check.py             # suite, then benchmark (<= 8 min)
    python benchmarks/gpu_check.py --suite-only
    python benchmarks/gpu_check.py --bench-only
    python benchmarks/gpu_check.py --quick     # CPU smoke run: tiny shapes, no suite

It writes `benchmarks/results/gpu/<device-kind-slug>.md` and `.json` (a
`--quick` run writes into a temporary directory unless `--out` says where),
naming the device (`jax.devices()[0].device_kind`), the JAX version, the
date, the suite's summary line and the tables: results mean nothing without
the device that gave them.

1. The suite: `JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false python
   -m pytest -n 4 -q tests`, without the multi-device and multi-process
   files (they run on CPU host devices), capped at `--suite-timeout`
   seconds (the whole process group is ended there; the tests run so far
   are counted from pytest's progress lines).

2. The train step, params and optimizer state donated, gradients passed in,
   inner optimizer `optax.adamw`, two layouts (GPT-2 small: 148 leaves of
   its real shapes; 8 leaves of (4096, 4096)), float32 and bfloat16. Each
   candidate is timed two ways:

   - *scan*: `K` steps inside one jitted `lax.scan` (no host dispatch
     between steps), wall time of the call / `K`: the device time;
   - *host*: a plain Python loop of `K` calls of the jitted step, blocked
     at the end, / `K`: what a training loop that dispatches every step
     pays.

   Each as a *mini*-step (a window that never closes), an *emit*ting step
   (`every_k_schedule=1`) and a *window* of 4 (3 mini + 1 emit, per-step
   average). Candidates:

   - `optax`: `optax.MultiSteps`, `update` + `optax.apply_updates`;
   - `ext`: `optax_ext.MultiSteps` as a drop-in (`update` +
     `optax.apply_updates`);
   - `ext fused`: `optax_ext.apply_gradients(ms, grads, state, params)`;
   - `host-chosen`: `apply_gradients(ms, ..., emit=False)` on mini-steps and
     `emit=True` on the step that closes the window, chosen in Python (no
     conditional compiled); "n/a" where `apply_gradients` has no `emit`;
   - `plain` / `plain fused`: `plain_multi_steps` of `train_step.py`, the
     ~40-line `lax.cond` MultiSteps, drop-in and fused;
   - floors, mini-step only: `accumulate` (the gradients folded in place
     into a float32 running mean, `acc + (g - acc) / (n + 1)`, params
     returned untouched: see `floor_steps`), `accumulate+state`
     (the same, passing the inner optimizer's state through, donated), and
     `drop-in floor` (`accumulate+state`, a zero updates tree XLA cannot
     fold, `optax.apply_updates`: the least the drop-in API can cost).

   Within a (layout, dtype) case every program is compiled first (in
   threads), then for each of mini, emit and window the candidates are
   timed round-robin, in an order shuffled each round, and the median over
   rounds is reported. Cases run in priority order and one that the time
   left (`--budget`, 480 s from the start, suite included) cannot hold is
   reported as not run.

3. Ratios against `optax` and the floors, with the issue's targets:
   fused mini <= 1.1x accumulate; drop-in mini <= 1.1x drop-in floor;
   emitting steps <= 1.1x optax's; window of 4: fused >= 1.8x and drop-in
   >= 1.15x faster than optax; host-chosen at the floors (mini <= 1.1x
   accumulate, emit <= 1.1x optax's, window as fused).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import importlib.metadata
import inspect
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

# One GPU shared by the suite's workers and then this process: allocate as
# needed (set before JAX is imported).
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import optax_ext  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from run import code_version  # noqa: E402
from train_step import accumulate_transform, plain_multi_steps  # noqa: E402

RESULTS = HERE / "results" / "gpu"
NEVER = 1_000_000_000  # every_k_schedule of a window that never closes
WINDOW = 4
HAS_EMIT = "emit" in inspect.signature(optax_ext.apply_gradients).parameters
SUITE_IGNORE = [
    "tests/test_multidevice*.py",
    "tests/test_*multidevice*.py",
    "tests/test_multiprocess.py",
    "tests/test_multidevice_runner.py",
]
MODES = ("mini", "emit", "window")
FORMS = ("scan", "host")
CANDIDATES = ("optax", "ext", "ext fused", "host-chosen", "plain", "plain fused")
FLOORS = ("accumulate", "accumulate+state", "drop-in floor")
# (layout, dtype) in priority order: those the time budget cannot hold are
# reported as not run, from the end.
CASES = [
    ("gpt2-small", "float32"),
    ("large", "float32"),
    ("large", "bfloat16"),
    ("gpt2-small", "bfloat16"),
]


def inner() -> optax.GradientTransformation:
    return optax.adamw(1e-4)


# --- the suite ------------------------------------------------------------


def _progress_counts(out: str) -> dict[str, int]:
    """Outcomes counted from pytest's `-q` progress lines (`..s.F [ 12%]`):
    what a run ended by the time cap had done."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0, "xfail": 0}
    key = {".": "passed", "F": "failed", "s": "skipped", "E": "error"}
    for line in out.splitlines():
        match = re.fullmatch(r"([.FsExX]+)\s*(\[\s*\d+%\])?", line.strip())
        if match:
            for char in match.group(1):
                counts[key.get(char, "xfail")] += 1
    return counts


def run_suite(timeout_s: float, platform_name: str = "cuda") -> dict:
    """The test suite on the GPU, without the multi-device files."""
    ignored = sorted(
        {p for pattern in SUITE_IGNORE for p in glob.glob(str(ROOT / pattern))}
    )
    command = [sys.executable, "-m", "pytest", "-n", "4", "-q", "-rfE", "tests"]
    command += [f"--ignore={Path(p).relative_to(ROOT)}" for p in ignored]
    env = dict(
        os.environ, JAX_PLATFORMS=platform_name, XLA_PYTHON_CLIENT_PREALLOCATE="false"
    )
    shown = (
        f"JAX_PLATFORMS={platform_name} XLA_PYTHON_CLIENT_PREALLOCATE=false "
        f"python {' '.join(command[1:])}"
    )
    print(f"suite: {shown} (cap {timeout_s:.0f} s)", flush=True)
    start = time.monotonic()
    # Its own process group, so that the cap ends the xdist workers too.
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
    seconds = time.monotonic() - start
    lines = out.splitlines()
    summary = next(
        (
            line.strip("= ")
            for line in reversed(lines)
            if re.search(r"\d+ (passed|failed|error|skipped)|no tests ran", line)
        ),
        "",
    )
    items = re.search(r"(\d+) workers \[(\d+) items?\]", out)
    if timed_out:
        counts = _progress_counts(out)
        done = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
        of = f" of {items.group(2)} collected" if items else ""
        summary = f"TIMED OUT after {timeout_s:.0f} s: {done or 'nothing'}{of} so far"
    elif not summary:
        summary = f"no summary line (exit status {proc.returncode})"
    problems = [line for line in lines if re.match(r"(FAILED|ERROR) ", line)]
    print(f"suite: {summary} ({seconds:.0f} s)", flush=True)
    return {
        "command": shown,
        "summary": summary,
        "returncode": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(seconds, 1),
        "failures": problems[:50],
        "tail": lines[-15:] if proc.returncode not in (0, None) else [],
    }


# --- params ---------------------------------------------------------------


def gpt2_shapes(quick: bool) -> dict:
    """GPT-2 small's 148 leaves (as in its checkpoints); `quick` keeps the
    leaves and scales their sizes down."""
    vocab, ctx, d = (1000, 64, 32) if quick else (50257, 1024, 768)

    def ln():
        return {"g": (d,), "b": (d,)}

    def block():
        return {
            "ln_1": ln(),
            "attn": {
                "c_attn": {"w": (d, 3 * d), "b": (3 * d,)},
                "c_proj": {"w": (d, d), "b": (d,)},
            },
            "ln_2": ln(),
            "mlp": {
                "c_fc": {"w": (d, 4 * d), "b": (4 * d,)},
                "c_proj": {"w": (4 * d, d), "b": (d,)},
            },
        }

    return {
        "wte": (vocab, d),
        "wpe": (ctx, d),
        "h": {f"{i:02d}": block() for i in range(12)},
        "ln_f": ln(),
    }


def large_shapes(quick: bool) -> dict:
    n = 256 if quick else 4096
    return {f"w{i}": (n, n) for i in range(8)}


LAYOUTS: dict[str, Callable[[bool], dict]] = {
    "gpt2-small": gpt2_shapes,
    "large": large_shapes,
}


def is_shape(x) -> bool:
    return isinstance(x, tuple)


def make_params(layout: str, dtype: str, quick: bool):
    shapes = LAYOUTS[layout](quick)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
    key = jax.random.key(0)
    make = jax.jit(
        lambda k, shape: (0.02 * jax.random.normal(k, shape)).astype(dtype),
        static_argnums=1,
    )
    params = treedef.unflatten(
        [make(jax.random.fold_in(key, i), s) for i, s in enumerate(leaves)]
    )
    grads = jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.cos(100 * x).astype(x.dtype), p)
    )(params)
    return params, grads


def label(layout: str, quick: bool) -> str:
    """The layout as the tables name it."""
    shapes = LAYOUTS[layout](quick)
    if layout == "large":
        return f"{len(shapes)} x {shapes['w0']}"
    n = len(jax.tree.leaves(shapes, is_leaf=is_shape))
    return f"{layout} ({n} leaves{', scaled down' if quick else ''})"


# --- the steps --------------------------------------------------------------

# A step is (init(params) -> state, step(params, state, grads) -> (params,
# state)); `host-chosen` has one step per emit value.


def train_step(opt):
    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return opt.init, step


def fused(opt, emit=None):
    if emit is None:
        return opt.init, lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p)
    return opt.init, lambda p, s, g: optax_ext.apply_gradients(opt, g, s, p, emit=emit)


def floor_steps() -> dict[str, tuple[Callable, Callable]]:
    """The floors: `train_step.accumulate_transform`'s running mean in a
    float32 buffer (the arithmetic of a MultiSteps mini-step; on XLA:CPU
    `acc + g` alone compiles, inside a scan, 3 to 4 times slower, so it is
    no floor there), alone, passing the inner state through, and with the
    zero updates of the drop-in API."""
    acc = accumulate_transform()
    held = inner()

    def accumulate(params, state, grads):
        return params, acc.update(grads, state)

    def init_state(params):
        return acc.init(params), held.init(params)

    def accumulate_state(params, state, grads):
        acc_state, inner_state = state
        return params, (acc.update(grads, acc_state), inner_state)

    def dropin_floor(params, state, grads):
        params, state = accumulate_state(params, state, grads)
        never = state[0][0] < 0  # the count: a traced False, no folding

        def zeros(never):
            leaves, treedef = jax.tree.flatten(params)
            return treedef.unflatten(
                [
                    jnp.full(p.shape, jnp.where(never, i + 1, 0), p.dtype)
                    for i, p in enumerate(leaves)
                ]
            )

        updates = lax.cond(never, zeros, zeros, never)
        return optax.apply_updates(params, updates), state

    return {
        "accumulate": (acc.init, accumulate),
        "accumulate+state": (init_state, accumulate_state),
        "drop-in floor": (init_state, dropin_floor),
    }


def candidate_steps(mode: str) -> dict[str, tuple[Callable, Callable]]:
    """name -> (init, step) for `mode` (the host-chosen form apart)."""
    k = {"mini": NEVER, "emit": 1, "window": WINDOW}[mode]
    p_init, p_update, p_apply = plain_multi_steps(inner(), k)

    def plain(params, state, grads):
        updates, state = p_update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def plain_fused(params, state, grads):
        return p_apply(grads, state, params)

    return {
        "optax": train_step(optax.MultiSteps(inner(), k)),
        "ext": train_step(optax_ext.MultiSteps(inner(), k)),
        "ext fused": fused(optax_ext.MultiSteps(inner(), k)),
        "plain": (p_init, plain),
        "plain fused": (p_init, plain_fused),
    }


def host_chosen(emit: bool):
    return fused(optax_ext.MultiSteps(inner(), WINDOW), emit)


def pattern(mode: str) -> list[bool]:
    """The host-chosen `emit` values of `mode`'s steps, one window."""
    return {"mini": [False], "emit": [True], "window": [False] * 3 + [True]}[mode]


def scanned(steps: list[Callable], n_steps: int) -> Callable:
    """`n_steps` steps in one `lax.scan`: each iteration runs `steps` in
    order (one step, or a host-chosen window)."""

    def run(params, state, grads):
        def body(carry, _):
            for step in steps:
                carry = step(*carry, grads)
            return carry, None

        carry, _ = lax.scan(body, (params, state), None, length=n_steps // len(steps))
        return carry

    return run


# --- timing -----------------------------------------------------------------


class Buffers:
    """The params and state one (candidate, mode) carries between calls;
    its scan and host runners share them (both advance whole windows)."""

    def __init__(self, init, params):
        self.params = jax.tree.map(jnp.copy, params)
        self.state = init(self.params)


class Runner:
    """A timed unit: `n_steps` steps, one scan call or `n_steps` host calls."""

    def __init__(self, programs: list, buffers: Buffers, grads, n_steps: int):
        self.programs, self.buffers, self.grads = programs, buffers, grads
        self.n_steps = n_steps
        self.times: list[float] = []

    def call(self) -> float:
        b, grads = self.buffers, self.grads
        start = time.perf_counter()
        for program in self.programs:
            b.params, b.state = program(b.params, b.state, grads)
        jax.block_until_ready((b.params, b.state))
        return time.perf_counter() - start


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def compile_all(jobs: dict, params, grads, workers: int) -> dict:
    """name -> compiled, for jobs {name: (init, fn)}; lowered on abstract
    values and compiled in threads (XLA releases the GIL)."""
    a_params, a_grads = _abstract(params), _abstract(grads)

    def build(init, fn):
        a_state = jax.eval_shape(init, a_params)
        jitted = jax.jit(fn, donate_argnums=(0, 1))
        return jitted.lower(a_params, a_state, a_grads).compile()

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        futures = {name: pool.submit(build, *job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def time_mode(
    mode: str, names, inits, compiled, params, grads, n_steps: int, rounds: int
) -> dict:
    """{candidate: {form: ms per step}} for one mode, timed interleaved. Its
    buffers are freed on return, before the next mode allocates its own."""
    runners = {}
    for name in names + (list(FLOORS) if mode == "mini" else []):
        buffers = Buffers(inits[name, mode], params)
        scan = [compiled[name, mode, "scan"]]
        if name == "host-chosen":
            emits = pattern(mode) * (n_steps // len(pattern(mode)))
            host = [compiled["host-chosen", e, "host"] for e in emits]
        else:
            host = [compiled[name, mode, "host"]] * n_steps
        runners[name, "scan"] = Runner(scan, buffers, grads, n_steps)
        runners[name, "host"] = Runner(host, buffers, grads, n_steps)
    for runner in runners.values():
        runner.call()  # warm up
    order = list(runners.values())
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for runner in order:
            runner.times.append(runner.call())
    out: dict = {}
    for (name, form), runner in runners.items():
        out.setdefault(name, {})[form] = 1e3 * statistics.median(runner.times) / n_steps
    return out


def bench_case(
    layout: str, dtype: str, quick: bool, n_steps: int, rounds: int, workers: int
) -> dict:
    """{mode: {candidate: {form: ms per step}}} and compile seconds."""
    params, grads = make_params(layout, dtype, quick)
    names = (
        list(CANDIDATES) if HAS_EMIT else [c for c in CANDIDATES if c != "host-chosen"]
    )
    inits, jobs = {}, {}
    for mode in MODES:
        for name, (init, step) in candidate_steps(mode).items():
            inits[name, mode] = init
            jobs[name, mode, "scan"] = (init, scanned([step], n_steps))
            jobs[name, mode, "host"] = (init, step)
        if HAS_EMIT:
            steps = [host_chosen(e)[1] for e in pattern(mode)]
            init = host_chosen(False)[0]
            inits["host-chosen", mode] = init
            jobs["host-chosen", mode, "scan"] = (init, scanned(steps, n_steps))
    if HAS_EMIT:
        for emit in (False, True):
            init, step = host_chosen(emit)
            jobs["host-chosen", emit, "host"] = (init, step)
    for name, (init, step) in floor_steps().items():
        inits[name, "mini"] = init
        jobs[name, "mini", "scan"] = (init, scanned([step], n_steps))
        jobs[name, "mini", "host"] = (init, step)
    start = time.monotonic()
    compiled = compile_all(jobs, params, grads, workers)
    compile_s = time.monotonic() - start
    print(f"  compiled {len(jobs)} programs in {compile_s:.1f} s", flush=True)

    out = {
        mode: time_mode(mode, names, inits, compiled, params, grads, n_steps, rounds)
        for mode in MODES
    }
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {
        "ms": out,
        "compile_s": round(compile_s, 1),
        "programs": len(jobs),
        "peak_gib": None if peak is None else round(peak / 2**30, 2),
    }


# --- report -------------------------------------------------------------------


def _get(ms: dict, mode: str, name: str, form: str) -> float | None:
    return ms.get(mode, {}).get(name, {}).get(form)


def _ratio_rows(names, ratios) -> list[str]:
    """A table row per name: its `ratios(name)`, two decimals."""
    return [
        f"| {name} | " + " | ".join(_fmt(r, 2) for r in ratios(name)) + " |"
        for name in names
    ]


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


# (what, mode, numerator, denominator, target): a ratio of ms per step,
# "<=" a bound for a candidate over a floor (or over optax's emitting step),
# ">=" a bound for a speed-up (optax over the candidate).
TARGETS = [
    ("fused mini / accumulate", "mini", "ext fused", "accumulate", "<= 1.1"),
    ("drop-in mini / drop-in floor", "mini", "ext", "drop-in floor", "<= 1.1"),
    ("fused emit / optax emit", "emit", "ext fused", "optax", "<= 1.1"),
    ("drop-in emit / optax emit", "emit", "ext", "optax", "<= 1.1"),
    ("window: optax / fused", "window", "optax", "ext fused", ">= 1.8"),
    ("window: optax / drop-in", "window", "optax", "ext", ">= 1.15"),
    ("host-chosen mini / accumulate", "mini", "host-chosen", "accumulate", "<= 1.1"),
    ("host-chosen emit / optax emit", "emit", "host-chosen", "optax", "<= 1.1"),
    ("window: optax / host-chosen", "window", "optax", "host-chosen", ">= 1.8"),
]


def targets(ms: dict, form: str) -> list[tuple[str, float | None, str, bool | None]]:
    """(what, value, target, met) for one case and form."""
    out = []
    for what, mode, num, den, target in TARGETS:
        value = _div(_get(ms, mode, num, form), _get(ms, mode, den, form))
        sense, bound = target.split()
        met = None
        if value is not None:
            met = value <= float(bound) if sense == "<=" else value >= float(bound)
        out.append((what, value, target, met))
    return out


def render(report: dict) -> str:
    lines = [
        f"# GPU check: {report['device']}",
        "",
        "Written by `python benchmarks/gpu_check.py`; do not edit by hand.",
        "",
        f"- Device: **{report['device']}** ({report['platform']}, "
        f"{report['device_count']} device(s))",
        f"- Date: {report['date']}",
        f"- jax {report['jax']}, jaxlib {report['jaxlib']}, optax "
        f"{report['optax']}, Python {report['python']}; optax_ext at "
        f"{report['code']}",
        f"- `apply_gradients(..., emit=)`: "
        f"{'present' if report['has_emit'] else 'absent (host-chosen: n/a)'}",
        f"- Run: {report['argv']} ({report['seconds']:.0f} s in all)",
        "",
        "## Test suite",
        "",
    ]
    suite = report.get("suite")
    if suite is None:
        lines += ["Not run (`--bench-only` or `--quick`).", ""]
    else:
        lines += [
            f"`{suite['command']}`",
            "",
            f"**{suite['summary']}** ({suite['seconds']:.0f} s, exit status "
            f"{suite['returncode']})",
            "",
        ]
        shown = suite["failures"] or (
            suite["tail"] if suite["summary"].startswith("no summary") else []
        )
        if shown:
            lines += ["```text", *shown, "```", ""]
    bench = report.get("bench")
    if bench is None:
        lines += ["## Train step", "", "Not run (`--suite-only`).", ""]
        return "\n".join(lines)
    cfg = bench["config"]
    lines += [
        "## Train step",
        "",
        f"Inner `optax.adamw`; params and state donated. *scan*: {cfg['steps']} "
        "steps in one jitted `lax.scan`, per step (device time); *host*: "
        f"{cfg['steps']} calls of the jitted step from Python, per step. "
        f"Median of {cfg['rounds']} interleaved rounds; ms per step. *window*: "
        f"a window of {WINDOW} (3 mini + 1 emit), per-step average. The "
        "candidates and floors are defined in the script's docstring.",
        "",
    ]
    for key, case in bench["cases"].items():
        lines += [f"### {key}", ""]
        if "ms" not in case:
            lines += [f"Not run: {case.get('skipped', 'in progress')}.", ""]
            continue
        ms = case["ms"]
        lines += [
            f"{case['programs']} programs compiled in {case['compile_s']:.0f} s"
            + (
                f"; peak device memory so far {case['peak_gib']:.1f} GiB."
                if case.get("peak_gib") is not None
                else "."
            ),
            "",
            "| candidate | mini scan | mini host | emit scan | emit host "
            "| window scan | window host |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in CANDIDATES + FLOORS:
            cells = [_fmt(_get(ms, m, name, f)) for m in MODES for f in FORMS]
            if name in FLOORS:
                cells = [c if i < 2 else "" for i, c in enumerate(cells)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "Speed-up over `optax.MultiSteps` (optax / candidate, above 1: faster):",
            "",
            "| candidate | mini scan | mini host | emit scan | emit host "
            "| window scan | window host |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += _ratio_rows(
            CANDIDATES[1:],
            lambda name, ms=ms: [
                _div(_get(ms, m, "optax", f), _get(ms, m, name, f))
                for m in MODES
                for f in FORMS
            ],
        )
        lines += [
            "",
            "Mini-step over the floors (candidate / floor):",
            "",
            "| candidate | / accumulate, scan | / accumulate, host "
            "| / accumulate+state, scan | / accumulate+state, host "
            "| / drop-in floor, scan | / drop-in floor, host |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += _ratio_rows(
            CANDIDATES + FLOORS[1:],
            lambda name, ms=ms: [
                _div(_get(ms, "mini", name, f), _get(ms, "mini", floor, f))
                for floor in FLOORS
                for f in FORMS
            ],
        )
        lines += [
            "",
            "Issue 33 targets:",
            "",
            "| ratio | scan | host | target | met (scan / host) |",
            "|---|---|---|---|---|",
        ]
        by_form = {f: targets(ms, f) for f in FORMS}
        for i, (what, _, target, _) in enumerate(by_form["scan"]):
            vals = [by_form[f][i][1] for f in FORMS]
            met = " / ".join(
                {None: "n/a", True: "yes", False: "**no**"}[by_form[f][i][3]]
                for f in FORMS
            )
            lines.append(
                f"| {what} | {_fmt(vals[0], 2)} | {_fmt(vals[1], 2)} | {target} "
                f"| {met} |"
            )
        lines += [
            "",
            "Plain `lax.cond` MultiSteps / optax_ext (above 1: optax_ext faster):",
            "",
            "| form | mini scan | mini host | emit scan | emit host "
            "| window scan | window host |",
            "|---|---|---|---|---|---|---|",
        ]
        for plain, ext in (("plain", "ext"), ("plain fused", "ext fused")):
            cells = [
                _fmt(_div(_get(ms, m, plain, f), _get(ms, m, ext, f)), 2)
                for m in MODES
                for f in FORMS
            ]
            lines.append(f"| {plain} / {ext} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


# --- main ---------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--suite-only", action="store_true")
    which.add_argument("--bench-only", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="CPU smoke run: tiny shapes, no suite"
    )
    parser.add_argument("--out", type=Path, help="directory for the .md and .json")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds in all (default 480; none with --quick): cases that do "
        "not fit are not run, and the process ends at the budget, report written",
    )
    parser.add_argument("--suite-timeout", type=float, default=240.0)
    parser.add_argument(
        "--suite-platform",
        default="cuda",
        help="JAX_PLATFORMS of the suite (another value tests this script)",
    )
    parser.add_argument(
        "--case",
        action="append",
        choices=[f"{layout}:{dtype}" for layout, dtype in CASES],
        help="run only this (layout, dtype), repeatable (default: all four; "
        "--quick leaves out gpt2-small:bfloat16, the slowest to compile on CPU)",
    )
    parser.add_argument("--steps", type=int, help="steps per timed unit (K)")
    parser.add_argument("--rounds", type=int, help="interleaved rounds")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    args = parser.parse_args()
    start = time.monotonic()
    budget = args.budget or (float("inf") if args.quick else 480.0)
    n_steps = args.steps or (8 if args.quick else 16)
    n_steps = max(WINDOW, n_steps - n_steps % WINDOW)
    rounds = args.rounds or (3 if args.quick else 7)

    device = jax.devices()[0]
    if not (args.quick or args.suite_only) and device.platform == "cpu":
        sys.exit("gpu_check: no GPU visible to JAX; use --quick for a CPU smoke run")
    out = args.out or (
        Path(tempfile.mkdtemp(prefix="gpu_check-")) if args.quick else RESULTS
    )
    out.mkdir(parents=True, exist_ok=True)
    name = slug(device.device_kind)
    report: dict = {
        "argv": " ".join(["python benchmarks/gpu_check.py", *sys.argv[1:]]),
        "device": device.device_kind,
        "platform": device.platform,
        "device_count": jax.device_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        "jax": jax.__version__,
        "jaxlib": importlib.metadata.version("jaxlib"),
        "optax": optax.__version__,
        "python": platform.python_version(),
        "code": code_version(),
        "has_emit": HAS_EMIT,
        "seconds": 0.0,
    }

    def write(final: bool = False) -> str:
        """The report as it stands (after each part, so that a run cut
        short leaves what it measured)."""
        report["seconds"] = time.monotonic() - start
        text = render(report)
        (out / f"{name}.md").write_text(text)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        if final:
            print(text)
            print(f"wrote {out / name}.md and .json ({report['seconds']:.0f} s)")
        return text

    def cut_off() -> None:
        # The budget is a promise: end here, with the report of what is done
        # (a compile in progress cannot be interrupted otherwise).
        cases = report.get("bench", {}).get("cases", {})
        for case in cases.values():
            if case.get("running"):
                case.clear()
                case["skipped"] = f"cut off at the time budget ({budget:.0f} s)"
        for layout, dtype in CASES:
            key = f"{label(layout, args.quick)}, {dtype}"
            if "bench" in report and key not in cases:
                cases[key] = {"skipped": "the time budget ended first"}
        try:
            write(final=True)
        finally:
            os._exit(3)

    if budget != float("inf"):
        watchdog = threading.Timer(budget - (time.monotonic() - start), cut_off)
        watchdog.daemon = True
        watchdog.start()

    if not (args.bench_only or args.quick):
        left = budget - (time.monotonic() - start) - 10
        report["suite"] = run_suite(
            min(args.suite_timeout, max(left, 1)), args.suite_platform
        )
        write()
    if not args.suite_only:
        report["bench"] = bench = {
            "config": {
                "steps": n_steps,
                "rounds": rounds,
                "inner": "optax.adamw(1e-4)",
            },
            "cases": {},
        }
        took: dict[str, float] = {}
        chosen = args.case or [
            f"{layout}:{dtype}"
            for layout, dtype in CASES
            if not (args.quick and (layout, dtype) == CASES[-1])
        ]
        for layout, dtype in CASES:
            key = f"{label(layout, args.quick)}, {dtype}"
            if f"{layout}:{dtype}" not in chosen:
                bench["cases"][key] = {"skipped": "not selected (--case, --quick)"}
                continue
            left = budget - (time.monotonic() - start) - 10
            need = 1.2 * took.get(layout, max(took.values(), default=0.0))
            if need > left:
                why = f"time budget ({left:.0f} s left, about {need:.0f} s needed)"
                bench["cases"][key] = {"skipped": why}
                print(f"{key}: not run, {why}", flush=True)
                continue
            print(f"{key}:", flush=True)
            bench["cases"][key] = {"running": True}
            t = time.monotonic()
            try:
                result = bench_case(
                    layout, dtype, args.quick, n_steps, rounds, args.workers
                )
            except Exception as error:  # report it; the other cases may run
                result = {"skipped": f"failed: {type(error).__name__}: {error}"}
                print(f"  {result['skipped']}", flush=True)
            bench["cases"][key] = result
            took[layout] = time.monotonic() - t
            print(f"  done in {took[layout]:.0f} s", flush=True)
            write()
    write(final=True)


if __name__ == "__main__":
    main()
