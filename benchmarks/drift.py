"""How far the drop-in's updates and params drift from `optax.MultiSteps`'
with float32 rounding, beside the noise of training itself.

    python benchmarks/drift.py [--out FILE]

- Per optimizer: both `update`s jitted at XLA's default level on the same
  gradients, params and state (`tests/test_drop_in_claims.py`'s run), the
  largest difference of each emitted update over its largest entry, in
  float32 eps, for 10 windows of 4.
- The whole train step: an MLP trained 10 windows of 4 with AdamW through
  each `MultiSteps`, and the control, `optax.MultiSteps` with one gradient
  1 ulp up (`jnp.nextafter`): the params' largest difference from Optax's.

Writes `benchmarks/results/drift.md` (the README and docs/multi_steps.md
quote it).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
import test_drop_in_claims as claims  # noqa: E402

import optax_ext  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
WIDTH = 256  # the MLP: 16 -> 256 -> 256 -> 256 -> 1, 136k params


def update_drift() -> dict[str, list[float]]:
    """Per optimizer, each emitted update's drift relative to its scale, in eps."""
    params, grads = claims._data()
    drift = {}
    for name, make in claims.OPTIMIZERS.items():
        emitted = claims._run(make(), make(), params, grads)
        drift[name] = []
        for ours, theirs, _, _ in emitted:
            a, b = claims._flat(ours), claims._flat(theirs)
            drift[name].append(
                float(np.abs(a - b).max() / np.abs(b).max() / claims.EPS)
            )
    return drift


def _train(opt, params, xs, nudge_at=-1):
    def loss(p, x):
        h = x
        for i, (w, b) in enumerate(p):
            h = h @ w + b
            h = jax.nn.gelu(h) if i < len(p) - 1 else h
        return jnp.mean((h[..., 0] - jnp.sin(x.sum(-1))) ** 2)

    @claims._jit
    def step(p, state, x, nudge):
        g = jax.grad(loss)(p, x)
        g = jax.tree.map(lambda g: jnp.where(nudge, jnp.nextafter(g, jnp.inf), g), g)
        updates, state = opt.update(g, state, p)
        return optax.apply_updates(p, updates), state

    state = opt.init(params)
    for t, x in enumerate(xs):
        params, state = step(params, state, x, t == nudge_at)
    return params


def params_drift() -> tuple[int, float, float]:
    """(params, drop-in against optax, optax against its 1-ulp control)."""
    keys = jax.random.split(jax.random.key(0), 5)
    sizes = [16, WIDTH, WIDTH, WIDTH, 1]
    params = [
        (jax.random.normal(k, (a, b)) / np.sqrt(a), jnp.zeros(b))
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=False)
    ]
    xs = jax.random.normal(keys[-1], (claims.K * claims.WINDOWS, 32, 16))
    make = lambda: optax.adamw(1e-3)  # noqa: E731
    theirs = _train(optax.MultiSteps(make(), claims.K), params, xs)
    ours = _train(optax_ext.MultiSteps(make(), claims.K), params, xs)
    control = _train(optax.MultiSteps(make(), claims.K), params, xs, nudge_at=0)
    diff = lambda a, b: max(  # noqa: E731
        float(jnp.abs(x - y).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    size = sum(x.size for x in jax.tree.leaves(params))
    return size, diff(ours, theirs), diff(control, theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS / "drift.md")
    args = parser.parse_args()
    drift = update_drift()
    size, ours, control = params_drift()
    lines = [
        "# The drop-in against optax.MultiSteps: rounding drift",
        "",
        f"Written by `benchmarks/drift.py`. jax {jax.__version__}, optax "
        f"{optax.__version__}, XLA:CPU at XLA's default level, float32.",
        "",
        "## Each emitted update, relative to its largest entry",
        "",
        "max |ours - optax's| / max |optax's|, in float32 eps, per window "
        f"(10 windows of {claims.K}); the tested bound at window t is "
        "n * t eps (`tests/test_drop_in_claims.py`).",
        "",
        "| optimizer | n | largest, eps | largest, relative | per window, eps |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, values in drift.items():
        per = " ".join(f"{v:.2f}" for v in values)
        top = max(values)
        row = f"| {name} | {claims.OPS[name]} | {top:.2f} | {top * claims.EPS:.2g} |"
        lines.append(f"{row} {per} |")
    lines += [
        "",
        "## The params after training",
        "",
        f"An MLP of {size} params, AdamW (1e-3), {claims.WINDOWS} windows of "
        f"{claims.K}: the params' largest difference from optax.MultiSteps'.",
        "",
        "| run | largest difference |",
        "| --- | --- |",
        f"| optax_ext.MultiSteps | {ours:.2e} |",
        f"| optax.MultiSteps, one gradient 1 ulp up (the control) | {control:.2e} |",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
