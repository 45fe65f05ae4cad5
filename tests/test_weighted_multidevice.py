"""MultiSteps(weighted=True) on 8 CPU devices: with `axis_name` each device
accumulates its own tokens' gradients and the window emits the gradient of
the mean over every device's tokens, in one all-reduce per window that
carries the weights; with params sharded under `jit` (no `axis_name`) the
same equality holds.

The reference is independent of optax_ext: the token-mean gradient of the
window's whole batch (every device's micro-batches concatenated) computed
directly on one device in float64 and rounded once to float32
(`_tokens.py`), and plain optax applied to it.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import hlo_computations
from _tokens import concat, grad, micro_batch, params32, sum_grad, tokens
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_ext

pytestmark = pytest.mark.multidevice

N = 8
K = 3
ROWS = 2  # sequences per device per micro-batch
# Tokens of each device (columns) in each micro-batch (rows) of 3 windows:
# uneven; device 5 holds no token in the first window; the second window's
# first micro-batch is all padding everywhere; the last window holds none.
TOKENS = np.array(
    [
        [3, 16, 9, 1, 12, 0, 7, 5],
        [10, 2, 16, 6, 0, 0, 4, 11],
        [1, 8, 5, 16, 3, 0, 9, 2],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [7, 0, 12, 3, 16, 1, 5, 2],
        [2, 9, 0, 14, 6, 8, 1, 13],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
    ]
)
INNERS = {
    "sgd": lambda: optax.sgd(0.5),
    "adam": lambda: optax.adam(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
}


def _batches():
    """batches[step][device]: each device's own micro-batch."""
    return [
        [micro_batch(1000 * s + d, int(n), rows=ROWS) for d, n in enumerate(row)]
        for s, row in enumerate(TOKENS)
    ]


def _reference(make_inner, params, batches, window_grad=grad):
    inner = make_inner()
    state = inner.init(params)
    update = jax.jit(inner.update)
    for w in range(len(batches) // K):
        window = concat([b for step in batches[K * w : K * w + K] for b in step])
        if tokens(window) == 0:
            continue
        updates, state = update(window_grad(params, window), state, params)
        params = optax.apply_updates(params, updates)
    return params


def _assert_close(got, want):
    """rtol 1e-6 with a floor of 1e-6 of the leaf's largest entry."""
    for name in want:
        b = np.asarray(want[name])
        atol = 1e-6 * float(np.max(np.abs(b)))
        np.testing.assert_allclose(np.asarray(got[name]), b, rtol=1e-6, atol=atol)


def _mesh():
    return jax.make_mesh((N,), ("data",))


def _sharded_step(opt, fused):
    mesh = _mesh()
    specs = opt.state_specs()

    @jax.jit
    @jax.shard_map(
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data")),
        out_specs=(P(), specs),
    )
    def step(params, state, grads, weight):
        # This device's own gradient and token count (leading axis of 1).
        grads = jax.tree.map(lambda g: g[0], grads)
        if fused:
            return optax_ext.apply_gradients(
                opt, grads, state, params, weight=weight[0]
            )
        updates, state = opt.update(grads, state, params, weight=weight[0])
        return optax.apply_updates(params, updates), state

    return step


def _train(opt, params, batches, fused):
    mesh = _mesh()
    step = _sharded_step(opt, fused)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        init = jax.shard_map(
            opt.init, mesh=mesh, in_specs=P(), out_specs=opt.state_specs()
        )
        state = jax.jit(init)(params)
        split = NamedSharding(mesh, P("data"))
        for per_device in batches:
            local = jax.device_get(params)
            grads = [grad(local, b) for b in per_device]
            stacked = jax.tree.map(lambda *g: np.stack(g), *grads)
            weights = np.array([tokens(b) for b in per_device], np.int32)
            params, state = step(
                params,
                state,
                jax.device_put(stacked, split),
                jax.device_put(weights, split),
            )
    return jax.device_get(params), state


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("inner", INNERS)
def test_devices_emit_the_mean_over_all_their_tokens(inner, form):
    params = params32()
    batches = _batches()
    opt = optax_ext.MultiSteps(INNERS[inner](), K, axis_name="data", weighted=True)
    got, state = _train(opt, params, batches, fused=form == "apply_gradients")
    _assert_close(got, _reference(INNERS[inner], params, batches))
    # The last window holds no token: it applied nothing.
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
    assert np.all(np.asarray(state.acc_weight) == 0)


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_devices_emit_the_sum_over_all_their_tokens(form):
    """`use_grad_mean=False`: the window applies the inner optimizer to the
    gradient of the token-summed loss over every device's micro-batches."""
    params = params32()
    batches = _batches()
    opt = optax_ext.MultiSteps(
        optax.sgd(1e-2), K, axis_name="data", weighted=True, use_grad_mean=False
    )
    got, state = _train(opt, params, batches, fused=form == "apply_gradients")
    want = _reference(lambda: optax.sgd(1e-2), params, batches, sum_grad)
    _assert_close(got, want)
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0


def test_unweighted_devices_miss_the_big_batch():
    """The data discriminate: without weights the same run is far off."""
    params = params32()
    batches = _batches()[:K]
    opt = optax_ext.MultiSteps(optax.sgd(0.5), K, axis_name="data")
    mesh = _mesh()
    specs = opt.state_specs()

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("data")), out_specs=(P(), specs))
    def step(params, state, grads):
        grads = jax.tree.map(lambda g: jnp.nan_to_num(g[0]), grads)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        init = jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs)
        state = jax.jit(init)(p)
        for per_device in batches:
            grads = jax.tree.map(
                lambda *g: np.stack(g), *[grad(params, b) for b in per_device]
            )
            p, state = step(
                p, state, jax.device_put(grads, NamedSharding(mesh, P("data")))
            )
    want = _reference(INNERS["sgd"], params, batches)
    delta = np.asarray(jax.device_get(p)["out"]) - np.asarray(params["out"])
    want_delta = np.asarray(want["out"]) - np.asarray(params["out"])
    gap = np.linalg.norm(delta - want_delta) / np.linalg.norm(want_delta)
    assert gap > 0.05


def _branches(hlo):
    comps = hlo_computations(hlo)
    (cond,) = [line for line in comps["ENTRY"] if " conditional(" in line]
    no_emit, emit = re.search(
        r"branch_computations=\{%([^,}]+), %([^,}]+)\}", cond
    ).groups()
    return "\n".join(comps["ENTRY"]), "\n".join(comps[emit]), "\n".join(comps[no_emit])


def _all_reduces(text):
    return re.findall(r"= (\([^)]*\)|\S+) all-reduce(?:-start)?\(", text)


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_one_all_reduce_per_window_carries_the_weights(form):
    """XLA:CPU's compiled step: a mini-step has no collective; the emitting
    branch has one all-reduce, of every gradient leaf and the f32[] weight
    together."""
    params = params32()
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, axis_name="data", weighted=True)
    step = _sharded_step(opt, form == "apply_gradients")
    mesh = _mesh()
    with jax.set_mesh(mesh):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        init = jax.shard_map(
            opt.init, mesh=mesh, in_specs=P(), out_specs=opt.state_specs()
        )
        state = jax.jit(init)(p)
        split = NamedSharding(mesh, P("data"))
        grads = jax.device_put(
            jax.tree.map(lambda x: np.zeros((N, *x.shape), np.float32), params), split
        )
        weights = jax.device_put(np.ones(N, np.int32), split)
        hlo = step.lower(p, state, grads, weights).compile().as_text()
    entry, emit, no_emit = _branches(hlo)
    assert _all_reduces(entry) == []
    assert _all_reduces(no_emit) == []
    (reduced,) = _all_reduces(emit)
    shapes = sorted(re.findall(r"f32\[[\d,]*\]", reduced))
    want = [f"f32[{','.join(map(str, p.shape))}]" for p in params.values()]
    assert shapes == sorted([*want, "f32[]"])


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_params_sharded_under_jit_equal_the_big_batch(form):
    """Without `axis_name`: params (and the state mirroring them) sharded over
    the 8 devices, each mini-step's gradient the whole micro-batch's, its
    weight the micro-batch's token count."""
    params = params32()
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    specs = {"embed": P(None, "x"), "out": P("x", None), "bias": P()}
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, weighted=True)
    # One micro-batch per step: every device's rows of the table above.
    batches = [concat(step) for step in _batches()]

    @jax.jit
    def step(params, state, grads, weight):
        if form == "apply_gradients":
            return optax_ext.apply_gradients(opt, grads, state, params, weight=weight)
        updates, state = opt.update(grads, state, params, weight=weight)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        shard = {k: NamedSharding(mesh, s) for k, s in specs.items()}
        p = jax.device_put(params, shard)
        state = jax.jit(opt.init)(p)
        for batch in batches:
            g = jax.device_put(grad(jax.device_get(p), batch), shard)
            p, state = step(p, state, g, tokens(batch))
        for name, leaf in p.items():
            assert leaf.sharding.is_equivalent_to(shard[name], leaf.ndim), name
    want = _reference(INNERS["adam"], params, [[b] for b in batches])
    _assert_close(jax.device_get(p), want)


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_half_precision_accumulators_reduce_weights_without_overflow(form):
    """float16 accumulators (`accumulator_dtype=None`, float16 params): each
    device's mean times its token count overflowed float16 (65504) in the
    window's all-reduce, emitting zeros or NaN silently; one device got it
    right. Reference: the float64 token-weighted mean of the per-device
    gradients, times the learning rate, rounded once to float16."""
    mesh = _mesh()
    opt = optax_ext.MultiSteps(
        optax.sgd(1.0), 1, weighted=True, axis_name="data", accumulator_dtype=None
    )
    step = _sharded_step(opt, form == "apply_gradients")
    per_device = np.array([10.0, 10.0, 1e-3, 3.0, 10.0, 0.5, 2.0, 10.0])
    weights = np.array([8192, 10000, 9000, 0, 12000, 7000, 8192, 10000], np.int32)
    params = {"w": jnp.zeros((2,), jnp.float16)}
    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        state = jax.jit(
            jax.shard_map(
                opt.init, mesh=mesh, in_specs=P(), out_specs=opt.state_specs()
            )
        )(params)
        grads = {"w": np.repeat(per_device[:, None], 2, axis=1).astype(np.float16)}
        split = NamedSharding(mesh, P("data"))
        new, _ = step(
            params,
            state,
            jax.device_put(grads, split),
            jax.device_put(weights, split),
        )
    g16 = per_device.astype(np.float16).astype(np.float64)
    want = -np.sum(g16 * weights) / np.sum(weights)
    got = np.asarray(jax.device_get(new)["w"])
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, np.full(2, np.float16(want)))
