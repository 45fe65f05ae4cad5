"""The temporary memory of the train step users write (a loss, `jax.grad`
and the optimizer step in one `jax.jit`, params and state donated), for
each optax_ext form beside `optax.MultiSteps` and the bare optimizer,
compiled the same way: for XLA:CPU with the JAX installed, and for an
H200 and a TPU v5e deviceless where run in `.venv-deviceless`; with
`--estimate`, each form's device time estimated from the same compile.

    python benchmarks/whole_step.py [--backends cpu gpu tpu] [--out FILE]
        [--cases default|decoder]
    python benchmarks/whole_step.py --estimate --backends gpu tpu \
        [--models mlp decoder gpt2-small] [--dtypes float32 bfloat16] \
        [--launch-us 1]
    python benchmarks/whole_step.py --microbatched [--estimate] \
        [--backends cpu gpu tpu] [--models mlp decoder] [--out FILE [--append]]

The steps and models are those of `tests/test_train_step_memory.py`,
which asserts the bound; this prints the figures, at the sizes of the
issue that asked for them (an MLP of 4 x (2048, 2048), batch 8).
`--cases decoder` gives a GPT-2-like decoder whose activations dominate
(4 layers of width 256, 4 heads, sequence 128, batch 8, vocabulary 4096).

`--estimate` (an estimate, not a measurement) compiles every form's
whole step, and the loss and `jax.grad` alone, and costs each program
from its compiled HLO with `benchmarks/step_cost.py`, whose docstring
gives the method (H200: each kernel at max(FLOPs / peak, bytes / 4.8
TB/s); TPU v5e: the sum of XLA's `estimated_cycles`). A two-branch
conditional costs its cheaper branch on a mini-step and its dearer one on
an emitting step, and a window of 4 is 3 mini-steps and 1 emitting step
(`emit=`: 3 `emit=False` steps and 1 `emit=True` step). With
`--launch-us US`, each H200 case also gives each form's kernels and their
launches at US microseconds each (`step_cost.LAUNCH_US`: 1).

`--microbatched` gives `optax_ext.microbatched(jax.grad(loss), 4)` beside
optax.MultiSteps, float32, adamw: one jitted step takes a global batch of
4 of the model's batches, loops over them, then runs the bare optimizer's
step (params and state donated). It replaces a window of 4 optax steps:
its temporary memory over the params' bytes beside optax's step's, and
with `--estimate` one run of its program (`StepCost` with `window=1`,
its loop's body counted once per micro-batch) against optax's window of
4, on the H200 with and without the launch term (`--launch-us`, else
`step_cost.LAUNCH_US`) and in TPU v5e cycles. `--append` adds to `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import platform
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
# The repository root, for `benchmarks.step_cost`: last, so that an
# optax_ext put first on the path (`--optimizer-step-check`) stays first.
sys.path.append(str(TESTS.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import test_train_step_memory as ts  # noqa: E402
from _compiled import compile_step, unavailable  # noqa: E402

import optax_ext  # noqa: E402
from benchmarks import step_cost  # noqa: E402
from benchmarks.step_cost import StepCost, program_cost  # noqa: E402

COLUMNS = ["bare", "optax", "drop-in", "fused", "emit=False", "emit=True"]
MLP = "mlp 4 x (2048, 2048), batch 8"
GPT = "gpt2-like, 2 layers of width 256"
WIDE = "gpt2-like, 6 layers of width 512, sequence 128"
DECODER = "gpt2-like decoder, 4 layers of width 256, sequence 128, batch 8"
GPT2_SMALL = "gpt2-small-like, 12 layers of width 768, sequence 128, batch 8"
# (model, dtype, inner, the accumulator_dtype of optax_ext's forms)
CASES = [
    (MLP, "float32", "adamw", jnp.float32),
    (MLP, "float32", "lion", jnp.float32),
    (MLP, "float32", "clip+adamw", jnp.float32),
    (MLP, "bfloat16", "adamw", jnp.float32),
    (MLP, "bfloat16", "adamw", None),
    (GPT, "float32", "adamw", jnp.float32),
    (GPT, "float32", "clip+adamw", jnp.float32),
    (WIDE, "float32", "adamw", jnp.float32),
    (WIDE, "float32", "clip+adamw", jnp.float32),
]
# An activation-dominated model beside the MLP (`--cases decoder`).
DECODER_CASES = [
    (DECODER, "float32", "adamw", jnp.float32),
    (DECODER, "float32", "clip+adamw", jnp.float32),
    (DECODER, "bfloat16", "adamw", jnp.float32),
]
# bfloat16 params with a bfloat16 accumulator rounded stochastically.
STOCHASTIC_CASES = [
    (MLP, "bfloat16", "adamw", "stochastic"),
    (DECODER, "bfloat16", "adamw", "stochastic"),
]
CASE_SETS = {"default": CASES, "decoder": DECODER_CASES, "stochastic": STOCHASTIC_CASES}
MODEL_NAMES = {"mlp": MLP, "decoder": DECODER, "gpt2-small": GPT2_SMALL}


def _model(name, dtype):
    if name == MLP:
        return ts._mlp(dtype, width=2048, depth=4, batch=8)
    if name == WIDE:
        return ts._gpt(dtype, d=512, layers=6, heads=8, vocab=4096, seq=128)
    if name == DECODER:
        return ts._gpt(dtype, d=256, layers=4, heads=4, vocab=4096, seq=128, batch=8)
    if name == GPT2_SMALL:
        return ts._gpt(dtype, d=768, layers=12, heads=12, vocab=50257, seq=128, batch=8)
    return ts._gpt(dtype)


def _available(backends):
    """(backend, its name in the tables) for each backend this JAX compiles
    for; the others are skipped, saying why."""
    for backend in backends:
        why = unavailable(backend)
        if why:
            print(f"{backend}: skipped ({why})", file=sys.stderr)
            continue
        name = {"cpu": f"XLA:CPU (jax {jax.__version__})", "gpu": "H200"}
        yield backend, name.get(backend, "TPU v5e")


def compiled_step(backend, model, dtype, inner, accumulator, form):
    """(the form's whole train step compiled for `backend`, the params);
    form `grads`: the loss and `jax.grad` alone, returning the gradients."""
    params, loss, batch = _model(model, jnp.dtype(dtype))
    if form == "microbatched":
        tx = ts.INNER[inner][0]()
        grads = optax_ext.microbatched(jax.grad(loss), ts.K)

        def step(params, state, global_batch):
            updates, state = tx.update(grads(params, global_batch), state, params)
            return optax.apply_updates(params, updates), state

        global_batch = jnp.concatenate([batch] * ts.K)
        state = jax.eval_shape(tx.init, params)
        compiled = ts.compile_train_step(backend, step, params, state, global_batch, [])
        return compiled, params
    if form == "grads":

        def step(params, state, batch):
            return jax.grad(loss)(params, batch)

        return ts.compile_train_step(backend, step, params, (), batch, []), params
    tx = ts.INNER[inner][0]()
    opt = {"bare": tx, "optax": optax.MultiSteps(tx, ts.K)}.get(form)
    if accumulator == "stochastic":
        opt = opt or optax_ext.MultiSteps(
            tx, ts.K, accumulator_dtype=jnp.bfloat16, stochastic_rounding=True
        )
    opt = opt or optax_ext.MultiSteps(tx, ts.K, accumulator_dtype=accumulator)
    state = jax.eval_shape(opt.init, params)
    step = ts.train_step(opt, form, loss, [])
    return ts.compile_train_step(backend, step, params, state, batch, []), params


def ratio(backend, model, dtype, inner, accumulator, form):
    compiled, params = compiled_step(backend, model, dtype, inner, accumulator, form)
    return compiled.memory_analysis().temp_size_in_bytes / ts._bytes(params)


# --- device time estimated from the compiled HLO (`--estimate`) -------------

# Each form's window of 4: its mini-step's program, its emitting step's
# program and the branch that one runs (`StepCost`: 3 mini-steps, 1 emitting).
WINDOW_OF = {
    "bare": ("bare", "bare", min),
    "optax": ("optax", "optax", max),
    "drop-in": ("drop-in", "drop-in", max),
    "fused": ("fused", "fused", max),
    "emit=": ("emit=False", "emit=True", max),
}


def estimate(backend, model, dtype, inner="adamw", launch_us=None):
    """The estimate table's lines for one case on `backend`; with
    `launch_us` on the H200, then each form's kernels and their launches
    at `launch_us` each (`step_cost.table`)."""
    programs = ["grads", "bare", "optax", "drop-in", "fused", "emit=False", "emit=True"]
    cost, temp = {}, {}
    for form in programs:
        compiled, params = compiled_step(
            backend, model, dtype, inner, jnp.float32, form
        )
        text = compiled.as_text()
        for pick in (min, max):
            cost[form, pick] = program_cost(text, backend, pick)
        temp[form] = compiled.memory_analysis().temp_size_in_bytes
        print(
            f"  {form}: {cost[form, min][:4]} / {cost[form, max][:4]}", file=sys.stderr
        )
    name = {"gpu": "H200", "tpu": "TPU v5e"}[backend]
    window = {
        f: StepCost(
            name, 4, cost[mini, min], cost[emit, pick], (temp[mini], temp[emit])
        )
        for f, (mini, emit, pick) in WINDOW_OF.items()
    }
    unit, scale = ("us", 1e6) if backend == "gpu" else ("k cycles", 1e-3)
    grads = cost["grads", min][0]
    params_bytes = ts._bytes(params)
    lines = [
        f"| form | mini-step, {unit} | emitting step, {unit} | window of 4, {unit} "
        "| optax / form, window | optimizer's share of the window | temp / params |",
        "|---|---|---|---|---|---|---|",
    ]
    for form, (mini, emit, _) in WINDOW_OF.items():
        w = window[form]
        share = 1 - 4 * grads / w.cost
        mem = (
            f"{temp[mini] / params_bytes:.3f}"
            if mini == emit
            else f"{temp[mini] / params_bytes:.3f}, {temp[emit] / params_bytes:.3f}"
        )
        first, last = w.mini.cost * scale, w.emitting.cost * scale
        lines.append(
            f"| {form} | {first:.1f} | {last:.1f} "
            f"| {w.cost * scale:.1f} | {window['optax'].cost / w.cost:.2f} "
            f"| {share:.2f} | {mem} |"
        )
    g = cost["grads", min]
    lines += [
        "",
        f"The loss and `jax.grad` alone: {g[0] * scale:.1f} {unit} a step"
        + (
            f", {g[1] / 1e9:.2f} GFLOP of dots and {g[2] / 1e6:.1f} MB moved."
            if backend == "gpu"
            else f"; instructions without `estimated_cycles` in optax's step: "
            f"{cost['optax', max][3]}, in the fused step: {cost['fused', max][3]}."
        ),
        "",
    ]
    if launch_us is not None and backend == "gpu":
        window = {
            f: dataclasses.replace(w, launch_us=launch_us) for f, w in window.items()
        }
        lines += [
            f"With its kernel launches, {launch_us:g} us each (`step_cost.py`); "
            f"the loss and `jax.grad` alone launch {g.kernels} kernels a step:",
            "",
            step_cost.table(window, "optax", params_bytes),
            "",
        ]
    return lines


# The forms `--microbatched` compares, and how many runs of each one's
# program a window of 4 batches takes (`microbatched`: one call a window).
MICROBATCHED_FORMS = {"optax": ts.K, "microbatched": 1}


def microbatched_memory(backend, name, models):
    """Lines of the memory table of `--microbatched`: per model, optax's and
    microbatched's temporary memory over the params' bytes, and their
    compiled peaks (arguments + outputs not aliased + temporaries)."""
    lines = []
    for model in models:
        temp, peak = {}, {}
        for form in MICROBATCHED_FORMS:
            compiled, params = compiled_step(
                backend, MODEL_NAMES[model], "float32", "adamw", jnp.float32, form
            )
            m, params_bytes = compiled.memory_analysis(), ts._bytes(params)
            held = m.argument_size_in_bytes + m.output_size_in_bytes
            temp[form] = m.temp_size_in_bytes / params_bytes
            peak[form] = temp[form] + (held - m.alias_size_in_bytes) / params_bytes
        a, b = temp["optax"], temp["microbatched"]
        lines.append(
            f"| {name} | {model} | {a:.3f} | {b:.3f} | {f'{b / a:.2f}' if a else '-'} "
            f"| {peak['optax']:.3f} | {peak['microbatched']:.3f} |"
        )
        print(lines[-1], flush=True)
    return lines


def microbatched_estimate(backend, model, launch_us=None):
    """Lines of the estimate of `--microbatched` for one model on `backend`:
    each form's window of 4 batches (optax: 4 runs of its step, 3 of them
    mini-steps; microbatched: one run of its program), optax's over the
    form's; on the H200 without and with the launch term."""
    launch_us = step_cost.LAUNCH_US if launch_us is None else launch_us
    name = {"gpu": "H200", "tpu": "TPU v5e"}[backend]
    window, uncosted = {}, {}
    for form, runs in MICROBATCHED_FORMS.items():
        compiled, params = compiled_step(
            backend, MODEL_NAMES[model], "float32", "adamw", jnp.float32, form
        )
        text, temp = compiled.as_text(), compiled.memory_analysis().temp_size_in_bytes
        mini, last = (program_cost(text, backend, pick) for pick in (min, max))
        window[form] = StepCost(name, runs, mini, last, (temp, temp), launch_us)
        uncosted[form] = last.uncosted
    params_bytes = ts._bytes(params)
    base = window["optax"]
    if backend == "gpu":
        lines = [
            "| form | runs a window | kernels a window | window of 4 batches, us "
            "| optax / form | launches, us | with launches, us "
            "| optax / form, with launches | temp / params |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for form, w in window.items():
            lines.append(
                f"| {form} | {w.window} | {w.kernels} | {w.cost * 1e6:.1f} "
                f"| {base.cost / w.cost:.2f} | {w.launch_cost * 1e6:.1f} "
                f"| {w.with_launches * 1e6:.1f} "
                f"| {base.with_launches / w.with_launches:.2f} "
                f"| {w.temp[0] / params_bytes:.3f} |"
            )
        note = f"Launches at {launch_us:g} us each (`step_cost.LAUNCH_US`)."
    else:
        lines = [
            "| form | runs a window | window of 4 batches, k cycles "
            "| optax / form | temp / params |",
            "|---|---|---|---|---|",
        ]
        for form, w in window.items():
            lines.append(
                f"| {form} | {w.window} | {w.cost * 1e-3:.1f} "
                f"| {base.cost / w.cost:.2f} | {w.temp[0] / params_bytes:.3f} |"
            )
        note = "Instructions without `estimated_cycles`: " + ", ".join(
            f"{f} {n}" for f, n in uncosted.items()
        )
        note += "."
    return [*lines, "", note, ""]


def microbatched_lines(args, stamp):
    """The lines `--microbatched` writes."""
    if args.estimate:
        lines = [
            stamp + " Estimated from the compile, not measured: float32, adamw, "
            f"a window of {ts.K} batches; `microbatched(jax.grad(loss), {ts.K})` "
            "runs it in one call on a global batch of "
            f"{ts.K} batches, optax.MultiSteps in {ts.K} steps.",
            "",
        ]
    else:
        lines = [
            stamp + " The whole train step's temporary memory over the params' "
            f"bytes, float32, adamw: optax.MultiSteps' step (every_k {ts.K}) "
            f"and `microbatched(jax.grad(loss), {ts.K})`'s on a global batch "
            f"of {ts.K} batches, then the bare adamw's step. Optax's accumulator "
            "is in its state (an argument, in the peak only); microbatched's is "
            "a temporary. Peak: arguments + outputs not aliased + temporaries "
            "(`memory_analysis()`), over the params' bytes.",
            "",
            "| backend | model | optax | microbatched | microbatched / optax "
            "| peak, optax | peak, microbatched |",
            "|---|---|---|---|---|---|---|",
        ]
    for backend, name in _available(args.backends):
        if not args.estimate:
            lines += microbatched_memory(backend, name, args.models)
            continue
        if backend == "cpu":
            continue
        for model in args.models:
            print(f"{name}, {MODEL_NAMES[model]}:", file=sys.stderr)
            lines += [f"### {name}, {MODEL_NAMES[model]}, float32, adamw", ""]
            lines += microbatched_estimate(backend, model, args.launch_us)
            print("\n".join(lines[-9:]), flush=True)
    return lines


def bits(windows=10):
    """Lines comparing each form's params with optax.MultiSteps' after
    every step of `windows` windows of 4 of the same whole train step
    (a 2-layer tanh MLP of (64, 64), float32, adamw, batch 16): the first
    step whose params differ, and at the end how many of the 8,192 params
    differ and by how much at most."""
    import numpy as np

    key = jax.random.key(0)
    params = {
        f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (64, 64)) / 8
        for i in range(2)
    }
    xs = jax.random.normal(jax.random.fold_in(key, 2), (4 * windows, 16, 64))

    def loss(p, x):
        return jnp.mean(jnp.tanh(jnp.tanh(x @ p["w0"]) @ p["w1"]) ** 2)

    def run(opt, form):
        steps = [form] * 4
        if form == "emit=":
            steps = ["emit=False"] * 3 + ["emit=True"]
        forms = {
            f: jax.jit(ts.train_step(opt, f, loss, []), donate_argnums=(0, 1))
            for f in set(steps)
        }
        p, s, out = jax.tree.map(jnp.copy, params), opt.init(params), []
        for t, x in enumerate(xs):
            p, s = forms[steps[t % 4]](p, s, x)
            out.append(np.concatenate([np.asarray(v).ravel() for v in p.values()]))
        return np.stack(out)

    want = run(optax.MultiSteps(optax.adamw(1e-2), ts.K), "optax")
    lines = [
        "| form | first step whose params differ | params differing after "
        f"{windows} windows | largest difference |",
        "|---|---|---|---|",
    ]
    for form in ("drop-in", "fused", "emit="):
        got = run(optax_ext.MultiSteps(optax.adamw(1e-2), ts.K), form)
        differ = [t + 1 for t in range(len(xs)) if (got[t] != want[t]).any()]
        lines.append(
            f"| {form} | {differ[0] if differ else 'none'} "
            f"| {int((got[-1] != want[-1]).sum())} of {got.shape[1]} "
            f"| {float(np.abs(got[-1] - want[-1]).max()):.1e} |"
        )
    return lines


def optimizer_step_check():
    """Lines: the H200 model on the optimizer step alone (gradients passed
    in) of 8 leaves of (4096, 4096), float32, adamw, each form's time over
    the accumulate floor's: what an H200 timed at commit eb4e737 (optax
    2.96, fused mini-step 1.71, emitting step 3.95, window of 4 2.28;
    `gpu_estimate.md`). Run with that commit's optax_ext importable."""
    params = {
        f"w{i}": jax.ShapeDtypeStruct((4096, 4096), jnp.float32) for i in range(8)
    }

    def accumulate(p, s, g):
        acc, n = s
        fold = lambda a, x: a + (x - a) / (n + 1).astype(a.dtype)  # noqa: E731
        return p, (jax.tree.map(fold, acc, g), n + 1)

    ref = optax.MultiSteps(optax.adamw(1e-3, weight_decay=1e-2), 4)

    def drop_in(p, s, g):
        updates, s = ref.update(g, s, p)
        return optax.apply_updates(p, updates), s

    ext = optax_ext.MultiSteps(optax.adamw(1e-3, weight_decay=1e-2), 4)
    jobs = {
        "accumulate": (accumulate, (params, jax.ShapeDtypeStruct((), jnp.int32))),
        "optax": (drop_in, jax.eval_shape(ref.init, params)),
        "fused": (
            lambda p, s, g: optax_ext.apply_gradients(ext, g, s, p),
            jax.eval_shape(ext.init, params),
        ),
    }
    t = {}
    for name, (step, state) in jobs.items():
        text = compile_step("gpu", step, params, state, params).as_text()
        t[name] = [program_cost(text, "gpu", pick)[0] for pick in (min, max)]
    floor = t["accumulate"][0]
    window = (3 * t["fused"][0] + t["fused"][1]) / 4
    return [
        f"optax_ext from {pathlib.Path(optax_ext.__file__).parent}: over the "
        f"accumulate floor, optax {t['optax'][1] / floor:.2f}, fused mini-step "
        f"{t['fused'][0] / floor:.2f}, emitting step {t['fused'][1] / floor:.2f}, "
        f"window of 4 {window / floor:.2f}."
    ]


def _commit():
    return subprocess.run(
        ["git", "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
    ).stdout.strip()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--backends", nargs="+", default=["cpu", "gpu", "tpu"])
    parser.add_argument("--cases", choices=sorted(CASE_SETS), default="default")
    parser.add_argument("--estimate", action="store_true")
    parser.add_argument("--models", nargs="+", default=["mlp", "decoder"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--launch-us",
        type=float,
        help="with --estimate on the H200: each form's kernel launches too, "
        f"at this many us each (step_cost.LAUNCH_US: {step_cost.LAUNCH_US:g})",
    )
    parser.add_argument("--bits", action="store_true")
    parser.add_argument("--optimizer-step-check", action="store_true")
    parser.add_argument("--microbatched", action="store_true")
    parser.add_argument("--out")
    parser.add_argument("--append", action="store_true", help="append to --out")
    args = parser.parse_args()
    stamp = (
        f"Written by `benchmarks/whole_step.py`. jax {jax.__version__}, "
        f"optax {optax.__version__}, Python {platform.python_version()}; "
        f"optax_ext at commit {_commit()}. GPU: an H200 target, TPU: a v5e, "
        "compiled deviceless."
    )
    if args.microbatched:
        text = "\n".join(microbatched_lines(args, stamp)) + "\n"
        _write(text, args)
        return
    if args.optimizer_step_check:
        print("\n".join(optimizer_step_check()))
        return
    if args.bits:
        lines = [
            stamp + " XLA:CPU: where each form's params stop equalling "
            "optax.MultiSteps' bit for bit, in the same whole train step.",
            "",
            *bits(),
        ]
        args.backends = []
    elif args.estimate:
        lines = [
            stamp + " Estimated from the compile, not measured; every_k 4, "
            "adamw, optax_ext's forms accumulating in float32.",
            "",
        ]
    else:
        lines = [
            stamp + " The whole train step's temporary memory over the "
            "params' bytes, every_k 4.",
            "",
            "| backend | model | dtype | inner | " + " | ".join(COLUMNS) + " |",
            "|" + " --- |" * (4 + len(COLUMNS)),
        ]
    for backend, name in _available(args.backends):
        if args.estimate:
            for model in args.models:
                for dtype in args.dtypes:
                    print(f"{name}, {MODEL_NAMES[model]}, {dtype}:", file=sys.stderr)
                    lines += [f"### {name}, {MODEL_NAMES[model]}, {dtype}, adamw", ""]
                    lines += estimate(
                        backend, MODEL_NAMES[model], dtype, launch_us=args.launch_us
                    )
                    print("\n".join(lines[-12:]), flush=True)
            continue
        for model, dtype, inner, acc in CASE_SETS[args.cases]:
            cells = [
                f"{ratio(backend, model, dtype, inner, acc, f):.3f}" for f in COLUMNS
            ]
            if acc is None:
                inner += ", accumulator_dtype=None"
            if acc == "stochastic":
                inner += ", bfloat16 accumulator, stochastic_rounding=True"
            row = f"| {name} | {model} | {dtype} | {inner} | " + " | ".join(cells)
            lines.append(row + " |")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    _write(text, args)


def _write(text, args):
    if args.out and args.append:
        with pathlib.Path(args.out).open("a") as out:
            out.write("\n" + text)
    elif args.out:
        pathlib.Path(args.out).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
