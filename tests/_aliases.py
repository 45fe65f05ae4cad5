"""Discovery of the optax aliases that run without extra arguments, and small
helpers for `test_aliases.py` (independent of optax_ext's code).

An alias is a function of `optax` or `optax.contrib` with a `learning_rate`
parameter whose optimizer, built with `learning_rate=1e-2` when that parameter
has no default, inits and updates a small params dict without extra keyword
arguments (no `value=`, no `obj_fn`, ...). Discovery only traces
(`jax.eval_shape`), so it is cheap and deterministic: every pytest-xdist
worker collects the same list.
"""

from __future__ import annotations

import inspect
import os
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from _helpers import across_programs_exact, cross_program_tolerance

LEARNING_RATE = 1e-2
SHAPES = {"b": (3,), "w": (4, 3)}  # a 2-D leaf for muon and galore


def needs_learning_rate(name: str) -> bool:
    """Whether the alias's `learning_rate` has no default (so `make(name)`
    gives it 1e-2)."""
    return _needs_learning_rate(ALIASES[name])


def _needs_learning_rate(factory: Callable) -> bool:
    param = inspect.signature(factory).parameters["learning_rate"]
    return param.default is inspect.Parameter.empty


def _probe(factory: Callable) -> bool:
    kwargs = {"learning_rate": LEARNING_RATE} if _needs_learning_rate(factory) else {}
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    try:
        opt = factory(**kwargs)

        def step(params):
            state = opt.init(params)
            return opt.update(params, state, params)

        jax.eval_shape(step, params)
    except Exception:  # noqa: BLE001 - "needs extra arguments" takes many forms
        return False
    return True


def _discover() -> dict[str, Callable]:
    found: dict[str, Callable] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for prefix, module in (("", optax), ("contrib.", optax.contrib)):
            for name in sorted(dir(module)):
                if name.startswith("_"):
                    continue
                factory = getattr(module, name)
                if not inspect.isfunction(factory):
                    continue
                try:
                    signature = inspect.signature(factory)
                except (TypeError, ValueError):
                    continue
                if "learning_rate" not in signature.parameters:
                    continue
                if _probe(factory):
                    key = name if name not in found else prefix + name
                    found[key] = factory
    return dict(sorted(found.items()))


ALIASES: dict[str, Callable] = _discover()
NAMES: list[str] = list(ALIASES)


def make(name: str, learning_rate=None) -> optax.GradientTransformation:
    """A fresh optimizer: the alias with its defaults, `learning_rate=1e-2` if
    it has no default, or `learning_rate` if given."""
    factory = ALIASES[name]
    if learning_rate is not None:
        return factory(learning_rate=learning_rate)
    if _needs_learning_rate(factory):
        return factory(learning_rate=LEARNING_RATE)
    return factory()


# --------------------------------------------------------------------------
# Compilation
#
# Nearly all of this suite's time is XLA compiling small programs (one
# `update` per case). On CPU, the legacy elemental emitters at LLVM -O0
# compile about 3x faster than the defaults. They change code generation only
# (no fast-math either way), not what JAX traces: dtypes, weak types, shapes,
# `lax.cond` and the arithmetic performed are the same. optax_ext and the
# references are compiled alike. Set COMPILER_OPTIONS = None to test with
# XLA's defaults.


def _fast_compile_options() -> dict | None:
    options = {
        "xla_cpu_use_fusion_emitters": False,
        "xla_backend_optimization_level": 0,
    }
    if jax.default_backend() != "cpu":
        return None
    try:  # an XLA that does not know these options rejects them
        jax.jit(lambda x: x + 1, compiler_options=options).lower(1.0).compile()
    except Exception:  # noqa: BLE001
        return None
    return options


COMPILER_OPTIONS = _fast_compile_options()


def jit(fn: Callable) -> Callable:
    """`jax.jit(fn)`, compiled with COMPILER_OPTIONS."""
    if COMPILER_OPTIONS is None:
        return jax.jit(fn)
    return jax.jit(fn, compiler_options=COMPILER_OPTIONS)


# --------------------------------------------------------------------------
# Data


def params(dtype, seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        k: jnp.asarray(rng.normal(size=s).astype(np.float32), dtype)
        for k, s in SHAPES.items()
    }


def grads(n: int, dtype, seed: int = 1) -> list[dict[str, jax.Array]]:
    """`n` distinct random gradients in `dtype` (float16-safe magnitudes)."""
    rng = np.random.default_rng(seed)
    return [
        {
            k: jnp.asarray(rng.normal(size=s).astype(np.float32), dtype)
            for k, s in SHAPES.items()
        }
        for _ in range(n)
    ]


def f32(x) -> np.ndarray:
    """A numpy float32 copy of an array of any float dtype (bfloat16 included)."""
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def window_reduce(window, dtype, mean: bool = True) -> dict[str, jax.Array]:
    """Mean (or sum) of a list of gradient dicts, by hand in numpy float32,
    cast to `dtype`. NaN and inf propagate as in plain arithmetic."""
    out = {}
    for k in window[0]:
        stacked = np.stack([f32(g[k]) for g in window])
        with np.errstate(invalid="ignore", over="ignore"):
            red = stacked.mean(axis=0) if mean else stacked.sum(axis=0)
        out[k] = jnp.asarray(red.astype(np.float32)).astype(dtype)
    return out


# --------------------------------------------------------------------------
# Assertions


def leaf_avals(tree) -> list[tuple[str, tuple, str, bool]]:
    """(path, shape, dtype, weak_type) of every leaf; typed PRNG keys compare
    by their key dtype."""
    return [
        (
            jax.tree_util.keystr(path),
            tuple(jnp.shape(x)),
            str(jnp.asarray(x).dtype) if not hasattr(x, "dtype") else str(x.dtype),
            bool(getattr(x, "weak_type", False)),
        )
        for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def assert_same_avals(tree, like, what: str) -> None:
    assert jax.tree.structure(tree) == jax.tree.structure(like), (
        f"{what}: tree structure changed: {jax.tree.structure(tree)} vs "
        f"{jax.tree.structure(like)}"
    )
    got, want = leaf_avals(tree), leaf_avals(like)
    diffs = [(g, w) for g, w in zip(got, want, strict=True) if g != w]
    assert not diffs, f"{what}: leaves changed (got, want): {diffs}"


def assert_exact_zeros(updates, like, what: str) -> None:
    """Every leaf is exactly zero (no NaN) with the dtype of `like`'s leaf."""
    for (path, u), ref in zip(
        jax.tree_util.tree_flatten_with_path(updates)[0],
        jax.tree.leaves(like),
        strict=True,
    ):
        where = f"{what} at {jax.tree_util.keystr(path)}"
        assert u.dtype == ref.dtype, f"{where}: dtype {u.dtype}, want {ref.dtype}"
        x = f32(u)
        assert not np.isnan(x).any(), f"{where}: NaN in {x}"
        assert np.array_equal(x, np.zeros_like(x)), f"{where}: not zeros: {x}"


# Per-dtype tolerance in units in the last place of the reference value:
# |got - want| <= ULPS * ulp(want) + FLOOR, elementwise (no scale borrowed from
# the leaf's largest entry, so a small entry's error is not hidden; this was
# 2e-2 of the leaf's largest magnitude for bfloat16 and 5e-3 for float16).
# float16 and bfloat16 match bit for bit (optax 0.2.8, jax 0.10.2, every
# alias, MultiSteps and inject_hyperparams): the window's mean is computed in
# float32 by both and rounded once. float32: at most 2 ulps beyond FLOOR over
# every alias (MultiSteps keeps a running mean, the reference a sum divided
# by k, and the optimizer carries the difference on); a caller may pass a
# wider bound for a named alias, with the measurement.
ULPS = {
    jnp.dtype(jnp.float32): 4,
    jnp.dtype(jnp.float16): 0,
    jnp.dtype(jnp.bfloat16): 0,
}
# Some aliases (madgrad, schedule_free_*) return updates computed as a
# difference of two param-sized values (`new_params - params`, params ~ 1):
# those carry an absolute error of an ulp of 1 whenever the arithmetic is
# reordered (a traced hyperparameter instead of a Python constant). 8 float32
# ulps of 1 is still 1e-4 of a 1e-2 update.
FLOOR = {
    jnp.dtype(jnp.float32): 8 * float(jnp.finfo(jnp.float32).eps),
    jnp.dtype(jnp.float16): 0.0,
    jnp.dtype(jnp.bfloat16): 0.0,
}


def ulp(x, dtype) -> np.ndarray:
    """The spacing of `dtype` at |x|, elementwise, in float64 (subnormal
    spacing below the smallest normal)."""
    info = jnp.finfo(dtype)
    ax = np.maximum(np.abs(np.asarray(x, np.float64)), float(info.smallest_normal))
    return np.exp2(np.floor(np.log2(ax)) - info.nmant)


# -- float16 and bfloat16 on other backends than XLA:CPU ----------------------
# There ULPS's 0 is replaced by `_helpers.cross_program_tolerance`:
# `steps * ops_per_step(name)` rounding steps of the dtype at the leaf's
# largest |want| (or at PARAMS_MAGNITUDE, below). Rounding steps on the path
# to one entry, per optimizer step (an elementwise op is one; a sum or norm
# over a leaf of k <= 12 entries is k - 1; the window's mean is one more):
# 64 covers the elementwise aliases (adam's update is about 20) and those
# that take a norm or a dot over a leaf (lamb, lars, fromage, novograd,
# galore, the distance-based dog, dowg, prodigy, dadapt_adamw, cocob);
# muon's Newton-Schulz iterations (5 of four 3- and 4-long dots) take 128.
# A sign() whose argument is within a rounding of 0 can flip (a swing of
# twice the update): the sign-based aliases count 2 / eps(bfloat16) = 256
# steps per step, so on those backends they are checked for dtype, shape,
# non-finite entries and gross errors only.
_OPS_PER_STEP = {"muon": 128} | {
    n: 256 for n in ("lion", "sign_sgd", "signum", "rprop", "scale_by_rprop")
}
# Aliases whose updates are a difference of two params-sized values
# (`new_params - params`, see FLOOR): their rounding is at the params'
# magnitude (|params| < 4 for the standard normal draws of `params`).
_PARAMS_MAGNITUDE = {
    "madgrad",
    "scale_by_madgrad",
    "schedule_free_adamw",
    "schedule_free_sgd",
}


def cross_program(name: str, steps: int) -> dict:
    """`assert_close`'s arguments for `steps` optimizer steps of alias
    `name` compared between two programs."""
    return {
        "ops": steps * _OPS_PER_STEP.get(name, 64),
        "magnitude": 4.0 if name in _PARAMS_MAGNITUDE else None,
    }


def assert_close(
    got,
    want,
    what: str,
    ulps: dict | None = None,
    ops: int | None = None,
    magnitude: float | None = None,
) -> None:
    """`got` equals `want` within ULPS (or `ulps`, by dtype) plus FLOOR; for
    float16 and bfloat16 off XLA:CPU, within `cross_program_tolerance` of
    `ops` rounding steps (at `magnitude`) when `ops` is given."""
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        where = f"{what} at {jax.tree_util.keystr(path)}"
        assert g.dtype == w.dtype, f"{where}: dtype {g.dtype}, want {w.dtype}"
        assert g.shape == w.shape, f"{where}: shape {g.shape}, want {w.shape}"
        gx, wx = f32(g), f32(w)
        finite = np.isfinite(wx)
        assert np.array_equal(gx[~finite], wx[~finite], equal_nan=True) and (
            np.isfinite(gx[finite]).all()
        ), f"{where}: non-finite entries differ\ngot  {gx}\nwant {wx}"
        if not finite.any():
            continue
        dtype = jnp.dtype(w.dtype)
        gf, wf = gx[finite], wx[finite]
        err = np.abs(gf.astype(np.float64) - wf.astype(np.float64))
        units = ulp(wf, dtype)
        log = os.environ.get("ALIASES_ULP_LOG")
        if log:  # measure instead of assert: how ULPS was chosen
            test = os.environ.get("PYTEST_CURRENT_TEST")
            ulps_beyond_floor = np.max((err - FLOOR[dtype]) / units)
            with open(log, "a") as f:
                f.write(f"{dtype} {ulps_beyond_floor:.3f} {test}\n")
            continue
        allowed = (ulps or ULPS).get(dtype, ULPS[dtype])
        bound = allowed * units + FLOOR[dtype]
        half = dtype in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
        if half and ops is not None and not across_programs_exact():
            bound = cross_program_tolerance(w, ops=ops, magnitude=magnitude)[finite]
            allowed = f"{ops} rounding steps:"
        assert (err <= bound).all(), (
            f"{where}: max error {np.max(err / units):.3g} ulps (allowed "
            f"{allowed} + floor {FLOOR[dtype]:.3g})\n"
            f"got  {gx}\nwant {wx}"
        )
