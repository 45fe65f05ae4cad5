"""`MultiSteps(..., noise_scale=True)` and `optax_ext.gradient_noise_scale`:
the unbiased estimates of |G|^2 and tr(Sigma) of McCandlish et al. (2018,
appendix A) from each window.

References are independent of optax_ext: the estimator's closed form in
float64 NumPy over the window's micro-batch gradients (and weights), and,
for unbiasedness, the true |G|^2 and tr(Sigma) of synthetic gradients
`g_i = G + noise` with a known covariance.
"""

import copy
import pathlib
import pickle
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_ext

D = 40


def reference(grads, weights=None):
    """The two estimates from one window, in float64: `n` gradients `g_i`
    of weights `w_i`, `W = sum w`, `S = sum w |g|^2`, `G_W = sum w g / W`;
    `tr = (S - W |G_W|^2) / (n - 1)`, `|G|^2 = |G_W|^2 - tr / W`."""
    g = np.asarray(grads, np.float64)
    w = np.ones(len(g)) if weights is None else np.asarray(weights, np.float64)
    g, w = g[w > 0], w[w > 0]
    big = (w[:, None] * g).sum(0) / w.sum()
    s = (w * (g**2).sum(1)).sum()
    trace = (s - w.sum() * (big**2).sum()) / (len(g) - 1)
    return (big**2).sum() - trace / w.sum(), trace


def _window(rng, k, weighted):
    grads = rng.normal(size=(k, D)).astype(np.float32)
    weights = rng.integers(0, 4, size=k).astype(np.float32) if weighted else None
    if weighted:
        weights[0] = 3.0  # a window that holds something
    return grads, weights


def _run(opt, state, grads, weights, form, params):
    """One window of `grads` through `form`; the state after it."""
    for i, g in enumerate(grads):
        kw = {} if weights is None else {"weight": weights[i]}
        if form == "update":
            _, state = jax.jit(opt.update)(jnp.asarray(g), state, params, **kw)
        else:
            emit = None if form == "apply" else i == len(grads) - 1
            params, state = optax_ext.apply_gradients(
                opt, jnp.asarray(g), state, params, emit=emit, **kw
            )
    return state, params


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
@pytest.mark.parametrize("form", ["update", "apply", "emit"])
def test_estimates_are_the_closed_form_of_each_window(weighted, mean, form):
    rng = np.random.default_rng(0)
    k = 5
    opt = optax_ext.MultiSteps(
        optax.sgd(0.1), k, use_grad_mean=mean, weighted=weighted, noise_scale=True
    )
    params = jnp.zeros(D)
    state = opt.init(params)
    for _ in range(2):  # the second window's estimates are its own
        grads, weights = _window(rng, k, weighted)
        state, params = _run(opt, state, grads, weights, form, params)
        got = np.array(optax_ext.gradient_noise_scale(state))
        np.testing.assert_allclose(got, reference(grads, weights), rtol=2e-5, atol=1e-4)


def test_a_window_held_open_uses_every_micro_batch():
    """`emit=False` holds the window past `k`: all its gradients count."""
    rng = np.random.default_rng(1)
    opt = optax_ext.MultiSteps(optax.sgd(0.1), 2, noise_scale=True)
    params = jnp.zeros(D)
    state = opt.init(params)
    grads = rng.normal(size=(5, D)).astype(np.float32)
    state, params = _run(opt, state, grads, None, "emit", params)
    got = np.array(optax_ext.gradient_noise_scale(state))
    np.testing.assert_allclose(got, reference(grads), rtol=2e-5, atol=1e-4)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_estimates_are_unbiased_over_many_windows(weighted):
    """g_i = G + e_i, cov(e_i) = sigma^2 I / w_i: the mean estimate over
    many windows is |G|^2 and tr(Sigma) = D sigma^2 (per unit of weight),
    within 5 standard errors of the estimates' own spread."""
    rng = np.random.default_rng(2)
    k, windows, sigma = 4, 600, 0.5
    true_g = rng.normal(size=D).astype(np.float32) * 0.3
    opt = optax_ext.MultiSteps(optax.sgd(0.1), k, weighted=weighted, noise_scale=True)
    state = opt.init(jnp.zeros(D))
    step = jax.jit(opt.update)
    estimates = []
    for _ in range(windows):
        for _ in range(k):
            w = float(rng.integers(1, 6)) if weighted else 1.0
            noise = rng.normal(size=D) * sigma / np.sqrt(w)
            kw = {"weight": w} if weighted else {}
            _, state = step(jnp.asarray(true_g + noise, jnp.float32), state, **kw)
        estimates.append(np.array(optax_ext.gradient_noise_scale(state)))
    estimates = np.array(estimates, np.float64)
    truth = np.array([(true_g.astype(np.float64) ** 2).sum(), D * sigma**2])
    sem = estimates.std(0) / np.sqrt(windows)
    assert np.all(np.abs(estimates.mean(0) - truth) < 5 * sem), (
        estimates.mean(0),
        truth,
        sem,
    )


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply"])
def test_devices_estimate_over_all_their_micro_batches(weighted, mean, fused):
    """With `axis_name` (4 devices under `jax.vmap`), the small batch is
    one device's micro-batch and the big batch the window over all."""
    rng = np.random.default_rng(3)
    n, k = 4, 3
    opt = optax_ext.MultiSteps(
        optax.sgd(0.1),
        k,
        use_grad_mean=mean,
        axis_name="d",
        weighted=weighted,
        noise_scale=True,
    )
    params = jnp.zeros((n, D))
    grads = rng.normal(size=(k, n, D)).astype(np.float32)
    weights = rng.integers(0, 4, size=(k, n)).astype(np.float32)
    weights[0, 0] = 2.0

    def step(g, state, params, w):
        kw = {"weight": w} if weighted else {}
        if fused:
            params, state = optax_ext.apply_gradients(opt, g, state, params, **kw)
            return state, params
        return opt.update(g, state, params, **kw)[1], params

    run = jax.jit(jax.vmap(step, axis_name="d"))
    state = jax.jit(jax.vmap(opt.init, axis_name="d"))(params)
    for i in range(k):
        state, params = run(jnp.asarray(grads[i]), state, params, weights[i])
    got = np.array(optax_ext.gradient_noise_scale(state))
    flat_w = weights.reshape(-1) if weighted else None
    want = reference(grads.reshape(k * n, D), flat_w)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)


def test_updates_are_those_of_the_plain_accumulation():
    rng = np.random.default_rng(4)
    grads = rng.normal(size=(6, D)).astype(np.float32)
    outs = []
    for noise in (False, True):
        opt = optax_ext.MultiSteps(optax.adam(1e-2), 3, noise_scale=noise)
        state = opt.init(jnp.zeros(D))
        for g in grads:
            u, state = jax.jit(opt.update)(jnp.asarray(g), state)
            outs.append(np.asarray(u))
    np.testing.assert_array_equal(np.array(outs[:6]), np.array(outs[6:]))


def test_nan_before_a_window_of_two():
    opt = optax_ext.MultiSteps(optax.sgd(0.1), 1, noise_scale=True)
    state = opt.init(jnp.zeros(3))
    assert np.all(np.isnan(optax_ext.gradient_noise_scale(state)))
    _, state = opt.update(jnp.ones(3), state)
    assert np.all(np.isnan(optax_ext.gradient_noise_scale(state)))


def test_state_survives_a_checkpoint_round_trip():
    opt = optax_ext.MultiSteps(optax.sgd(0.1), 2, noise_scale=True)
    state = opt.init(jnp.zeros(3))
    for g in (jnp.ones(3), -jnp.ones(3), 2 * jnp.ones(3)):
        _, state = opt.update(g, state)
    leaves, treedef = jax.tree.flatten(state)
    restored = jax.tree.unflatten(treedef, [np.asarray(x) for x in leaves])
    assert type(restored) is type(state)
    assert restored._fields[-1] == "noise_scale"
    _, a = opt.update(jnp.ones(3), state)
    _, b = opt.update(jnp.ones(3), restored)
    np.testing.assert_array_equal(
        optax_ext.gradient_noise_scale(a), optax_ext.gradient_noise_scale(b)
    )


def test_state_pickles():
    """A noise-scale state, its type built at run time, pickles (weighted
    too) and loads in a fresh process that has not built the type; it
    deep-copies."""
    states = []
    for weighted in (False, True):
        opt = optax_ext.MultiSteps(
            optax.sgd(0.1), 2, weighted=weighted, noise_scale=True
        )
        extra = {"weight": 2.0} if weighted else {}
        states.append(opt.update(jnp.ones(3), opt.init(jnp.zeros(3)), **extra)[1])
    for state in states:
        for restored in (pickle.loads(pickle.dumps(state)), copy.deepcopy(state)):
            assert type(restored) is type(state)
            for got, kept in zip(
                jax.tree.leaves(restored), jax.tree.leaves(state), strict=True
            ):
                np.testing.assert_array_equal(got, kept)  # NaN estimates equal too
    code = (
        "import pickle, sys\n"
        "from optax_ext._accumulate.accumulations import state_type\n"
        "assert state_type.cache_info().currsize == 0  # no type built yet\n"
        "states = pickle.loads(sys.stdin.buffer.read())\n"
        "assert all(type(s) is state_type(s._fields[5:]) for s in states)\n"
        "print(repr([(s._fields[5:], s.noise_scale.count.tolist()) for s in states]))\n"
    )
    root = pathlib.Path(optax_ext.__file__).parent.parent
    run = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(states),
        capture_output=True,
        cwd=root,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr.decode()[-4000:]
    fields = [("noise_scale",), ("acc_weight", "noise_scale")]
    assert run.stdout.decode().strip() == repr([(f, 1.0) for f in fields])


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="noise_scale must be True or False, got"):
        optax_ext.MultiSteps(optax.sgd(0.1), 2, noise_scale=1)
    plain = optax_ext.MultiSteps(optax.sgd(0.1), 2)
    with pytest.raises(TypeError, match=r"gradient_noise_scale needs the state"):
        optax_ext.gradient_noise_scale(plain.init(jnp.zeros(3)))
    noisy = optax_ext.MultiSteps(optax.sgd(0.1), 2, noise_scale=True)
    with pytest.raises(TypeError, match=r"MultiSteps.update's `state` has no noise"):
        noisy.update(jnp.ones(3), plain.init(jnp.zeros(3)))


def test_optax_state_drops_the_estimates_and_optax_goes_on():
    """`optax_state` gives optax's five fields; optax.MultiSteps then
    emits what this one emits."""
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 2, noise_scale=True)
    state = opt.init(jnp.zeros(3))
    for g in (jnp.ones(3), 3 * jnp.ones(3)):
        _, state = opt.update(g, state)
    theirs = opt.optax_state(state)
    assert type(theirs) is optax.MultiStepsState
    optax_opt = optax.MultiSteps(optax.sgd(1.0), 2)
    for g in (jnp.ones(3), 2 * jnp.ones(3)):
        mine, state = opt.update(g, state)
        want, theirs = optax_opt.update(g, theirs)
    np.testing.assert_array_equal(mine, want)
