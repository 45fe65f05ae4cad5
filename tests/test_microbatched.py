"""`microbatched` on one device: the whole batch's gradients, values and aux
(against a float64 whole-batch reference), the optimizer step `MultiSteps`
takes on the same micro-batches, one compiled loop, memory of a micro-batch,
and errors that name what was wrong."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import assert_close_across_programs, xla_cpu_only

import optax_ext

COMPILED = xla_cpu_only("memory analysis of the compiled step")

K = 4
N = 32


def _data(key=0, n=N, dtype=jnp.float32):
    kx, ky = jax.random.split(jax.random.key(key))
    x = jax.random.normal(kx, (n, 3), dtype)
    y = jax.random.normal(ky, (n,), dtype)
    return x, y


def _params(dtype=jnp.float32):
    kw, kv = jax.random.split(jax.random.key(1))
    return {
        "w": jax.random.normal(kw, (3, 8), dtype),
        "b": jnp.zeros((8,), dtype),
        "v": jax.random.normal(kv, (8,), dtype),
    }


def loss(params, batch):
    x, y = batch
    pred = jnp.tanh(x @ params["w"] + params["b"]) @ params["v"]
    return jnp.mean((pred - y) ** 2)


def loss_aux(params, batch):
    x, y = batch
    pred = jnp.tanh(x @ params["w"] + params["b"]) @ params["v"]
    aux = {
        "mean_pred": jnp.mean(pred),
        "positives": jnp.sum(pred > 0),
        "any_big": jnp.any(jnp.abs(pred - y) > 2.5),
    }
    return jnp.mean((pred - y) ** 2), aux


def _mlp():
    return eqx.nn.MLP(3, 1, 8, 2, key=jax.random.key(2))


def eqx_loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x)[:, 0] - y) ** 2)


def eqx_loss_aux(model, batch):
    x, y = batch
    pred = jax.vmap(model)(x)[:, 0]
    return jnp.mean((pred - y) ** 2), {"mean_pred": jnp.mean(pred)}


GRAD_FNS = {  # name: (grad_fn, model factory, jit)
    "grad": (jax.grad(loss), _params, jax.jit),
    "value_and_grad_aux": (
        jax.value_and_grad(loss_aux, has_aux=True),
        _params,
        jax.jit,
    ),
    "filter_grad": (eqx.filter_grad(eqx_loss), _mlp, eqx.filter_jit),
    "filter_value_and_grad_aux": (
        eqx.filter_value_and_grad(eqx_loss_aux, has_aux=True),
        _mlp,
        eqx.filter_jit,
    ),
}


def _close(got, want):
    """float32 against a float64 reference: a few float32 roundings of the
    leaf's largest entry (sums of terms that cancel lose relative accuracy)."""
    want = np.asarray(want)
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6 * scale)


def _f64(tree):
    return jax.tree.map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, tree
    )


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("name", GRAD_FNS)
def test_matches_whole_batch_in_float64(name, jit):
    """Gradients, loss and float aux are the whole batch's (float64 reference
    of grad_fn on the whole batch), integer aux the count over the batch, bool
    aux `any`; every output keeps grad_fn's dtype; `None` gradients of an
    Equinox model stay `None`."""
    grad_fn, make, jitter = GRAD_FNS[name]
    model, batch = make(), _data()
    fn = optax_ext.microbatched(grad_fn, K)
    got = (jitter(fn) if jit else fn)(model, batch)
    with jax.enable_x64(True):
        want = grad_fn(_f64(model), _f64(batch))
        want_leaves = [np.asarray(x) for x in jax.tree.leaves(want)]
    got_leaves = jax.tree.leaves(got)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if w.dtype == np.float64:
            assert g.dtype == jnp.float32
            _close(g, w)
        else:
            assert g.dtype == w.dtype or (w.dtype == np.int64 and g.dtype == jnp.int32)
            np.testing.assert_array_equal(np.asarray(g), w)
    if name.startswith("filter"):
        grads = got[1] if isinstance(got, tuple) else got
        assert grads.activation is None


def test_axis_name_of_a_vmap_averages_over_it():
    """Under `jax.vmap(..., axis_name=)` (as under `shard_map`, one device
    standing in for each mapped row) `microbatched(axis_name=)` averages
    the rows' means: the whole batch's gradient (float64 reference). It
    failed inside JAX: "pvary should be called under jax.shard_map"."""
    params, (x, y) = _params(), _data()
    per_row = optax_ext.microbatched(jax.grad(loss), 2, axis_name="rows")
    rows = (x.reshape(4, N // 4, 3), y.reshape(4, N // 4))
    got = jax.jit(jax.vmap(lambda b: per_row(params, b), axis_name="rows"))(rows)
    with jax.enable_x64(True):
        want = jax.grad(loss)(_f64(params), _f64((x, y)))
    for name in params:
        for row in got[name]:
            _close(row, want[name])


def loss_python_scale(params, batch):
    """`loss` times a Python float param: its gradient is weakly typed."""
    return loss(params, batch) * params["scale"]


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_weakly_typed_outputs_stay_weak(jit, weighted):
    """The gradient of a Python-float leaf is weakly typed; microbatched
    returned it strongly typed, so a jitted step fed its result compiled once
    more than for grad_fn's own. Reference: grad_fn on the whole batch in
    float64 (values), and its own output types at float32."""
    params, batch = {**_params(), "scale": 1.5}, _data()
    grad_fn = jax.value_and_grad(loss_python_scale)
    weight_fn = (lambda p, b: jnp.float32(b[0].shape[0])) if weighted else None
    fn = optax_ext.microbatched(grad_fn, K, weight_fn=weight_fn)
    got = (jax.jit(fn) if jit else fn)(params, batch)
    plain = grad_fn(params, batch)
    assert plain[1]["scale"].weak_type  # what the test is about
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(plain), strict=True):
        assert (g.dtype, g.weak_type) == (w.dtype, w.weak_type)
    with jax.enable_x64(True):
        want = grad_fn(_f64({**params, "scale": 1.5}), _f64(batch))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        _close(g, w)
    traces = []

    @jax.jit
    def step(out):
        traces.append(None)
        return jax.tree.map(lambda x: x * 2, out)

    step(plain)
    step(got)
    assert len(traces) == 1


def loss_int_param(params, batch):
    """`loss` with an integer param (a step counter, say) that scales it."""
    return loss(params, batch) * params["n"]


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_float0_gradients_come_back_as_jax_grad_gives_them(jit):
    """Issue 26: the float0 gradient that `jax.grad(..., allow_int=True)`
    gives an integer param was refused; it comes back as jax.grad on the
    whole batch gives it (a NumPy array of the same dtype and shape; eagerly
    jax.grad's is of a private subclass), the float gradients are the whole
    batch's."""
    params = {**_params(), "n": jnp.int32(3)}
    batch = _data()
    grad_fn = jax.grad(loss_int_param, allow_int=True)
    fn = optax_ext.microbatched(grad_fn, K)
    got = (jax.jit(fn) if jit else fn)(params, batch)
    want = (jax.jit(grad_fn) if jit else grad_fn)(params, batch)
    assert isinstance(got["n"], np.ndarray) and isinstance(want["n"], np.ndarray)
    assert (want["n"].dtype, want["n"].shape) == (jax.dtypes.float0, ())
    assert (got["n"].dtype, got["n"].shape) == (jax.dtypes.float0, ())
    with jax.enable_x64(True):
        want64 = jax.grad(loss_int_param, allow_int=True)(_f64(params), _f64(batch))
    for name in ("w", "b", "v"):
        _close(got[name], want64[name])


def masked_loss_rows(params, batch):
    """A masked mean over the batch's rows (`batch[2]` the mask, integer:
    not differentiated), and each row's own squared error (a per-example
    value) as aux."""
    x, y, mask = batch
    pred = jnp.tanh(x @ params["w"] + params["b"]) @ params["v"]
    rows = (pred - y) ** 2
    mask = mask.astype(rows.dtype)
    return jnp.sum(mask * rows) / jnp.sum(mask), rows


def _masked_batch(mask):
    x, y = _data()
    return x, y, jnp.asarray(mask, jnp.int32)


def _micro_rows(n):
    """The rows micro-batches 0 .. n-1 hold: index mod K below n."""
    return (np.arange(N) % K) < n


# Micro-batch j holds rows j, j + K, ...: mask counts 8, 3, 0, 5 per
# micro-batch (weights that differ, and one micro-batch of weight 0).
MASK = np.stack([np.arange(N // K) < c for c in (8, 3, 0, 5)], axis=1).reshape(N)


@pytest.mark.parametrize("case", ["mean", "real_microbatches", "weighted"])
def test_gradient_with_respect_to_the_batch_is_the_whole_batch_s(case):
    """`jax.grad(loss, argnums=(0, 1))`: the gradient with respect to the
    batch came back `k` times the whole batch's (`W / w_j` times with
    `weight_fn`) under `per_example=True`, since each micro-batch's mean
    weighs its rows by `k / N`. Marked `"gradient"`, the rows are scaled by
    their micro-batch's share; per-example values marked `True` come back as
    they are. Reference: grad_fn on the whole batch (or its real rows) in
    float64."""
    weighted = case == "weighted"
    mask = MASK if weighted else np.ones(N)
    params, batch = _params(), _masked_batch(mask)
    grad_fn = jax.value_and_grad(
        masked_loss_rows, argnums=(0, 1), has_aux=True, allow_int=True
    )
    n = 2 if case == "real_microbatches" else K
    fn = optax_ext.microbatched(
        grad_fn,
        K,
        per_example=((False, True), (False, "gradient")),
        weight_fn=(lambda p, b: jnp.sum(b[2])) if weighted else None,
        num_real_microbatches=jnp.int32(n) if n < K else None,
    )
    (value, rows), (grads, batch_grads) = jax.jit(fn)(params, batch)
    real = _micro_rows(n)
    with jax.enable_x64(True):
        whole = jax.tree.map(lambda a: a[real], _f64(batch))
        (want_value, want_rows), (want_grads, want_real) = grad_fn(_f64(params), whole)
    want_batch_grads = []
    for g in want_real[:2]:  # x and y; the integer mask's is float0
        full = np.zeros((N, *g.shape[1:]))
        full[real] = g
        want_batch_grads.append(full)
    _close(value, want_value)
    assert batch_grads[2].dtype == jax.dtypes.float0
    for g, w in zip(
        jax.tree.leaves((grads, batch_grads[:2])),
        jax.tree.leaves((want_grads, want_batch_grads)),
        strict=True,
    ):
        assert g.dtype == jnp.float32
        _close(g, w)
    _close(rows[real], want_rows)
    np.testing.assert_array_equal(np.asarray(rows[~real]), 0.0)


def test_per_example_marks_are_checked():
    with pytest.raises(TypeError, match=r"per_example must be .*'gradient'.*'rows'"):
        optax_ext.microbatched(jax.grad(loss), K, per_example=(False, "rows"))

    def with_signs(params, batch):  # an integer output with a row per example
        return jax.grad(loss)(params, batch), (batch[0][:, 0] > 0).astype(jnp.int32)

    fn = optax_ext.microbatched(with_signs, K, per_example=(False, "gradient"))
    with pytest.raises(TypeError, match=r"\[1\] as 'gradient'.*int32"):
        fn(_params(), _data())


def test_integer_and_bool_aux_combine_over_the_whole_batch():
    """Counts are summed and flags `any`-ed over micro-batches: a flag raised
    by one micro-batch only is raised for the batch."""
    params, (x, y) = _params(), _data()
    y = y.at[5].set(100.0)  # only micro-batch 5 % K sees it
    (_, aux), _ = optax_ext.microbatched(jax.value_and_grad(loss_aux, has_aux=True), K)(
        params, (x, y)
    )
    pred = np.asarray(jnp.tanh(x @ params["w"] + params["b"]) @ params["v"])
    assert int(aux["positives"]) == int((pred > 0).sum())
    assert bool(aux["any_big"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_gradients_accumulate_in_float32(dtype):
    """bfloat16/float16 gradients come back in their dtype, within one
    rounding of the float64 mean of the micro-batches' gradients."""
    k = 16
    params, batch = _params(dtype), _data(n=16 * k, dtype=dtype)
    grad_fn = jax.grad(loss)
    got = jax.jit(optax_ext.microbatched(grad_fn, k))(params, batch)
    # grad_fn on each micro-batch (its own half-precision arithmetic), then
    # their mean in float64. Jitted, as in the loop: eagerly each operation
    # rounds to the half dtype, where XLA computes a fusion in float32 (or
    # natively, on CPUs with avx512_fp16), an ulp or more apart.
    micro = [
        jax.jit(grad_fn)(params, jax.tree.map(lambda a, j=j: a[j::k], batch))
        for j in range(k)
    ]
    mean = jax.tree.map(
        lambda *g: np.mean([np.asarray(x, np.float64) for x in g], axis=0), *micro
    )
    for name in params:
        assert got[name].dtype == jnp.dtype(dtype)
        ulp = np.abs(np.asarray(jnp.asarray(mean[name], dtype), np.float64)) * float(
            jnp.finfo(dtype).eps
        )
        err = np.abs(np.asarray(got[name], np.float64) - mean[name])
        assert (err <= ulp + 1e-30).all(), (name, err.max())


def test_grad_fn_traced_at_most_twice_in_one_loop():
    """`grad_fn` is traced twice (output shapes, loop body), the loop is a
    `while` in the compiled step, not k copies of grad_fn."""
    traces = []

    def counted(params, batch):
        traces.append(1)
        return jax.grad(loss)(params, batch)

    params, batch = _params(), _data()
    fn = jax.jit(optax_ext.microbatched(counted, 8))
    hlo = fn.lower(params, batch).as_text()
    assert len(traces) <= 2
    one = jax.jit(jax.grad(loss)).lower(params, batch).as_text()
    dots = lambda text: len(re.findall(r"stablehlo\.dot_general", text))  # noqa: E731
    assert dots(hlo) == dots(one)
    assert "stablehlo.while" in hlo


def test_key_is_split_per_microbatch():
    """Micro-batch j gets `split(key, k)[j]`: the gradient equals the mean of
    grad_fn on each micro-batch with its key (float64), and differs from
    using one key for all of them."""

    def dropout_loss(params, batch, key):
        x, y = batch
        h = jnp.tanh(x @ params["w"] + params["b"])
        # float32 draws: under x64 `bernoulli` would draw other masks.
        keep = jax.random.uniform(key, h.shape, jnp.float32) < 0.5
        pred = jnp.where(keep, h / 0.5, 0.0) @ params["v"]
        return jnp.mean((pred - y) ** 2)

    params, batch, key = _params(), _data(), jax.random.key(7)
    got = jax.jit(optax_ext.microbatched(jax.grad(dropout_loss), K, key_argnum=2))(
        params, batch, key
    )
    keys = jax.random.split(key, K)
    with jax.enable_x64(True):
        micro = [
            jax.grad(dropout_loss)(
                _f64(params), _f64(jax.tree.map(lambda a, j=j: a[j::K], batch)), keys[j]
            )
            for j in range(K)
        ]
        want = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *micro)
        same_key = [
            jax.grad(dropout_loss)(
                _f64(params), _f64(jax.tree.map(lambda a, j=j: a[j::K], batch)), key
            )
            for j in range(K)
        ]
        same = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *same_key)
    for name in params:
        _close(got[name], want[name])
    assert not np.allclose(got["w"], same["w"], rtol=1e-3)


def _dropout_loss(params, batch, key):
    x, y = batch
    h = jnp.tanh(x @ params["w"] + params["b"])
    keep = jax.random.uniform(key, h.shape, jnp.float32) < 0.5
    pred = jnp.where(keep, h / 0.5, 0.0) @ params["v"]
    return jnp.mean((pred - y) ** 2)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
def test_raw_key_of_every_prng_implementation_is_accepted(impl):
    """A raw `jax.random.PRNGKey(0)` is uint32 `(4,)` under the rbg
    implementations (common on TPU): it was refused, by its shape, with an
    error asking for `jax.random.PRNGKey(...)`. Reference: the float64 mean
    of grad_fn on each micro-batch with `split(key, k)[j]`, under the same
    implementation; a batch of raw keys is still refused."""
    with jax.default_prng_impl(impl):
        params, batch, key = _params(), _data(), jax.random.PRNGKey(3)
        fn = optax_ext.microbatched(jax.grad(_dropout_loss), K, key_argnum=2)
        got = jax.jit(fn)(params, batch, key)
        keys = jax.random.split(key, K)
        with jax.enable_x64(True):
            micro = [
                jax.grad(_dropout_loss)(
                    _f64(params),
                    _f64(jax.tree.map(lambda a, j=j: a[j::K], batch)),
                    keys[j],
                )
                for j in range(K)
            ]
            want = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *micro)
        for name in params:
            _close(got[name], want[name])
        with pytest.raises(
            TypeError, match=rf"argument 2 \(key_argnum\).*{impl}.*shape \(2, "
        ):
            fn(params, batch, jax.random.split(key, 2))


def test_batch_at_other_positions_and_several_arguments():
    """`batch_argnums` picks the batch (here arguments 0 and 2); the other
    arguments and keyword arguments pass unchanged."""

    def split_loss(x, params, y, *, scale):
        return scale * loss(params, (x, y))

    params, (x, y) = _params(), _data()
    got = optax_ext.microbatched(
        jax.grad(split_loss, argnums=1), K, batch_argnums=(0, 2)
    )(x, params, y, scale=3.0)
    with jax.enable_x64(True):
        want = jax.grad(split_loss, argnums=1)(
            _f64(x), _f64(params), _f64(y), scale=3.0
        )
    for name in params:
        _close(got[name], want[name])


@pytest.mark.parametrize(
    "dtype, accumulator_dtype",
    [("float32", jnp.float32), ("bfloat16", jnp.float32), ("bfloat16", None)],
)
def test_adam_step_equals_multi_steps_on_the_same_microbatches(
    dtype, accumulator_dtype, window_form
):
    """`microbatched(grad, k)` then adam gives the update `MultiSteps(adam, k)`
    emits after the k micro-batches `batch[j::k]`, in each form of its
    window (`window_form`), bit for bit (same running
    mean, same accumulator: float32, or bfloat16 updated in float32 and
    rounded once per micro-batch; bfloat16 on XLA:CPU, see below); and both
    are adam on the whole batch's gradient (float64, rounded to float32
    once)."""
    params, batch = _params(dtype), _data(n=N, dtype=dtype)
    adam = optax.adam(1e-2)
    grad_fn = jax.grad(loss)
    acc = {"accumulator_dtype": accumulator_dtype}

    @jax.jit
    def in_step(params, adam_state, batch):
        grads = optax_ext.microbatched(grad_fn, K, **acc)(params, batch)
        return adam.update(grads, adam_state, params)[0]

    opt = window_form(optax_ext.MultiSteps(adam, K, **acc))

    @jax.jit
    def mini_step(params, state, micro):
        return opt.update(grad_fn(params, micro), state, params)

    state = opt.init(params)
    for j in range(K):
        updates, state = mini_step(
            params, state, jax.tree.map(lambda a, j=j: a[j::K], batch)
        )
    assert bool(opt.has_updated(state))
    got = in_step(params, adam.init(params), batch)
    for name in params:
        assert got[name].dtype == updates[name].dtype == jnp.dtype(dtype)
        if dtype == "float32":
            np.testing.assert_array_equal(
                np.asarray(got[name], np.float32), np.asarray(updates[name], np.float32)
            )
    if dtype != "float32":
        # bfloat16: bit for bit on XLA:CPU. Elsewhere the gradients come from
        # two programs compiled apart, and adam's first step is
        # lr * g / (|g| + eps), the sign of g: an entry within their rounding
        # of 0 can flip, a swing of twice the update, so the bound is 256
        # bfloat16 rounding steps (2 / eps) and checks dtypes, shapes and
        # non-finite entries there.
        assert_close_across_programs(got, updates, ops=256)
    if dtype == "float32":
        # The whole batch's gradient in float64, rounded once to float32, then
        # the same float32 adam step (adam's own float32 rounding, e.g. of
        # 1 - b2, is not the accumulation's to answer for).
        with jax.enable_x64(True):
            whole = grad_fn(_f64(params), _f64(batch))
            whole = jax.tree.map(lambda g: np.asarray(g, np.float32), whole)
        want = jax.jit(adam.update)(whole, adam.init(params), params)[0]
        for name in params:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=0)


def _mlp_temp_bytes(grad_fn, params, batch):
    compiled = jax.jit(grad_fn).lower(params, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@COMPILED
def test_temp_memory_is_one_microbatch_plus_accumulator():
    """k=8 on an MLP whose activations dominate: the compiled temp memory
    stays under a quarter of the whole batch's plus one gradient-sized
    accumulator."""
    width, depth, n = 256, 4, 8192
    keys = jax.random.split(jax.random.key(0), depth + 1)
    params = [
        jax.random.normal(k, (16 if i == 0 else width, width)) * 0.05
        for i, k in enumerate(keys[:depth])
    ]
    x = jax.random.normal(keys[-1], (n, 16))

    def mlp_loss(params, x):
        h = x
        for w in params:
            h = jnp.tanh(h @ w)
        return jnp.mean(h**2)

    grad_fn = jax.grad(mlp_loss)
    full = _mlp_temp_bytes(grad_fn, params, x)
    micro = _mlp_temp_bytes(optax_ext.microbatched(grad_fn, 8), params, x)
    accumulator = sum(p.size * 4 for p in params)
    activations = n * width * depth * 4
    assert accumulator < activations / 10, "activations must dominate"
    assert micro < full / 4 + accumulator, (micro, full, accumulator)


@pytest.mark.parametrize("k", [0, -2, 2.5, True, "4", None])
def test_num_microbatches_must_be_a_positive_int(k):
    with pytest.raises(ValueError, match=rf"num_microbatches.*{re.escape(repr(k))}"):
        optax_ext.microbatched(jax.grad(loss), k)


def test_indivisible_batch_names_both_sizes():
    fn = optax_ext.microbatched(jax.grad(loss), 3)
    with pytest.raises(ValueError, match=r"argument 1.*32 rows.*num_microbatches=3"):
        fn(_params(), _data())


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"batch_argnums": -1}, TypeError, r"batch_argnums.*-1"),
        ({"batch_argnums": "x"}, TypeError, r"batch_argnums.*'x'"),
        ({"batch_argnums": (1, 1)}, ValueError, r"batch_argnums.*repeated"),
        ({"key_argnum": 1}, ValueError, r"key_argnum=1.*batch_argnums"),
        ({"accumulator_dtype": jnp.int32}, TypeError, r"accumulator_dtype.*int32"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        optax_ext.microbatched(jax.grad(loss), K, **kwargs)


def test_bad_calls_name_what_was_passed():
    with pytest.raises(TypeError, match=r"grad_fn must be a function.*3"):
        optax_ext.microbatched(3, K)  # type: ignore[arg-type]
    fn = optax_ext.microbatched(jax.grad(loss), K)
    with pytest.raises(
        ValueError, match=r"argument 1\[0\] has 32 rows, argument 1\[1\] has 8"
    ):
        fn(_params(), (_data()[0], jnp.zeros(8)))
    with pytest.raises(ValueError, match=r"argument 1\[1\] is a scalar"):
        fn(_params(), (_data()[0], jnp.zeros(())))
    with pytest.raises(TypeError, match=r"positions \(1,\).*1 positional"):
        fn(_params())
    keyed = optax_ext.microbatched(
        lambda p, b, k: jax.grad(loss)(p, b), K, key_argnum=2
    )
    with pytest.raises(TypeError, match=r"argument 2 \(key_argnum\).*PRNG key.*float"):
        keyed(_params(), _data(), jnp.zeros(2))


@pytest.mark.parametrize("name", ["grad", "value_and_grad_aux"])
def test_narrower_accumulator_dtype_keeps_each_output_in_its_own(name):
    """`accumulator_dtype` is the least dtype to accumulate in, as in
    MultiSteps: bfloat16 with float32 outputs accumulates them in float32
    (it raised before). Against the float64 whole batch: accumulated in
    bfloat16 they would be ~1e-3 off, not within float32 roundings."""
    grad_fn, make, _ = GRAD_FNS[name]
    params, batch = make(), _data()
    fn = optax_ext.microbatched(grad_fn, K, accumulator_dtype=jnp.bfloat16)
    got = jax.jit(fn)(params, batch)
    with jax.enable_x64(True):
        want = grad_fn(_f64(params), _f64(batch))
        want_leaves = [np.asarray(x) for x in jax.tree.leaves(want)]
    for g, w in zip(jax.tree.leaves(got), want_leaves, strict=True):
        if w.dtype == np.float64:
            assert g.dtype == jnp.float32
            _close(g, w)


@pytest.mark.parametrize("accumulator_dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_float8_outputs_accumulate_in_a_dtype_holding_them(accumulator_dtype):
    """float8 outputs with the float32 default (a raw TypePromotionError
    before) or their own dtype: the mean of float8 values whose float64
    mean is a float8 value comes back exactly."""
    values = np.array([1.0, 2.0, 3.0, 6.0])  # one row per micro-batch; mean 3

    def grad_fn(params, batch):
        return {"g": (params * batch[0]).astype(jnp.float8_e4m3fn)}

    fn = optax_ext.microbatched(grad_fn, 4, accumulator_dtype=accumulator_dtype)
    got = jax.jit(fn)(jnp.float32(1.0), jnp.asarray(values, jnp.float32))
    assert got["g"].dtype == jnp.float8_e4m3fn
    assert float(got["g"].astype(jnp.float32)) == float(np.mean(values))


def test_accumulator_dtype_holding_no_output_names_microbatched():
    """Neither float8_e5m2 nor float8_e4m3fn holds every value of the other:
    the error names microbatched's argument, the output's path and both
    dtypes."""

    def grad_fn(params, batch):
        return {"g": (params * batch[0]).astype(jnp.float8_e4m3fn)}

    fn = optax_ext.microbatched(grad_fn, 4, accumulator_dtype=jnp.float8_e5m2)
    with pytest.raises(
        TypeError,
        match=r"microbatched\(accumulator_dtype=float8_e5m2\) cannot accumulate "
        r"grad_fn's output at \['g'\] of dtype float8_e4m3fn",
    ):
        fn(jnp.float32(1.0), jnp.ones(4))


@pytest.fixture(scope="module")
def example_run():
    """examples/microbatched_train.py, 15 steps with 8 micro-batches."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parent.parent / "examples" / "microbatched_train.py"
    spec = importlib.util.spec_from_file_location("microbatched_train", path)
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    return ex.train(steps=15, microbatches=8, progress=False)


def test_example_trains(example_run):
    """examples/microbatched_train.py: the loss falls."""
    losses, _, _ = example_run
    assert losses[-1] < 0.5 * losses[0], losses


@COMPILED
def test_example_saves_memory(example_run):
    """examples/microbatched_train.py: the compiled step with 8
    micro-batches needs under a quarter of the full batch's temp."""
    _, _, memory = example_run
    full, micro = memory.values()
    assert micro < full / 4, memory
