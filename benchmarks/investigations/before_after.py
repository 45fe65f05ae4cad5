"""The mini-step's CPU time of two checkouts of optax_ext, interleaved:
`python benchmarks/investigations/before_after.py OLD_TREE NEW_TREE` runs
child processes that import optax_ext from each tree in turn (old, new,
new, old, ...), each timing the same steps, and writes each step's median
time per tree and their ratio (`results/before_after.md`).

The two packages cannot share one process, so a round is one child per
tree, back to back: a noisy machine slows both alike within a round.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

RESULTS = pathlib.Path(__file__).parents[1] / "results"


def _child(calls: int) -> dict[str, float]:
    """Seconds per call of each step, over `calls` consecutive calls."""
    import jax
    import jax.numpy as jnp
    import optax

    import optax_ext

    keys = jax.random.split(jax.random.key(0), 4)
    params = {f"w{i}": jax.random.normal(k, (1024, 1024)) for i, k in enumerate(keys)}
    grads = jax.tree.map(lambda p: 0.01 * p, params)
    steps = {}
    for name, kw in [("drop-in", {}), ("weighted", {"weighted": True})]:
        opt = optax_ext.MultiSteps(optax.adamw(1e-3), 4, **kw)
        extra = {"weight": jnp.float32(3.0)} if kw else {}

        def update(p, s, g, opt=opt, extra=extra):
            u, s = opt.update(g, s, p, **extra)
            return optax.apply_updates(p, u), s

        def fused(p, s, g, opt=opt, extra=extra):
            return optax_ext.apply_gradients(opt, g, s, p, **extra)

        steps[f"{name} update"] = (jax.jit(update, donate_argnums=(0, 1)), opt)
        steps[f"{name} apply_gradients"] = (jax.jit(fused, donate_argnums=(0, 1)), opt)
    out = {}
    for name, (step, opt) in steps.items():
        p = jax.tree.map(jnp.copy, params)
        s = opt.init(p)
        p, s = jax.block_until_ready(step(p, s, grads))  # compile
        start = time.perf_counter()
        for _ in range(calls):
            p, s = step(p, s, grads)
        jax.block_until_ready((p, s))
        out[name] = (time.perf_counter() - start) / calls
    return out


def _run(tree: str, calls: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, __file__, "--child", "--calls", str(calls)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _commit(tree: str) -> str:
    cmd = ["git", "-C", tree, "rev-parse", "--short", "HEAD"]
    return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--child", action="store_true")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS / "before_after.md"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_child(args.calls)))
        return
    old, new = args.trees
    times: dict[str, dict[str, list[float]]] = {old: {}, new: {}}
    for r in range(args.rounds):
        for tree in (old, new) if r % 2 == 0 else (new, old):
            for name, t in _run(tree, args.calls).items():
                times[tree].setdefault(name, []).append(t)
    lines = [
        "# The mini-step's CPU time, before and after",
        "",
        f"Written by `benchmarks/investigations/before_after.py`: {args.rounds} "
        f"rounds of {args.calls} calls, the trees alternated each round; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}. Four float32 leaves of "
        "(1024, 1024), adamw, every_k 4, params and state donated. Median "
        "milliseconds per mini-step (a window's mean, emitting one in four).",
        "",
        f"| step | before ({_commit(old)}) | after ({_commit(new)}) | after / before |",
        "| --- | --- | --- | --- |",
    ]
    for name in times[old]:
        a, b = (statistics.median(times[t][name]) * 1e3 for t in (old, new))
        lines.append(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.3f} |")
    text = "\n".join(lines) + "\n"
    pathlib.Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
