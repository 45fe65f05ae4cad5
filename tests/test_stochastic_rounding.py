"""`MultiSteps(..., accumulator_dtype=jnp.bfloat16, stochastic_rounding=True)`:
each fold rounds its float32 result to the bfloat16 accumulator up or down
with the probabilities that make the rounding's mean the float32 value.

References are independent of optax_ext: the window's mean in float64
NumPy. Unbiasedness is checked over many leaf entries: the mean of the
errors is within 5 standard errors (of the errors' own spread) of 0, where
rounding to nearest, on the same gradients, is many of them off.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_ext

N = 4096  # entries of each leaf
K = 16
ULP = 2.0**-7  # bfloat16's at 1.0


def _drift(rng, dtype):
    """A window whose first gradient is 1 and whose later ones are 1 + ulp
    half the time: rounding to nearest never leaves 1 (each fold moves the
    mean by half an ulp or less), the mean is near 1 + ulp / 2. float32
    gradients get a float32 jitter of 1e-3 more."""
    up = rng.random((K, N)) < 0.5
    up[0] = False
    g = 1.0 + ULP * up
    if dtype == jnp.float32:
        g = g + 1e-3 * rng.standard_normal((K, N))
    return np.asarray(jnp.asarray(g, dtype))


def _weights(rng):
    return rng.integers(0, 5, size=K).astype(np.float32)


def _window(opt, grads, weights, form, dtype):
    """One window of `grads` (`{"a": ..., "b": ...}` per mini-step) through
    `form`; the params `sgd(-1)` moved from 0, i.e. the window's mean."""
    params = {"a": jnp.zeros(N, dtype), "b": jnp.zeros(N, dtype)}
    state = opt.init(params)
    update = jax.jit(opt.update)
    apply = jax.jit(optax_ext.apply_gradients, static_argnums=0, static_argnames="emit")
    for i, g in enumerate(grads):
        kw = {} if weights is None else {"weight": weights[i]}
        if form == "update":
            updates, state = update(g, state, params, **kw)
            params = optax.apply_updates(params, updates)
        else:
            emit = None if form == "apply_gradients" else bool(i == len(grads) - 1)
            params, state = apply(opt, g, state, params, emit=emit, **kw)
    return params, state


def _errors(got, grads, weights):
    """Each entry's error against the float64 (weighted) mean."""
    g = np.stack([[np.asarray(x[n], np.float64) for n in "ab"] for x in grads])
    w = np.ones(K) if weights is None else np.asarray(weights, np.float64)
    want = np.tensordot(w, g, 1) / w.sum()
    return np.stack([np.asarray(got[n], np.float64) for n in "ab"]) - want


def _bias(errors):
    """The mean error and 5 standard errors of it."""
    e = errors.ravel()
    return e.mean(), 5 * e.std() / np.sqrt(e.size)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("form", ["update", "apply_gradients", "emit"])
def test_window_mean_is_unbiased(form, weighted, dtype):
    rng = np.random.default_rng(0)
    grads = [
        {"a": a, "b": b}
        for a, b in zip(_drift(rng, dtype), _drift(rng, dtype), strict=True)
    ]
    weights = _weights(rng) if weighted else None
    if weighted:
        weights[0] = 3.0
    opt = optax_ext.MultiSteps(
        optax.sgd(-1.0),
        K,
        accumulator_dtype=jnp.bfloat16,
        weighted=weighted,
        stochastic_rounding=True,
    )
    params, state = _window(opt, grads, weights, form, dtype)
    assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(state.acc_grads))
    bias, bound = _bias(_errors(params, grads, weights))
    assert abs(bias) < bound, (bias, bound)
    if dtype == jnp.bfloat16:  # rounding to nearest, the same gradients
        nearest = optax_ext.MultiSteps(
            optax.sgd(-1.0), K, accumulator_dtype=jnp.bfloat16, weighted=weighted
        )
        params, _ = _window(nearest, grads, weights, form, dtype)
        assert _bias(_errors(params, grads, weights))[0] < -10 * bound


def test_float32_gradients_keep_a_bfloat16_accumulator_and_optax_state():
    """No params-sized state besides the bfloat16 accumulator: the state is
    `optax.MultiStepsState` with optax's state's leaves."""
    params = {"w": jnp.zeros((3, 5)), "b": jnp.zeros(5)}
    opt = optax_ext.MultiSteps(
        optax.adam(1e-3), 4, accumulator_dtype=jnp.bfloat16, stochastic_rounding=True
    )
    state = opt.init(params)
    theirs = optax.MultiSteps(optax.adam(1e-3), 4).init(params)
    assert type(state) is optax.MultiStepsState
    assert jax.tree.structure(state) == jax.tree.structure(theirs)
    assert {a.dtype for a in jax.tree.leaves(state.acc_grads)} == {
        jnp.dtype(jnp.bfloat16)
    }
    # Rounding to nearest keeps the widening rule: float32.
    nearest = optax_ext.MultiSteps(optax.adam(1e-3), 4, accumulator_dtype=jnp.bfloat16)
    assert {a.dtype for a in jax.tree.leaves(nearest.init(params).acc_grads)} == {
        jnp.dtype(jnp.float32)
    }


def _run(opt, grads, state=None, start=0):
    params = jnp.zeros(N)
    state = opt.init(params) if state is None else state
    update = jax.jit(opt.update)
    states = []
    for g in grads[start:]:
        _, state = update(g, state, params)
        states.append(state)
    return states


def test_rounding_is_reproducible_and_resumes_from_a_checkpoint():
    rng = np.random.default_rng(1)
    grads = list(jnp.asarray(1 + 1e-3 * rng.standard_normal((6, N)), jnp.float32))
    make = lambda: optax_ext.MultiSteps(  # noqa: E731
        optax.sgd(1.0), 4, accumulator_dtype=jnp.bfloat16, stochastic_rounding=True
    )
    first, again = _run(make(), grads), _run(make(), grads)
    saved = jax.tree.map(np.asarray, first[2])  # mid-window, as on disk
    resumed = _run(make(), grads, saved, start=3)
    for a, b in zip(first, again, strict=True):
        assert jax.tree.all(jax.tree.map(np.array_equal, a, b))
    for a, b in zip(first[3:], resumed, strict=True):
        assert jax.tree.all(jax.tree.map(np.array_equal, a, b))


def test_rounding_differs_per_leaf_and_per_window():
    """Equal gradients in two leaves, and in windows one after another,
    round differently: each entry rounds up with probability 1/3, so two
    roundings differ in about 4/9 of the entries."""
    g = jnp.full(N, 1.0 + ULP / 3, jnp.float32)
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), 1, accumulator_dtype=jnp.bfloat16, stochastic_rounding=True
    )
    params = {"a": jnp.zeros(N), "b": jnp.zeros(N)}
    state, step = opt.init(params), jax.jit(opt.update)
    accs = []
    for _ in range(3):
        _, state = step({"a": g, "b": g}, state)
        accs.append({n: np.asarray(state.acc_grads[n], np.float32) for n in "ab"})
    for acc in accs:
        assert abs(np.mean(acc["a"] > 1) - 1 / 3) < 0.05
        assert abs(np.mean(acc["a"] != acc["b"]) - 4 / 9) < 0.05
    for one, two in zip(accs, accs[1:], strict=False):
        assert abs(np.mean(one["a"] != two["a"]) - 4 / 9) < 0.05


@pytest.mark.multidevice
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_devices_round_differently_and_their_mean_is_unbiased(weighted):
    """8 devices, each its own `_drift` window (device 0's the same as
    device 1's): their accumulators differ, and the emitted mean over
    every device is unbiased against the float64 mean of all."""
    n = 8
    mesh = jax.make_mesh((n,), ("data",))
    rng = np.random.default_rng(2)
    grads = np.stack([_drift(rng, jnp.float32) for _ in range(n)], 1)  # (K, n, N)
    grads[:, 1] = grads[:, 0]
    weights = np.stack([_weights(rng) for _ in range(n)], 1) + 1.0
    opt = optax_ext.MultiSteps(
        optax.sgd(-1.0),
        K,
        accumulator_dtype=jnp.bfloat16,
        axis_name="data",
        weighted=weighted,
        stochastic_rounding=True,
    )
    specs = opt.state_specs()

    @jax.jit
    @jax.shard_map(
        mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=(P(), specs)
    )
    def step(params, state, g, w):
        kw = {"weight": w[0]} if weighted else {}
        return optax_ext.apply_gradients(opt, g[0], state, params, **kw)

    split = NamedSharding(mesh, P("data"))
    with jax.set_mesh(mesh):
        params = jax.device_put(jnp.zeros(N), NamedSharding(mesh, P()))
        init = jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs)
        state = jax.jit(init)(params)
        for i in range(K):
            if i == K - 1:
                acc = np.asarray(state.acc_grads, np.float32)
                assert np.mean(acc[0] != acc[1]) > 0.2
            g, w = (jax.device_put(x[i], split) for x in (grads, weights))
            params, state = step(params, state, g, w)
    w = weights if weighted else np.ones_like(weights)
    want = np.einsum("kd,kdn->n", w, grads.astype(np.float64)) / w.sum()
    bias, bound = _bias(np.asarray(params, np.float64) - want)
    assert abs(bias) < bound, (bias, bound)


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="stochastic_rounding must be True or False"):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, stochastic_rounding=1)
    with pytest.raises(
        ValueError,
        match=r"needs accumulator_dtype=jnp.bfloat16, got "
        r"accumulator_dtype=float32",
    ):
        optax_ext.MultiSteps(optax.sgd(1.0), 2, stochastic_rounding=True)
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), 2, accumulator_dtype=jnp.bfloat16, stochastic_rounding=True
    )
    with pytest.raises(TypeError, match=r"at \['z'\] have dtype complex64"):
        opt.init({"z": jnp.zeros(3, jnp.complex64)})
