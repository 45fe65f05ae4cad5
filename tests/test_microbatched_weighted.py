"""`microbatched(grad_fn, k, weight_fn=...)`: a token-mean loss gives the
whole batch's token-mean loss and gradient; `per_example` outputs come back
whole; `num_real_microbatches` (traced) runs the first micro-batches only,
in one compilation. On one device and on 8 (the `multidevice` tests).

References are independent of optax_ext: the token-mean loss and gradient
of the whole batch (or of the real rows) computed directly, in float64 and
rounded once to float32 (`_tokens.py`).
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import hlo_computations, loop_computations
from _tokens import LENGTH, micro_batch, params32, token_mean_loss
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_ext

K = 4


def tokens_of(params, batch):
    del params
    return jnp.sum(batch["mask"])


def _batch(counts, rows=4, seed=0):
    """The batch whose micro-batch j (rows j, j + K, ...) holds counts[j]
    tokens."""
    parts = [micro_batch(seed + j, n, rows=rows) for j, n in enumerate(counts)]
    return {
        k: np.stack([p[k] for p in parts], axis=1).reshape(-1, LENGTH) for k in parts[0]
    }


def _whole64(fn, params, batch):
    """`fn(params, batch)` in float64, rounded once to float32."""
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda p: p.astype(jnp.float64), params)
        out = jax.jit(fn)(p64, {k: jnp.asarray(v) for k, v in batch.items()})
        return jax.tree.map(
            lambda v: (
                np.asarray(v, np.float32)
                if jnp.issubdtype(v.dtype, jnp.floating)
                else np.asarray(v)
            ),
            out,
        )


def _assert_close(got, want, rtol=1e-6):
    """rtol 1e-6 with a floor of 1e-6 of each leaf's largest entry."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype, (g.dtype, w.dtype)
        atol = rtol * float(np.max(np.abs(w), initial=0.0))
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def loss_aux(params, batch):
    """The token-mean loss, with an int count, a bool flag and a float aux."""
    loss = token_mean_loss(params, batch)
    aux = {
        "tokens": jnp.sum(batch["mask"]),
        "long_row": jnp.any(jnp.sum(batch["mask"], axis=1) == LENGTH),
        "loss": loss,
    }
    return loss, aux


# Uneven, and one all-padding micro-batch (its token-mean loss is 0 / 0).
COUNTS = [3, 27, 0, 11]


def test_token_mean_loss_and_gradient_are_the_whole_batch_s():
    params, batch = params32(), _batch(COUNTS)
    grad_fn = jax.value_and_grad(loss_aux, has_aux=True)
    (loss, aux), grads = jax.jit(
        optax_ext.microbatched(grad_fn, K, weight_fn=tokens_of)
    )(params, batch)
    (want_loss, want_aux), want_grads = _whole64(grad_fn, params, batch)
    _assert_close((loss, aux["loss"], grads), (want_loss, want_aux["loss"], want_grads))
    assert int(aux["tokens"]) == sum(COUNTS)  # integers: summed
    assert bool(aux["long_row"]) == bool(want_aux["long_row"])  # bools: any
    # The discrimination: the plain mean of the micro-batches' means is off
    # (and NaN here, from the all-padding micro-batch).
    plain = jax.jit(optax_ext.microbatched(jax.grad(token_mean_loss), K))(params, batch)
    assert not np.allclose(np.asarray(plain["out"]), want_grads["out"], rtol=1e-2)


@settings(max_examples=10)
@given(st.lists(st.integers(0, 32), min_size=K, max_size=K), st.integers(0, 2**16))
def test_random_token_counts_give_the_whole_batch_gradient(counts, seed):
    params, batch = params32(), _batch(counts, seed=seed)
    grad_fn = jax.value_and_grad(token_mean_loss)
    loss, grads = _jitted(grad_fn)(params, batch)
    if sum(counts) == 0:  # no token at all: zeros, as MultiSteps emits
        for leaf in jax.tree.leaves((loss, grads)):
            np.testing.assert_array_equal(leaf, np.zeros_like(leaf))
        return
    _assert_close((loss, grads), _whole64(grad_fn, params, batch))


_JITTED = {}


def _jitted(grad_fn):
    if "f" not in _JITTED:
        _JITTED["f"] = jax.jit(optax_ext.microbatched(grad_fn, K, weight_fn=tokens_of))
    return _JITTED["f"]


def per_example_grad_fn(params, batch):
    """Loss, gradient, and each row's token-mean loss (a row per example)."""

    def loss(params):
        rows = jax.vmap(lambda b: _row_loss(params, b))(batch)
        return token_mean_loss(params, batch), rows

    (value, rows), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return (value, rows), grads


def _row_loss(params, row):
    h = jnp.tanh(params["embed"][row["x"]])
    logp = jax.nn.log_softmax(h @ params["out"] + params["bias"])
    nll = -jnp.take_along_axis(logp, row["y"][:, None], axis=-1)[:, 0]
    m = row["mask"].astype(nll.dtype)
    return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1)


def test_per_example_outputs_come_back_whole_in_batch_order():
    params, batch = params32(), _batch([5, 9, 30, 14])
    fn = optax_ext.microbatched(
        per_example_grad_fn, K, weight_fn=tokens_of, per_example=((False, True), False)
    )
    (loss, rows), grads = jax.jit(fn)(params, batch)
    (want_loss, want_rows), want_grads = _whole64(per_example_grad_fn, params, batch)
    assert rows.shape == (batch["x"].shape[0],)
    _assert_close((loss, rows, grads), (want_loss, want_rows, want_grads))
    # Without weights too (the mean of the micro-batches' means, per_example
    # unchanged).
    plain = optax_ext.microbatched(
        per_example_grad_fn, K, per_example=((False, True), False)
    )
    (_, rows), _ = jax.jit(plain)(params, batch)
    _assert_close(rows, want_rows)


def test_num_real_microbatches_is_traced_one_compilation():
    """A ragged last batch: the first n micro-batches (rows with index mod K
    below n) hold data, the rest padding rows that are never computed; one
    compilation serves every n. Weighted: the token mean over the real rows;
    unweighted: the mean of the real micro-batches' means."""
    params, batch = params32(), _batch([6, 19, 12, 25])
    traces = []

    @jax.jit
    def step(params, batch, n):
        traces.append(None)
        fn = optax_ext.microbatched(
            jax.value_and_grad(token_mean_loss),
            K,
            weight_fn=tokens_of,
            num_real_microbatches=n,
        )
        return fn(params, batch)

    @jax.jit
    def plain_step(params, batch, n):
        fn = optax_ext.microbatched(
            jax.grad(token_mean_loss), K, num_real_microbatches=n
        )
        return fn(params, batch)

    for n in (1, 2, 3, 4):
        real = {k: v[np.arange(len(v)) % K < n] for k, v in batch.items()}
        got = step(params, batch, jnp.int32(n))
        _assert_close(got, _whole64(jax.value_and_grad(token_mean_loss), params, real))
        per_micro = [
            _whole64(
                jax.grad(token_mean_loss),
                params,
                {k: v[j::K] for k, v in batch.items()},
            )
            for j in range(n)
        ]
        want = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *per_micro)
        _assert_close(plain_step(params, batch, jnp.int32(n)), want, rtol=2e-6)
    assert len(traces) == 1


# --- errors -------------------------------------------------------------------


def test_bad_weight_fn_is_named():
    with pytest.raises(TypeError, match="weight_fn must be None or a function"):
        optax_ext.microbatched(jax.grad(token_mean_loss), K, weight_fn=3)
    fn = optax_ext.microbatched(
        jax.grad(token_mean_loss), K, weight_fn=lambda p, b: b["mask"].sum(axis=1)
    )
    with pytest.raises(TypeError, match=r"weight_fn must return a real scalar.*\(4,\)"):
        fn(params32(), _batch(COUNTS))


@pytest.mark.parametrize(
    "n, error, match",
    [(5, ValueError, "from 0 to num_microbatches=4, got 5"),
     (-1, ValueError, "got -1"),
     (2.0, TypeError, "int scalar"),
     (True, TypeError, "int scalar")],
)  # fmt: skip
def test_bad_num_real_microbatches_is_named(n, error, match):
    with pytest.raises(error, match=match):
        optax_ext.microbatched(jax.grad(token_mean_loss), K, num_real_microbatches=n)


def test_per_example_needs_rows():
    fn = optax_ext.microbatched(jax.grad(token_mean_loss), K, per_example=True)
    with pytest.raises(ValueError, match=r"per_example marks .*\['bias'\].*\(11,\)"):
        fn(params32(), _batch(COUNTS))


# --- 8 devices ------------------------------------------------------------------

DEVICE_COUNTS = [  # tokens of each micro-batch of each device's rows
    [3, 0, 16, 7], [0, 0, 0, 0], [12, 5, 1, 16], [9, 2, 0, 4],
    [16, 16, 3, 8], [1, 0, 0, 0], [6, 11, 2, 13], [0, 7, 9, 5],
]  # fmt: skip


def _device_batch():
    """8 devices' rows in order: device d holds rows 8d..8d+7, its
    micro-batch j the rows 8d + j, 8d + j + 4 (2 per micro-batch)."""
    parts = [_batch(c, rows=2, seed=10 * d) for d, c in enumerate(DEVICE_COUNTS)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _all_reduces_outside_and_inside_loops(hlo):
    comps = hlo_computations(hlo)
    loop = loop_computations(comps)
    outside, inside = [], []
    for name, lines in comps.items():
        for line in lines:
            match = re.search(r"= (\([^)]*\)|\S+) all-reduce(?:-start)?\(", line)
            if match:
                (inside if name in loop else outside).append(match.group(1))
    return outside, inside


@pytest.mark.multidevice
@pytest.mark.parametrize("mode", ["explicit", "auto", "shard_map"])
def test_devices_give_the_whole_batch_token_mean_in_one_all_reduce(mode):
    """Each device folds its own micro-batches by their tokens; one
    all-reduce after the loop carries the weighted gradients, the loss, the
    int and bool aux and the weights together; the result is the whole
    batch's (XLA:CPU's compiled HLO)."""
    params, batch = params32(), _device_batch()
    grad_fn = jax.value_and_grad(loss_aux, has_aux=True)
    axis = {"explicit": AxisType.Explicit}.get(mode, AxisType.Auto)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(axis,))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(
            {k: jnp.asarray(v) for k, v in batch.items()},
            NamedSharding(mesh, P("data")),
        )
        p = jax.device_put(params, NamedSharding(mesh, P()))
        if mode == "shard_map":
            inner = optax_ext.microbatched(
                grad_fn, K, weight_fn=tokens_of, axis_name="data"
            )
            fn = jax.shard_map(inner, in_specs=(P(), P("data")), out_specs=P())
        else:
            fn = optax_ext.microbatched(
                grad_fn,
                K,
                weight_fn=tokens_of,
                axis_name=None if mode == "explicit" else "data",
            )
        compiled = jax.jit(fn).lower(p, sharded).compile()
        (loss, aux), grads = compiled(p, sharded)
    (want_loss, want_aux), want_grads = _whole64(grad_fn, params, batch)
    _assert_close((loss, aux["loss"], grads), (want_loss, want_aux["loss"], want_grads))
    assert int(aux["tokens"]) == int(np.sum(DEVICE_COUNTS))
    assert bool(aux["long_row"]) == bool(want_aux["long_row"])
    outside, inside = _all_reduces_outside_and_inside_loops(compiled.as_text())
    assert inside == []
    # One all-reduce of every gradient leaf, the loss, its float aux and the
    # weight (f32), and one of the int and bool aux (s32: XLA reduces each
    # element type apart).
    floats = [r for r in outside if "f32[" in r]
    assert len(outside) == 2 and len(floats) == 1, outside
    assert len(re.findall(r"f32\[", floats[0])) == len(jax.tree.leaves(want_grads)) + 3
    assert (
        re.findall(r"\w+\[", [r for r in outside if r not in floats][0]) == ["s32["] * 2
    )


@pytest.mark.multidevice
def test_per_example_outputs_keep_each_device_s_rows():
    params, batch = params32(), _device_batch()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    fn = optax_ext.microbatched(
        per_example_grad_fn, K, weight_fn=tokens_of, per_example=((False, True), False)
    )
    with jax.set_mesh(mesh):
        sharded = jax.device_put(
            {k: jnp.asarray(v) for k, v in batch.items()},
            NamedSharding(mesh, P("data")),
        )
        (loss, rows), grads = jax.jit(fn)(params, sharded)
        assert rows.sharding.spec[0] == "data"
    (want_loss, want_rows), want_grads = _whole64(per_example_grad_fn, params, batch)
    _assert_close((loss, rows, grads), (want_loss, want_rows, want_grads))


def test_equinox_model_and_filter_grad():
    """An Equinox model through eqx.filter_value_and_grad (non-array leaves
    come back as they are)."""
    model = eqx.nn.Linear(LENGTH, 1, key=jax.random.key(0))

    def loss(model, batch):
        pred = jax.vmap(model)(batch["mask"].astype(jnp.float32))[:, 0]
        n = jnp.sum(batch["mask"], axis=1).astype(jnp.float32)
        return jnp.sum(n * (pred - 1.0) ** 2) / jnp.sum(n)

    batch = _batch(COUNTS)
    grad_fn = eqx.filter_value_and_grad(loss)
    got = eqx.filter_jit(optax_ext.microbatched(grad_fn, K, weight_fn=tokens_of))(
        model, batch
    )
    with jax.enable_x64(True):
        m64 = jax.tree.map(
            lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, model
        )
        want = grad_fn(m64, {k: jnp.asarray(v) for k, v in batch.items()})
        want = jax.tree.map(
            lambda x: np.asarray(x, np.float32), eqx.filter(want, eqx.is_array)
        )
    _assert_close(eqx.filter(got, eqx.is_array), want)


@pytest.mark.multidevice
def test_half_precision_outputs_reduce_weights_without_overflow():
    """float16 outputs accumulated in float16 (`accumulator_dtype=None`):
    each device's mean times its token count overflowed float16 in the
    all-reduce after the loop, and the loss came back NaN. Reference: the
    float64 token-weighted mean of the per-row values, rounded once."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    values = np.linspace(0.5, 1.5, 16)
    counts = np.full(16, 10000.0)

    def loss(scale, batch):
        return jnp.sum(scale * batch["v"] * batch["n"]) / jnp.sum(batch["n"])

    fn = optax_ext.microbatched(
        loss,
        2,
        axis_name="data",
        accumulator_dtype=None,
        weight_fn=lambda scale, batch: jnp.sum(batch["n"]),
    )
    batch = {"v": values.astype(np.float16), "n": counts.astype(np.float16)}
    with jax.set_mesh(mesh):
        got = jax.jit(fn)(
            jnp.float16(1.0),
            jax.device_put(
                {k: jnp.asarray(v) for k, v in batch.items()},
                NamedSharding(mesh, P("data")),
            ),
        )
    want = np.float16(np.mean(values.astype(np.float16).astype(np.float64)))
    assert got.dtype == jnp.float16
    np.testing.assert_allclose(np.float64(got), np.float64(want), rtol=2**-10)
