"""What the docs claim of the drop-in against `optax.MultiSteps` itself
(docs/multi_steps.md, "Against optax.MultiSteps"): the same gradients,
params and state, both `update`s jitted alike, compared on every step.

- The first window, through its first emitting step, is bit for bit for the
  aliases measured so; the others there are within the rounding bound of
  `assert_close_across_programs`.
- After it, the two programs fuse the inner optimizer apart (optax runs it
  on every step and selects, the drop-in under a conditional), so its state
  is rounded apart and carried. Emitted update t (t = 1, 2, ...) is then
  within `OPS[name] * t * eps * max|u|` of optax's, `max|u|` the largest
  entry of optax's update: each program is within `OPS * u_r` of the exact
  value per window relative to the update's scale (u_r = eps / 2 the unit
  roundoff, `OPS` the float32 roundings on one entry's path from the
  window's mean and the inner state), and the inner state carries earlier
  windows' roundings with a factor of at most 1 (b1, b2 < 1), so after t
  windows the two are within `2 * OPS * t * u_r`. No ulps: an entry near
  zero is thousands of its own ulps apart while the update is not.

Both sides are compiled with XLA's default options (`DEFAULT`): the level a
user's `jax.jit` gets, not the suite's -O0 (conftest.py), which fuses
differently (there Adam's updates are equal for 10 windows, adagrad's first
window is not). The reference is `optax.MultiSteps`, a second instance of
the inner optimizer, never optax_ext's output.
"""

from __future__ import annotations

import _aliases as A
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu
import pytest
from _helpers import across_programs_exact, cross_program_tolerance

import optax_ext

pytestmark = [
    pytest.mark.filterwarnings("ignore:Specifying a key will be required:UserWarning"),
]

K = 4  # mini-steps per window
WINDOWS = 10
EPS = float(jnp.finfo(jnp.float32).eps)
# XLA's default level, whatever XLA_FLAGS the suite sets (as in
# test_compile_options.py). Other backends compile with their defaults.
DEFAULT = (
    {"xla_backend_optimization_level": 3} if jax.default_backend() == "cpu" else None
)

# Float32 roundings on the path to one entry of the emitted update, per
# window, in optax 0.2.8's code (an FMA only drops one). sgd: the update is
# -lr * mean, one product of the same mean in both programs. adam: the
# first moment 3 (two products, a sum), the second 4 (a square more), each
# bias correction 4 (a power, a difference, a quotient; the power counted
# as 2), the ratio 4 (sqrt, two sums, a quotient), the learning rate 1.
# adamw: the decayed weight's product and sum more. lion: -lr * (sign(c) +
# wd * p), 3 besides the sign; the sign's argument c is checked apart.
OPS = {"sgd": 1, "adam": 20, "adamw": 22, "lion": 3}
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(1e-2),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
    "lion": lambda: optax.lion(1e-3),
}
LION_B1 = 0.9  # optax.lion's default: c = b1 * mu + (1 - b1) * mean

# A representative subset of A.NAMES for the first window (every alias
# takes 13 s of compiles at XLA's default level: over this file's budget):
# with OPTIMIZERS' four (their first window is in the drift test), states
# of every kind from test_aliases.py's NARROW (factored moments, a sign's
# momentum, scalar estimates, matrix iterations, low-rank projections,
# schedule-free iterates; not rprop, whose first update is zeros), and two
# measured apart there.
FIRST_WINDOW = ["adafactor", "galore", "muon", "novograd", "prodigy"]
FIRST_WINDOW += ["schedule_free_adamw", "sm3", "yogi"]
# Aliases whose first emitted update the two programs round apart at XLA's
# default level on XLA:CPU, measured over every alias with jax 0.10.2,
# 0.11.2 and 0.12.0.1 (optax 0.2.8); noisy_sgd with jax 0.12 only.
FIRST_WINDOW_APART = {
    "fromage",
    "madgrad",
    "muon",
    "noisy_sgd",
    "optimistic_adam",
    "optimistic_adam_v2",
    "scale_by_madgrad",
    "yogi",
}


def _jit(fn):
    return jax.jit(fn, compiler_options=DEFAULT) if DEFAULT else jax.jit(fn)


def _run(tx_ours, tx_theirs, params, grads):
    """Both `update`s on the same gradients, params and (each its own)
    state; the params move by optax's updates after each window. Returns
    per emitting step (ours, theirs, optax's inner state before it, the
    window's gradients)."""
    ours, theirs = optax_ext.MultiSteps(tx_ours, K), optax.MultiSteps(tx_theirs, K)
    update_ours, update_theirs = _jit(ours.update), _jit(theirs.update)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    emitted = []
    for t, g in enumerate(grads):
        inner_before = s_theirs.inner_opt_state
        u_ours, s_ours = update_ours(g, s_ours, params)
        u_theirs, s_theirs = update_theirs(g, s_theirs, params)
        if t % K == K - 1:
            window = grads[t - K + 1 : t + 1]
            emitted.append((u_ours, u_theirs, inner_before, window))
            params = optax.apply_updates(params, u_theirs)
        else:
            for leaf in jax.tree.leaves((u_ours, u_theirs)):
                assert not np.asarray(leaf).any(), f"non-zero update at step {t}"
    return emitted


def _flat(tree) -> np.ndarray:
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in leaves])


def _data(seed=0):
    """Params and K * WINDOWS gradients of three leaves, each mini-step's
    gradient at its own scale (1e-2 to 10), so a window's mean mixes
    magnitudes."""
    rng = np.random.default_rng(seed)
    shapes = {"b": (32,), "v": (32, 8), "w": (64, 32)}
    f32 = lambda x: jnp.asarray(x.astype(np.float32))
    params = {k: f32(rng.normal(size=s)) for k, s in shapes.items()}
    grads = []
    for _ in range(K * WINDOWS):
        scale = 10.0 ** rng.uniform(-2, 1)
        grads.append({k: f32(scale * rng.normal(size=s)) for k, s in shapes.items()})
    return params, grads


@pytest.mark.parametrize("name", FIRST_WINDOW)
def test_first_window_is_bit_for_bit(name):
    """Through the first emitting step both programs run the inner
    optimizer once, from its initial state, on the same mean: equal bit for
    bit (on XLA:CPU), except the aliases of FIRST_WINDOW_APART, which are
    held to the rounding bound of one optimizer step."""
    params, grads = A.params(jnp.float32), A.grads(K, jnp.float32)
    ((u_ours, u_theirs, *_),) = _run(A.make(name), A.make(name), params, grads)
    assert np.abs(_flat(u_theirs)).max() > 0, f"{name}: a first update of zeros"
    exact = across_programs_exact() and name not in FIRST_WINDOW_APART
    for (path, got), want in zip(
        jax.tree_util.tree_flatten_with_path(u_ours)[0],
        jax.tree.leaves(u_theirs),
        strict=True,
    ):
        where = f"{name} at {jax.tree_util.keystr(path)}"
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype and got.shape == want.shape, where
        if exact:
            np.testing.assert_array_equal(got, want, err_msg=where)
        else:
            bound = cross_program_tolerance(want, **A.cross_program(name, steps=1))
            err = np.abs(got.astype(np.float64) - want)
            assert (err <= bound).all(), (where, err.max(), bound.max())


def test_the_measured_exceptions_are_aliases():
    """A renamed alias would leave FIRST_WINDOW_APART unseen."""
    assert set(A.NAMES) >= FIRST_WINDOW_APART, sorted(FIRST_WINDOW_APART - set(A.NAMES))
    assert set(FIRST_WINDOW) <= set(A.NAMES)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_drift_is_within_the_rounding_bound(name):
    """Update t of the drop-in is within OPS * t * eps of optax's, relative
    to optax's largest entry; the first bit for bit (on XLA:CPU). sgd is bit
    for bit in every window: -lr * mean is one rounding of the same mean.
    lion: a sign whose argument is within its rounding of 0 may flip (a
    swing of 2 * lr); the bound holds at every other entry."""
    params, grads = _data()
    emitted = _run(OPTIMIZERS[name](), OPTIMIZERS[name](), params, grads)
    assert len(emitted) == WINDOWS
    for t, (u_ours, u_theirs, inner_before, window) in enumerate(emitted, 1):
        got, want = _flat(u_ours), _flat(u_theirs)
        scale = np.max(np.abs(want))
        assert np.isfinite(got).all() and scale > 0, (name, t)
        rel = np.max(np.abs(got - want)) / scale
        exact = across_programs_exact() and (t == 1 or name == "sgd")
        if exact:
            assert rel == 0, f"{name}, window {t}: {rel / EPS:.3g} eps apart"
            continue
        err = np.abs(got - want) / scale
        if name == "lion":  # where the sign may flip, by 2 * lr at most
            near = _sign_near_zero(inner_before, window, t)
            assert (err[near] <= 2 * 1e-3 / scale + OPS[name] * t * EPS).all()
            err = err[~near]
        assert err.max() <= OPS[name] * t * EPS, (
            f"{name}, window {t}: {err.max() / EPS:.3g} eps of max|u| apart, "
            f"bound {OPS[name]} * {t} eps"
        )


def _sign_near_zero(inner_before, window, t) -> np.ndarray:
    """Where lion's sign argument c = b1 * mu + (1 - b1) * mean (from
    optax's state) is within both programs' rounding of 0: 3 roundings a
    window (two products, a sum) of its terms' magnitude, mu carrying
    earlier windows' with a factor b2 < 1."""
    mu = _flat(otu.tree_get(inner_before, "mu"))
    mean = np.mean([_flat(g) for g in window], axis=0)
    terms = np.abs(LION_B1 * mu) + np.abs((1 - LION_B1) * mean)
    c = LION_B1 * mu + (1 - LION_B1) * mean
    return np.abs(c) <= 2 * 3 * t * EPS * terms.max()
