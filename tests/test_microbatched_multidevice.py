"""`microbatched` with the batch sharded over 8 CPU devices: the whole batch's
gradients, no movement of the batch between devices, and one all-reduce of
the gradients per call, after the loop (compiled HLO).

Needs `XLA_FLAGS=--xla_force_host_platform_device_count=8` before JAX starts:
`test_multidevice_runner.py` runs these in a process of their own, or run
them directly with that flag and `pytest -m multidevice`.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _helpers import hlo_computations, loop_computations, xla_cpu_only
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_ext

COMPILED = xla_cpu_only("compiled HLO (collectives) on 8 host devices")

pytestmark = pytest.mark.multidevice

K = 4
N = 256  # 32 rows per device, 8 per device per micro-batch


def _problem():
    kw, kv, kx, ky = jax.random.split(jax.random.key(0), 4)
    params = {
        "w": jax.random.normal(kw, (16, 32)) / 4,
        "v": jax.random.normal(kv, (32,)) / 6,
    }
    batch = (jax.random.normal(kx, (N, 16)), jax.random.normal(ky, (N,)))
    return params, batch


def loss(params, batch):
    x, y = batch
    return jnp.mean((jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2)


def eqx_loss_aux(model, batch):
    x, y = batch
    pred = jax.vmap(model)(x)[:, 0]
    return jnp.mean((pred - y) ** 2), {"mean_pred": jnp.mean(pred)}


def _f64(tree):
    return jax.tree.map(
        lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, tree
    )


def _assert_close(got, want):
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        assert g.dtype == jnp.float32
        np.testing.assert_allclose(
            np.asarray(g), w, rtol=1e-5, atol=1e-6 * float(np.abs(w).max())
        )


def _collectives(hlo):
    """(all-reduces outside any loop, all-reduces inside one, count of
    all-gather, all-to-all and collective-permute anywhere)."""
    comps = hlo_computations(hlo)
    assert any(" while(" in line for lines in comps.values() for line in lines)
    loop = loop_computations(comps)
    inside = outside = 0
    for name, lines in comps.items():
        n = sum(1 for line in lines if re.search(r" all-reduce(?:-start)?\(", line))
        if name in loop:
            inside += n
        else:
            outside += n
    moves = len(re.findall(r" (?:all-gather|all-to-all|collective-permute)", hlo))
    return outside, inside, moves


def _mesh(mode):
    return jax.make_mesh((8,), ("data",), axis_types=(getattr(AxisType, mode),))


def _sharded_call(mode, grad_fn, params, batch):
    """(compiled HLO text, result) of `microbatched(grad_fn, K)` on a batch
    sharded over 8 devices: plain jit with Explicit axes (no axis_name), plain
    jit with Auto axes and `axis_name`, or inside `jax.shard_map`."""
    mesh = _mesh("Auto" if mode == "auto" else "Explicit")
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        dynamic, static = eqx.partition(params, eqx.is_array)
        dynamic = jax.device_put(dynamic, NamedSharding(mesh, P()))
        if mode == "explicit":
            fn = optax_ext.microbatched(grad_fn, K)
        elif mode == "auto":
            fn = optax_ext.microbatched(grad_fn, K, axis_name="data")
        else:
            inner = optax_ext.microbatched(grad_fn, K, axis_name="data")

            def fn(params, batch):
                dyn, stat = eqx.partition(params, eqx.is_array)
                out = jax.shard_map(
                    lambda d, b: eqx.filter(
                        inner(eqx.combine(d, stat), b), eqx.is_array
                    ),
                    in_specs=(P(), P("data")),
                    out_specs=P(),
                )(dyn, batch)
                return out

        @jax.jit
        def step(dynamic, batch):
            out = fn(eqx.combine(dynamic, static), batch)
            return eqx.filter(out, eqx.is_array)

        compiled = step.lower(dynamic, batch).compile()
        return compiled.as_text(), compiled(dynamic, batch)


GRAD_FNS = {
    "grad": (jax.grad(loss), lambda: _problem()[0]),
    "eqx_value_and_grad_aux": (
        eqx.filter_value_and_grad(eqx_loss_aux, has_aux=True),
        lambda: eqx.nn.MLP(16, 1, 32, 2, key=jax.random.key(3)),
    ),
}


@COMPILED
@pytest.mark.parametrize("name", GRAD_FNS)
@pytest.mark.parametrize("mode", ["explicit", "auto", "shard_map"])
def test_sharded_batch_reduces_once_after_the_loop(mode, name):
    """Each micro-batch takes its rows from every device (no all-gather,
    all-to-all or collective-permute), the gradients (with the loss and float
    aux) are all-reduced once, outside the loop, and equal grad_fn on the
    whole batch in float64."""
    grad_fn, make = GRAD_FNS[name]
    params, batch = make(), _problem()[1]
    hlo, got = _sharded_call(mode, grad_fn, params, batch)
    outside, inside, moves = _collectives(hlo)
    assert (outside, inside, moves) == (1, 0, 0)
    with jax.enable_x64(True):
        want = eqx.filter(grad_fn(_f64(params), _f64(batch)), eqx.is_array)
    _assert_close(got, want)


@COMPILED
def test_auto_axes_without_axis_name_reduce_inside_the_loop():
    """Why `axis_name` is needed with Auto axes: the batch's sharding is not
    in its type, the loop runs as written and XLA all-reduces the gradients
    in every micro-batch (values still right)."""
    params, batch = _problem()
    mesh = _mesh("Auto")
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        compiled = (
            jax.jit(optax_ext.microbatched(jax.grad(loss), K))
            .lower(params, batch)
            .compile()
        )
    outside, inside, moves = _collectives(compiled.as_text())
    assert inside >= 1 and moves == 0


def test_rows_per_device_must_split():
    """256 rows split in 64 micro-batches, but each device holds 32."""
    params, batch = _problem()
    mesh = _mesh("Explicit")
    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        fn = jax.jit(optax_ext.microbatched(jax.grad(loss), 64))
        with pytest.raises(ValueError, match=r"each device holds 32 rows.*=64"):
            fn(params, batch)


def test_unbound_axis_name_is_an_error():
    params, batch = _problem()
    fn = optax_ext.microbatched(jax.grad(loss), K, axis_name="data")
    with pytest.raises(ValueError, match=r"axis_name='data'.*set_mesh"):
        fn(params, batch)


def masked_loss(params, batch):
    """A masked mean over the rows (`batch[2]`, integer: not differentiated)."""
    x, y, mask = batch
    rows = (jnp.tanh(x @ params["w"]) @ params["v"] - y) ** 2
    mask = mask.astype(rows.dtype)
    return jnp.sum(mask * rows) / jnp.sum(mask)


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted"])
@pytest.mark.parametrize("mode", ["explicit", "auto", "shard_map"])
def test_gradient_with_respect_to_the_batch_is_the_whole_batch_s(mode, weighted):
    """Marked `"gradient"`, the gradient with respect to a batch sharded
    over 8 devices is the whole batch's: each micro-batch's rows scaled by
    `1 / (k * 8)`, or by its weight over the weights' sum on all devices.
    Reference: grad_fn on the whole batch in float64."""
    params, (x, y) = _problem()
    mask = np.ones(N, np.int32)
    if weighted:  # uneven weights; some micro-batches of weight 0
        mask = (np.random.default_rng(0).random(N) < 0.4).astype(np.int32)
        mask[: N // 2 : 2] = 0
    batch = (x, y, jnp.asarray(mask))
    grad_fn = jax.grad(masked_loss, argnums=(0, 1), allow_int=True)
    kwargs = dict(
        per_example=(False, "gradient"),
        weight_fn=(lambda p, b: jnp.sum(b[2])) if weighted else None,
    )
    mesh = _mesh("Auto" if mode == "auto" else "Explicit")

    def floats(out):  # the float0 gradient of the mask stays out
        grads, (dx, dy, _) = out
        return grads, (dx, dy)

    with jax.set_mesh(mesh):
        batch = jax.device_put(batch, NamedSharding(mesh, P("data")))
        if mode == "shard_map":
            inner = optax_ext.microbatched(grad_fn, K, axis_name="data", **kwargs)
            fn = jax.shard_map(
                lambda p, b: floats(inner(p, b)),
                in_specs=(P(), P("data")),
                out_specs=(P(), P("data")),
            )
        else:
            axis_name = "data" if mode == "auto" else None
            fn = optax_ext.microbatched(grad_fn, K, axis_name=axis_name, **kwargs)
            fn = lambda p, b, fn=fn: floats(fn(p, b))  # noqa: E731
        got = jax.jit(fn)(params, batch)
    with jax.enable_x64(True):
        want = floats(grad_fn(_f64(params), _f64((x, y, jnp.asarray(mask)))))
    _assert_close(got, want)


@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weight_fn"])
def test_traced_count_of_real_microbatches_on_an_explicit_batch(weighted):
    """`num_real_microbatches` traced by the step (the docstring: "a traced
    one too, with no recompilation") with the batch split over an
    `Explicit` axis failed inside JAX: the `shard_map` that `microbatched`
    runs in closed over it. It enters as an operand now. Reference: the
    float64 gradient of the real micro-batches' rows (row `i` is in
    micro-batch `i % K`)."""
    params, batch = _problem()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    weight_fn = (lambda p, b: jnp.float32(b[0].shape[0])) if weighted else None
    with jax.set_mesh(mesh):
        sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))
        fn = jax.jit(
            lambda p, b, n: optax_ext.microbatched(
                jax.grad(loss), K, num_real_microbatches=n, weight_fn=weight_fn
            )(p, b)
        )
        got = [fn(params, sharded, jnp.int32(n)) for n in (3, 1)]
        assert fn._cache_size() == 1
    for n, grads in zip((3, 1), got, strict=True):
        real = np.arange(N) % K < n
        with jax.enable_x64(True):
            want = jax.grad(loss)(_f64(params), _f64((batch[0][real], batch[1][real])))
        _assert_close(grads, want)


def test_grad_fn_closing_over_a_traced_value_is_named():
    """On an `Explicit` batch, a `grad_fn` that closes over a traced value
    of the step failed inside JAX's `shard_map`, which the caller never
    wrote. The error says what to do: pass it as an argument."""
    params, batch = _problem()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with jax.set_mesh(mesh):
        sharded = jax.device_put(batch, NamedSharding(mesh, P("data")))

        @jax.jit
        def step(params, batch, scale):
            grad_fn = jax.grad(lambda p, b: loss(p, b) * scale)
            return optax_ext.microbatched(grad_fn, K)(params, batch)

        with pytest.raises(
            ValueError, match=r"Pass such values as arguments of grad_fn"
        ):
            step(params, sharded, jnp.float32(2.0))


def _closure_step(where, closes_over):
    """A jitted gradient of `loss` through `microbatched(axis_name="data")`
    on `Auto` axes (under `jax.set_mesh`) or inside the caller's
    `shard_map`; `closes_over`: `grad_fn` reads the params from the
    enclosing function, else they are its argument."""

    def grads(params, batch):
        if closes_over:
            fn = lambda b: jax.grad(loss)(params, b)
            micro = optax_ext.microbatched(fn, K, axis_name="data", batch_argnums=0)
            return micro(batch)
        fn = optax_ext.microbatched(
            jax.grad(loss), K, axis_name="data", batch_argnums=1
        )
        return fn(params, batch)

    if where == "auto":
        return jax.jit(grads)
    mesh = jax.sharding.get_abstract_mesh()
    return jax.jit(
        jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    )


@pytest.mark.parametrize("where", ["auto", "shard_map"])
def test_grad_fn_closing_over_params_is_refused_not_scaled(where):
    """With `Auto` axes or inside the caller's `shard_map`, a `grad_fn`
    closing over the params got them typed as the same on every device:
    `jax.grad` summed their gradient over the devices and the loop averaged
    it again, 8x the whole batch's gradient on 8 devices, silently. It is
    refused, saying to pass them as an argument; passed so, the gradient
    is the whole batch's."""
    params, batch = _problem()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        rows = jax.device_put(batch, NamedSharding(mesh, P("data")))
        with pytest.raises(ValueError, match=r"closes over(.|\n)*Pass the params"):
            _closure_step(where, closes_over=True)(params, rows)
        got = _closure_step(where, closes_over=False)(params, rows)
    with jax.enable_x64(True):
        want = jax.grad(loss)(_f64(params), _f64(batch))
    _assert_close(got, want)


def test_grad_fn_closing_over_concrete_params_is_refused_not_scaled():
    """Params closed over as concrete arrays (not traced: `shard_map`
    called outside `jax.jit`) are constants of the loop's trace, and
    `jax.grad` still sums their gradient over the devices. Refused too:
    the output is computed from the batch yet the same on every device."""
    params, batch = _problem()
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        rows = jax.device_put(batch, NamedSharding(mesh, P("data")))
        fn = lambda b: jax.grad(loss)(params, b)  # noqa: E731
        micro = optax_ext.microbatched(fn, K, axis_name="data", batch_argnums=0)
        run = jax.shard_map(micro, mesh=mesh, in_specs=P("data"), out_specs=P())
        with pytest.raises(ValueError, match=r"closes over(.|\n)*Pass the params"):
            run(rows)


def _constant_outputs(params, batch):
    """The gradient, and outputs built the same on every device: an int
    from the micro-batch's shape, a bool and a float constant."""
    rows = jnp.int32(batch[0].shape[0])
    aux = {"rows": rows, "flag": jnp.bool_(True), "half": jnp.float32(0.5)}
    return jax.grad(loss)(params, batch), aux


@pytest.mark.parametrize("mode", ["explicit", "auto", "shard_map"])
def test_outputs_the_same_on_every_device_combine_as_on_one(mode):
    """Outputs that do not vary over the batch's axis were refused as
    gradients `jax.grad` summed over the devices, naming a closure that did
    not exist (and, on an `Explicit` batch, an `axis_name` never passed).
    They combine as on one device over the whole batch: the rows counted,
    the flag any-ed, the constant its own mean; the gradient the whole
    batch's."""
    params, batch = _problem()
    _, (grads, aux) = _sharded_call(mode, _constant_outputs, params, batch)
    assert aux["rows"].dtype == jnp.int32 and int(aux["rows"]) == N
    assert aux["flag"].dtype == jnp.bool_ and bool(aux["flag"])
    assert aux["half"].dtype == jnp.float32 and float(aux["half"]) == 0.5
    with jax.enable_x64(True):
        want = jax.grad(loss)(_f64(params), _f64(batch))
    _assert_close(grads, want)


def test_grad_fn_closing_over_params_on_an_explicit_batch_is_refused():
    """On an `Explicit` batch (no `axis_name`), a `grad_fn` closing over the
    params is refused as inside `shard_map`; the error named
    `axis_name='data'`, which the caller never passed. It names the
    batch's axis."""
    params, batch = _problem()
    with jax.set_mesh(_mesh("Explicit")):
        rows = jax.device_put(batch, NamedSharding(_mesh("Explicit"), P("data")))

        @jax.jit
        def step(params, batch):
            fn = lambda b: jax.grad(loss)(params, b)  # noqa: E731
            return optax_ext.microbatched(fn, K, batch_argnums=0)(batch)

        with pytest.raises(ValueError) as info:
            step(params, rows)
    message = str(info.value)
    assert "axis_name=" not in message
    assert re.search(r"along 'data'(.|\n)*closes over", message)
    assert "Pass the params" in message


def test_axis_name_the_explicit_batch_is_not_split_over_is_refused():
    """With the batch split over `Explicit` axes, the loop averages over
    the axes its type names; an `axis_name` naming another (a typo, or the
    model axis) was ignored without a word. A subset of them is taken."""
    params, batch = _problem()
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with jax.set_mesh(mesh):
        rows = jax.device_put(batch, NamedSharding(mesh, P("data")))
        for name in ("nope", "model", ("data", "model")):
            fn = jax.jit(optax_ext.microbatched(jax.grad(loss), K, axis_name=name))
            with pytest.raises(
                ValueError, match=r"split over the mesh axes \('data',\)"
            ):
                fn(params, rows)
        both = jax.device_put(batch, NamedSharding(mesh, P(("data", "model"))))
        fn = jax.jit(optax_ext.microbatched(jax.grad(loss), K, axis_name="data"))
        got = fn(params, both)
    with jax.enable_x64(True):
        want = jax.grad(loss)(_f64(params), _f64(batch))
    _assert_close(got, want)
