"""Sharded state and communication-deferred accumulation on 8 CPU devices.

These tests need `XLA_FLAGS=--xla_force_host_platform_device_count=8` set
before JAX starts, so they run in a process of their own:
`test_multidevice_runner.py` starts it from the main test run, or run them
directly with that flag and `pytest -m multidevice`.
"""

import contextlib
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _helpers import collectives_by_step, hlo_computations, xla_cpu_only
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import optax_ext

COMPILED = xla_cpu_only("compiled HLO (collectives, copies) on 8 host devices")

pytestmark = pytest.mark.multidevice

LAYOUTS = {  # name: (shape, spec on a ("x", "y") = (2, 4) mesh)
    "rows": ((16, 8), P("x")),
    "both": ((16, 8), P("x", "y")),
    "cols": ((6, 8), P(None, "y")),
    "vector": ((5,), P()),
    "scalar": ((), P()),
}


def _mesh(mode):
    return jax.make_mesh((2, 4), ("x", "y"), axis_types=(getattr(AxisType, mode),) * 2)


def _sharded_params(mesh, dtype=jnp.float32):
    return {
        name: jax.device_put(
            jnp.linspace(-1, 1, int(np.prod(shape))).reshape(shape).astype(dtype),
            NamedSharding(mesh, spec),
        )
        for name, (shape, spec) in LAYOUTS.items()
    }


def _mask(params):
    return {name: jnp.ndim(p) > 1 for name, p in params.items()}


TRANSFORMS = {
    "multi_steps": lambda: optax_ext.MultiSteps(optax.adam(1e-3), 4),
    "multi_steps_bf16_mu": lambda: optax_ext.MultiSteps(
        optax.adam(1e-3, mu_dtype=jnp.bfloat16), 4
    ),
    "inject": lambda: optax_ext.inject_hyperparams(optax.adamw)(
        learning_rate=optax.linear_schedule(1e-3, 0.0, 100), mask=_mask
    ),
    "zero_nans": optax_ext.zero_nans,
    "composed": lambda: optax_ext.MultiSteps(
        optax.chain(
            optax_ext.zero_nans(),
            optax_ext.inject_hyperparams(optax.adamw)(learning_rate=1e-3, mask=_mask),
        ),
        3,
    ),
    "optax": lambda: optax.MultiSteps(optax.adam(1e-3), 4),
}


def _mirror_leaves(state, params):
    """(path, leaf, param) for each state leaf that sits under a param's name
    and has its shape; and every scalar leaf."""
    mirrored, scalars = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = jax.tree_util.keystr(path)
        if leaf.ndim == 0:
            scalars.append((name, leaf))
        match = re.search(r"\['(\w+)'\]$", name)
        if match and match.group(1) in params:
            param = params[match.group(1)]
            if leaf.shape == param.shape and leaf.ndim > 0:
                mirrored.append((name, leaf, param))
    return mirrored, scalars


@pytest.mark.parametrize("mode", ["Explicit", "Auto", "no_mesh"])
@pytest.mark.parametrize("name", TRANSFORMS)
def test_jitted_init_mirrors_param_shardings(name, mode, request):
    """Every state leaf that mirrors a param has the param's sharding, every
    scalar is replicated. optax.MultiSteps gets this only where the sharding
    is part of the type (Explicit axes); elsewhere it replicates the moments
    and the accumulator on every device (xfail)."""
    if name == "optax" and mode != "Explicit":
        request.applymarker(pytest.mark.xfail(strict=True, reason="replicated"))
    mesh = _mesh("Auto" if mode == "no_mesh" else mode)
    params = _sharded_params(mesh)
    tx = TRANSFORMS[name]()
    context = contextlib.nullcontext() if mode == "no_mesh" else jax.set_mesh(mesh)
    with context:
        state = jax.jit(tx.init)(params)
    mirrored, scalars = _mirror_leaves(state, params)
    if name != "zero_nans":
        assert mirrored, "the test found no state leaf mirroring a param"
    for path, leaf, param in mirrored:
        assert leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), (
            path,
            leaf.sharding,
            param.sharding,
        )
    for path, leaf in scalars:
        assert leaf.sharding.is_fully_replicated, (path, leaf.sharding)


def test_mirroring_keeps_values_dtypes_and_weak_types():
    """Mirroring changes layouts only: the state from a sharded jitted init
    equals the init of the same params on one device, leaf for leaf (values,
    dtypes, weak types), and the moments and accumulators are +0 even where
    a param is infinite."""
    mesh = _mesh("Auto")
    params = _sharded_params(mesh, jnp.bfloat16)
    params["rows"] = params["rows"].at[0, 0].set(-jnp.inf)
    tx = TRANSFORMS["composed"]()
    with jax.set_mesh(mesh):
        sharded = jax.jit(tx.init)(params)
    one_device = jax.device_put(params, jax.devices()[0])
    reference = jax.jit(tx.init)(one_device)
    for (path, a), b in zip(
        jax.tree_util.tree_flatten_with_path(sharded)[0],
        jax.tree.leaves(reference),
        strict=True,
    ):
        assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type), path
        np.testing.assert_array_equal(
            np.asarray(a, np.float32), np.asarray(b, np.float32), str(path)
        )
    mirrored, _ = _mirror_leaves(sharded, params)
    for path, leaf, _ in mirrored:
        values = np.asarray(leaf, np.float32)
        assert (values == 0).all() and not np.signbit(values).any(), path


def _collectives(hlo):
    """Counts of collectives in compiled HLO; all-reduces of one element (a
    flag such as zero_nans' `found_nan`) apart from those of arrays."""
    counts = {
        op: len(re.findall(rf" {op}(?:-start)?\(", hlo))
        for op in ("all-gather", "all-to-all", "collective-permute")
    }
    for kind in re.findall(r"= (\S+) all-reduce(?:-start)?\(", hlo):
        dims = re.findall(r"\[([\d,]*)\]", kind)
        size = max(int(np.prod([int(d) for d in ds.split(",") if d])) for ds in dims)
        key = "all-reduce of a flag" if size == 1 else "all-reduce"
        counts[key] = counts.get(key, 0) + 1
    return counts


def _token_reads(hlo):
    """All-reduces of one element that only an emitting step runs: with
    params sharded outside `shard_map`, each ordering token reads one
    element of a sharded array from the device holding it (see
    test_sharded.py). None without a conditional."""
    if not any(" conditional(" in line for line in hlo_computations(hlo)["ENTRY"]):
        return 0
    _, emitting = collectives_by_step(hlo)
    return sum(
        op == "all-reduce" and re.search(r"\[[1,]*\]", shape) is not None
        for shape, op in emitting
    )


INNERS = {
    "adam": lambda: optax.adam(1e-3),
    "adafactor": lambda: optax.adafactor(1e-3),
    "lion": lambda: optax.lion(1e-4),
}


@COMPILED
@pytest.mark.parametrize("inner", INNERS)
@pytest.mark.parametrize("wrapper", ["multi_steps", "inject", "composed"])
@pytest.mark.parametrize("mode", ["Explicit", "Auto"])
def test_donated_update_adds_no_resharding(inner, wrapper, mode):
    """A jitted, donated update with in and out shardings equal has no
    all-gather, all-to-all, collective-permute or all-reduce beyond the plain
    inner optimizer's, and its state keeps the shardings. Only an emitting
    step adds all-reduces of one element: the ordering tokens' reads, at
    most two (the inner state's token and the clear's) per sharded leaf."""
    mesh = _mesh(mode)
    params = _sharded_params(mesh)
    tx = {
        "multi_steps": lambda: optax_ext.MultiSteps(INNERS[inner](), 2),
        "inject": lambda: optax_ext.inject_hyperparams(
            lambda learning_rate: optax.chain(
                INNERS[inner](), optax.scale(learning_rate)
            )
        )(learning_rate=optax.cosine_decay_schedule(1.0, 10)),
        "composed": lambda: optax_ext.MultiSteps(
            optax.chain(optax_ext.zero_nans(), INNERS[inner]()), 2
        ),
    }[wrapper]()

    def compiled_update(tx):
        with jax.set_mesh(mesh):
            state = jax.jit(tx.init)(params)
            grads = jax.tree.map(jnp.ones_like, params)
            shard = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
            fn = jax.jit(
                lambda g, s, p: tx.update(g, s, p),
                in_shardings=(shard(grads), shard(state), shard(params)),
                out_shardings=(shard(grads), shard(state)),
                donate_argnums=(0, 1),
            )
            return fn.lower(grads, state, params).compile(), state

    ours, state = compiled_update(tx)
    plain, _ = compiled_update(INNERS[inner]())
    mine, theirs = _collectives(ours.as_text()), _collectives(plain.as_text())
    tokens = _token_reads(ours.as_text())
    assert tokens <= 2 * 3  # the sharded params
    # zero_nans reduces its per-leaf NaN flag over the shards: one scalar each.
    flags = tokens + (3 if wrapper == "composed" else 0)
    theirs["all-reduce of a flag"] = theirs.get("all-reduce of a flag", 0) + flags
    for op in mine:
        assert mine[op] <= theirs.get(op, 0), (op, mine, theirs)
    mirrored, _ = _mirror_leaves(state, params)
    assert mirrored
    for path, leaf, param in mirrored:
        assert leaf.sharding.is_equivalent_to(param.sharding, leaf.ndim), path


_MANY_SPECS = [P("x", "y"), P("y", None), P(None, "x")]


@functools.cache
def _many_leaves_step(mode, form):
    """The donated train step on 200 leaves of (16, 24) sharded three ways:
    `form` "bare" (adam), "update" or "apply_gradients" (MultiSteps(adam)),
    compiled; the bare step is shared by the tests of a mesh mode."""
    mesh = _mesh(mode)
    with jax.set_mesh(mesh):
        params = {
            f"w{i:03d}": jax.device_put(
                jnp.full((16, 24), 0.01 * i), NamedSharding(mesh, _MANY_SPECS[i % 3])
            )
            for i in range(200)
        }
    if form == "bare":
        tx = optax.adam(1e-3)
    else:
        tx = optax_ext.MultiSteps(optax.adam(1e-3), 2)

    def step(params, state, grads):
        if form == "apply_gradients":
            return optax_ext.apply_gradients(tx, grads, state, params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    with jax.set_mesh(mesh):
        state = jax.jit(tx.init)(params)
        shard = lambda tree: jax.tree.map(lambda x: x.sharding, tree)  # noqa: E731
        fn = jax.jit(
            step,
            in_shardings=(shard(params), shard(state), shard(params)),
            out_shardings=(shard(params), shard(state)),
            donate_argnums=(0, 1),
        )
        return fn.lower(params, state, params).compile().as_text()


@COMPILED
@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("mode", ["Explicit", "Auto"])
def test_train_step_with_many_sharded_leaves_adds_no_collective(mode, form):
    """The realistic sibling of the test above: 200 sharded leaves in the
    donated train step (update + apply_updates, or the fused
    apply_gradients) of MultiSteps(adam) compile with no collective beyond
    the bare adam train step's, but all-reduces of one element that only
    an emitting step runs (the ordering tokens' reads, one per mesh axes a
    leaf is sharded over, per token). (It found `cast_like` reshaping a
    weakly typed state leaf sharded over an Explicit axis: a sharding
    error.)"""
    ours, bare = _many_leaves_step(mode, form), _many_leaves_step(mode, "bare")
    mine, theirs = _collectives(ours), _collectives(bare)
    tokens = _token_reads(ours)
    assert tokens <= len(_MANY_SPECS)
    theirs["all-reduce of a flag"] = theirs.get("all-reduce of a flag", 0) + tokens
    for op in mine:
        assert mine[op] <= theirs.get(op, 0), (op, mine, theirs)


# --- communication-deferred accumulation --------------------------------------

N_DEVICES = 8
K = 3


def _data_mesh():
    return jax.make_mesh((N_DEVICES,), ("data",))


def _loss(params, x, y):
    pred = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return jnp.mean((pred - y) ** 2)


def _problem(n_steps, local_batch=2, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    params = {
        "w1": jax.random.normal(keys[0], (3, 5)) * 0.5,
        "b1": jnp.zeros((5,)),
        "w2": jax.random.normal(keys[1], (5, 2)) * 0.5,
    }
    xs = jax.random.normal(keys[2], (n_steps, N_DEVICES * local_batch, 3))
    ys = jax.random.normal(keys[3], (n_steps, N_DEVICES * local_batch, 2))
    return params, xs, ys


def _varying(tree):
    """`tree` typed as differing between devices along "data", so that
    `jax.grad` gives each device's own gradient."""
    if hasattr(lax, "pcast"):  # jax >= 0.9
        return lax.pcast(tree, "data", to="varying")
    return lax.pvary(tree, "data")


def _local_grads(params, x, y):
    return jax.grad(_loss)(_varying(params), x, y)


def _deferred_init(opt, params, mesh):
    """Replicated params and the state from `opt.init` run under shard_map."""
    params = jax.device_put(params, NamedSharding(mesh, P()))
    init = jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=opt.state_specs())
    return params, jax.jit(init)(params)


def _train_deferred(opt, params, xs, ys, fused=False):
    mesh = _data_mesh()
    specs = opt.state_specs()
    with jax.set_mesh(mesh):
        params, state = _deferred_init(opt, params, mesh)

        @jax.jit
        @jax.shard_map(
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
        def step(params, state, x, y):
            grads = _local_grads(params, x, y)
            if fused:
                return optax_ext.apply_gradients(opt, grads, state, params)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        batch = NamedSharding(mesh, P("data"))
        for x, y in zip(xs, ys, strict=True):
            params, state = step(
                params, state, jax.device_put(x, batch), jax.device_put(y, batch)
            )
    return jax.device_get(params), state, step


def _reference(inner, params, xs, ys, *, skip_not_finite=False, mean=True):
    """Plain optax on one device: the gradient of each concatenated batch,
    windows of K accepted mini-steps averaged (or summed) by hand."""
    state = inner.init(params)
    window = []
    for x, y in zip(xs, ys, strict=True):
        g = jax.grad(_loss)(params, x, y)
        finite = all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(g))
        if skip_not_finite and not finite:
            continue
        window.append(g)
        if len(window) == K:
            total = jax.tree.map(lambda *gs: sum(gs[1:], gs[0]), *window)
            g = jax.tree.map(lambda v: v / K, total) if mean else total
            updates, state = inner.update(g, state, params)
            params = optax.apply_updates(params, updates)
            window = []
    return params


def _assert_close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


# sgd: a stateless inner optimizer, whose conditional can test no state
# element for its runtime `True` (the device's own gradients vary).
DEFERRED_INNERS = {"adam": lambda: optax.adam(1e-2), "sgd": lambda: optax.sgd(1e-2)}


@pytest.mark.parametrize("inner", DEFERRED_INNERS)
@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("mean", [True, False])
def test_deferred_accumulation_equals_one_device_on_the_whole_batch(mean, form, inner):
    params, xs, ys = _problem(2 * K + 1)
    make = DEFERRED_INNERS[inner]
    opt = optax_ext.MultiSteps(make(), K, use_grad_mean=mean, axis_name="data")
    got, state, _ = _train_deferred(
        opt, params, xs, ys, fused=form == "apply_gradients"
    )
    _assert_close(got, _reference(make(), params, xs, ys, mean=mean))
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 1
    # Each device's accumulator holds the mean of its own shard of the batch.
    own = [
        jax.grad(_loss)(got, xs[-1][2 * d : 2 * d + 2], ys[-1][2 * d : 2 * d + 2])
        for d in range(N_DEVICES)
    ]
    for name in params:
        np.testing.assert_allclose(
            np.asarray(state.acc_grads[name]),
            np.stack([g[name] for g in own]),
            rtol=1e-5,
            atol=1e-7,
        )


def test_zero_nans_inside_deferred_accumulation():
    """A NaN in one device's input: zero_nans, placed inside MultiSteps, runs
    on the averaged gradient, as on one device with the whole batch."""
    params, xs, ys = _problem(2 * K)
    xs = xs.at[1, 5, 0].set(jnp.nan)  # device 2's shard, second mini-step
    inner = optax.chain(optax_ext.zero_nans(), optax.adam(1e-2))
    got, _, _ = _train_deferred(
        optax_ext.MultiSteps(inner, K, axis_name="data"), params, xs, ys
    )
    want = _reference(optax.chain(optax.zero_nans(), optax.adam(1e-2)), params, xs, ys)
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in jax.tree.leaves(got))
    _assert_close(got, want)


def test_skip_not_finite_is_one_decision_for_all_devices():
    """An inf on one device drops that mini-step on every device, as one
    device with the whole batch drops it; the windows stay aligned."""
    params, xs, ys = _problem(2 * K + 1)
    xs = xs.at[2, 13, 1].set(jnp.inf)  # only device 6 sees it
    opt = optax_ext.MultiSteps(
        optax.adam(1e-2),
        K,
        should_skip_update_fn=optax.skip_not_finite,
        axis_name="data",
    )
    got, state, _ = _train_deferred(opt, params, xs, ys)
    want = _reference(optax.adam(1e-2), params, xs, ys, skip_not_finite=True)
    _assert_close(got, want)
    assert int(state.gradient_step) == 2 and int(state.mini_step) == 0
    # skip_state holds one record per device (of its last mini-step).
    counts = np.asarray(state.skip_state["num_not_finite"])
    assert counts.shape == (N_DEVICES,)


def _branches(hlo):
    """(ENTRY and its callees apart from the conditional's branches, the
    emitting branch, the non-emitting branch) as HLO text."""
    comps = hlo_computations(hlo)
    conds = [line for line in comps["ENTRY"] if " conditional(" in line]
    (cond,) = conds
    branches = r"branch_computations=\{%([^,}]+), %([^,}]+)\}"
    no_emit, emit = re.search(branches, cond).groups()
    return "\n".join(comps["ENTRY"]), "\n".join(comps[emit]), "\n".join(comps[no_emit])


def _all_reduces(text):
    return re.findall(r"= (\([^)]*\)|\S+) all-reduce(?:-start)?\(", text)


@COMPILED
@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("skip", [False, True])
def test_mini_step_has_no_collective_and_emit_reduces_once(skip, form):
    """Also: inside `shard_map` the step traces Adam's `update` once (over
    the training run and the lowering here)."""
    params, xs, ys = _problem(1)
    adam, traces = optax.adam(1e-2), []

    def counted(grads, state, params=None, **extra):
        traces.append(1)
        return adam.update(grads, state, params)

    opt = optax_ext.MultiSteps(
        optax.GradientTransformationExtraArgs(adam.init, counted),
        K,
        should_skip_update_fn=optax.skip_not_finite if skip else None,
        axis_name="data",
    )
    _, state, step = _train_deferred(
        opt, params, xs, ys, fused=form == "apply_gradients"
    )
    mesh = _data_mesh()
    with jax.set_mesh(mesh):
        batch = NamedSharding(mesh, P("data"))
        hlo = (
            step.lower(
                jax.device_put(params, NamedSharding(mesh, P())),
                state,
                jax.device_put(xs[0], batch),
                jax.device_put(ys[0], batch),
            )
            .compile()
            .as_text()
        )
    assert len(traces) == 1
    entry, emit, no_emit = _branches(hlo)
    assert _all_reduces(no_emit) == []
    # The skip decision is one scalar; without a skip function, nothing.
    assert _all_reduces(entry) == (["s32[]"] if skip else [])
    # One all-reduce, of every params-shaped leaf at once, in f32.
    (reduced,) = _all_reduces(emit)
    assert sorted(re.findall(r"f32\[[\d,]*\]", reduced)) == sorted(
        f"f32[{','.join(map(str, p.shape))}]" for p in params.values()
    )


@COMPILED
@pytest.mark.parametrize("inner", ["adam", "lion"])
def test_deferred_mini_step_copies_no_array(inner):
    """Inside shard_map every array is this device's own, so the in-place
    machinery of one device holds: with params and state donated, a
    mini-step never copies the accumulator (updated in its buffer, cleared
    by the emitting branch), and with Adam no array at all. (Lion's `mu` of
    the 5-entry bias is copied: XLA duplicates the loop that the dependency
    reads for so small a 1-D array; see `xla.read_token`.)"""
    params, xs, ys = _problem(1)
    tx = {"adam": optax.adam(1e-2), "lion": optax.lion(1e-3)}[inner]
    opt = optax_ext.MultiSteps(tx, K, axis_name="data")
    mesh = _data_mesh()
    specs = opt.state_specs()

    def step(params, state, x, y):
        updates, state = opt.update(_local_grads(params, x, y), state, params)
        return optax.apply_updates(params, updates), state

    sharded = jax.shard_map(
        step,
        mesh=mesh,
        in_specs=(P(), specs, P("data"), P("data")),
        out_specs=(P(), specs),
    )
    with jax.set_mesh(mesh):
        params, state = _deferred_init(opt, params, mesh)
        batch = NamedSharding(mesh, P("data"))
        x, y = jax.device_put(xs[0], batch), jax.device_put(ys[0], batch)
        hlo = jax.jit(sharded, donate_argnums=(0, 1)).lower(params, state, x, y)
        hlo = hlo.compile().as_text()
    entry, _, no_emit = _branches(hlo)
    copies = [
        line.split(" copy(")[0].split(" = ")[1]
        for line in (entry + "\n" + no_emit).splitlines()
        if re.search(r"\[\d[\d,]*\]\S* copy\(", line) and "broadcast" not in line
    ]
    # The accumulator is the only state with a leading device axis of 1.
    assert [shape for shape in copies if shape.startswith("f32[1,")] == []
    if inner == "adam":
        assert copies == []


@COMPILED
def test_optax_multisteps_needs_a_reduction_every_mini_step():
    """The contrast: optax.MultiSteps sees already-reduced gradients, so
    every mini-step all-reduces every gradient leaf."""
    params, xs, ys = _problem(1)
    mesh = _data_mesh()
    opt = optax.MultiSteps(optax.adam(1e-2), K)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, NamedSharding(mesh, P()))
        state = jax.jit(opt.init)(params)

        @jax.jit
        @jax.shard_map(
            mesh=mesh, in_specs=(P(), P(), P("data"), P("data")), out_specs=(P(), P())
        )
        def step(params, state, x, y):
            grads = lax.pmean(_local_grads(params, x, y), "data")
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        batch = NamedSharding(mesh, P("data"))
        hlo = (
            step.lower(
                params,
                state,
                jax.device_put(xs[0], batch),
                jax.device_put(ys[0], batch),
            )
            .compile()
            .as_text()
        )
    assert len(_all_reduces(hlo)) >= 1
    assert " conditional(" not in hlo or len(_all_reduces(_branches(hlo)[0])) >= 1


def test_replicated_gradients_are_rejected():
    """jax.grad with respect to replicated params inside shard_map already
    sums over the devices; averaging that again would be silently wrong."""
    params, xs, ys = _problem(1)
    mesh = _data_mesh()
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, axis_name="data")
    specs = opt.state_specs()
    with jax.set_mesh(mesh):
        params, state = _deferred_init(opt, params, mesh)

        @jax.shard_map(
            mesh=mesh, in_specs=(P(), specs, P("data"), P("data")), out_specs=specs
        )
        def step(params, state, x, y):
            return opt.update(jax.grad(_loss)(params, x, y), state, params)[1]

        batch = NamedSharding(mesh, P("data"))
        # the call that fixes it, as the installed JAX writes it
        fix = r"pcast\(params, 'data', to='varying'\)|pvary\(params, 'data'\)"
        with pytest.raises(ValueError, match=fix):
            jax.jit(step)(
                params,
                state,
                jax.device_put(xs[0], batch),
                jax.device_put(ys[0], batch),
            )


def test_replicated_zeros_for_a_frozen_leaf_are_refused_saying_what_to_do():
    """`jnp.zeros` for a frozen leaf, built inside `shard_map`, is the same
    on every device, as is a gradient `jax.grad` summed over them: while
    tracing the two cannot be told apart, and the error spoke only of the
    latter. It names the leaf and both ways out; zeros cast as varying, as
    it says, give sgd's step on the whole batch, the frozen leaf unmoved."""
    params, xs, ys = _problem(1)
    mesh = _data_mesh()
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 1, axis_name="data")
    specs = opt.state_specs()
    with jax.set_mesh(mesh):
        params, state = _deferred_init(opt, params, mesh)

        def step(cast):
            @jax.jit
            @jax.shard_map(in_specs=(P(), specs, P("data"), P("data")), out_specs=P())
            def run(params, state, x, y):
                frozen = jnp.zeros((5,))
                grads = dict(_local_grads(params, x, y), b1=cast(frozen))
                return opt.update(grads, state, params)[0]

            batch = NamedSharding(mesh, P("data"))
            x, y = jax.device_put(xs[0], batch), jax.device_put(ys[0], batch)
            return run(params, state, x, y)

        pcast = r"pcast\(zeros, 'data', to='varying'\)|pvary\(zeros, 'data'\)"
        with pytest.raises(
            ValueError,
            match=r"at \['b1'\] \(an array of shape \(5,\) and dtype float32\) is "
            r"the same on every device along 'data'(.|\n)*summed it over the "
            r"devices(.|\n)*`jnp.zeros` for a frozen leaf: pass `jax.lax.("
            + pcast
            + ")",
        ):
            step(lambda z: z)
        updates = step(_varying)
    want = dict(jax.grad(_loss)(jax.device_get(params), xs[0], ys[0]), b1=jnp.zeros(5))
    _assert_close(updates, jax.tree.map(jnp.negative, want))


def _varying_along(tree, axes):
    if hasattr(lax, "pcast"):  # jax >= 0.9
        return lax.pcast(tree, axes, to="varying")
    return lax.pvary(tree, axes)


@pytest.mark.parametrize("cast", [(), ("x",), ("y",), ("x", "y")])
def test_a_tuple_axis_name_checks_each_of_its_axes(cast):
    """`axis_name=("x", "y")`: gradients that `jax.grad` summed along either
    axis (no pcast there) are refused, naming the axes; they were taken,
    and the update was a sum over devices (2x, 4x or 8x sgd's step). Cast along
    both: sgd on the whole batch's gradient."""
    params, xs, ys = _problem(1)
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    opt = optax_ext.MultiSteps(optax.sgd(1.0), 1, axis_name=("x", "y"))
    specs = opt.state_specs()
    rows = P(("x", "y"))
    with jax.set_mesh(mesh):
        replicated = jax.device_put(params, NamedSharding(mesh, P()))
        init = jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs)
        state = jax.jit(init)(replicated)

        @jax.jit
        @jax.shard_map(mesh=mesh, in_specs=(P(), specs, rows, rows), out_specs=P())
        def step(params, state, x, y):
            own = _varying_along(params, cast) if cast else params
            return opt.update(jax.grad(_loss)(own, x, y), state, params)[0]

        batch = NamedSharding(mesh, rows)
        x, y = jax.device_put(xs[0], batch), jax.device_put(ys[0], batch)
        summed = {(): "('x', 'y')", ("x",): "'y'", ("y",): "'x'"}
        if cast in summed:
            with pytest.raises(
                ValueError,
                match=rf"same on every device along {re.escape(summed[cast])}",
            ):
                step(replicated, state, x, y)
            return
        updates = step(replicated, state, x, y)
    want = jax.grad(_loss)(params, xs[0], ys[0])
    _assert_close(updates, jax.tree.map(jnp.negative, want))


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_python_number_and_integer_leaves_with_axis_name(form):
    """A Python float leaf (`eqx.nn.Dropout`'s `p`) and an integer one get
    a `None` gradient, which `MultiSteps` fills with zeros: the same on
    every device, so the check for gradients already summed over the
    devices refused them. Reference: plain adam on the arrays' windows of
    the whole batch; the integer leaf and the float stay as they were."""
    params, xs, ys = _problem(2 * K)
    mesh = _data_mesh()
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, axis_name="data")
    specs = opt.state_specs()
    with jax.set_mesh(mesh):
        arrays = jax.device_put(
            dict(params, count=jnp.int32(3)), NamedSharding(mesh, P())
        )
        init = jax.shard_map(
            lambda a: opt.init(dict(a, scale=0.5)),
            mesh=mesh,
            in_specs=P(),
            out_specs=specs,
        )
        state = jax.jit(init)(arrays)

        @jax.jit
        @jax.shard_map(
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
        def step(arrays, state, x, y):
            full = dict(arrays, scale=0.5)
            floats = {name: arrays[name] for name in params}
            grads = dict(_local_grads(floats, x, y), count=None, scale=None)
            if form == "apply_gradients":
                new, state = optax_ext.apply_gradients(opt, grads, state, full)
            else:
                updates, state = opt.update(grads, state, full)
                assert updates["count"] is None and updates["scale"] is None
                new = {
                    name: p if updates[name] is None else p + updates[name]
                    for name, p in full.items()
                }
            assert new["scale"] == 0.5
            return {name: new[name] for name in arrays}, state

        batch = NamedSharding(mesh, P("data"))
        for x, y in zip(xs, ys, strict=True):
            arrays, state = step(
                arrays, state, jax.device_put(x, batch), jax.device_put(y, batch)
            )
    assert int(arrays.pop("count")) == 3
    _assert_close(arrays, _reference(optax.adam(1e-2), params, xs, ys))


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
def test_device_gradients_without_axis_name_are_rejected(form):
    """The data-parallel recipe with `axis_name` left out: each device's own
    gradients went into a state holding one accumulator for all, and tracing
    failed inside the conditional with a type mismatch naming neither. The
    error now names the axis and `axis_name`."""
    params, xs, ys = _problem(1)
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K)
    with pytest.raises(
        ValueError,
        match=r"differ between devices along \['data'\].*axis_name='data'",
    ):
        _train_deferred(opt, params, xs, ys, fused=form == "apply_gradients")


def test_axis_name_outside_its_axis_is_rejected():
    params, _, _ = _problem(1)
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, axis_name="data")
    with pytest.raises(NameError, match="inside `jax.shard_map`"):
        opt.init(params)
    state = jax.vmap(opt.init, axis_name="data", axis_size=2, in_axes=None)(params)
    with pytest.raises(NameError, match="state_specs"):
        opt.update(params, state, params)


def test_state_without_the_device_axis_is_rejected():
    params, _, _ = _problem(1)
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, axis_name="data")
    plain = optax_ext.MultiSteps(optax.adam(1e-2), K).init(params)

    def update(state):
        return opt.update(params, state, params)

    with pytest.raises(ValueError, match=r"leading axis of length 1.*\['b1'\]"):
        jax.vmap(update, axis_name="data", axis_size=2, in_axes=None)(plain)


MODEL_PARALLEL = {
    "MultiSteps": lambda: optax_ext.MultiSteps(optax.adam(1e-2), 2),
    "MultiSteps(lion)": lambda: optax_ext.MultiSteps(optax.lion(1e-3), 2),
    "skip_when": lambda: optax_ext.skip_when(optax.adam(1e-2)),
    "MultiSteps(skip_when)": lambda: optax_ext.MultiSteps(
        optax_ext.skip_when(optax.adam(1e-2)), 2
    ),
}
MODEL_PARALLEL_REFERENCE = {
    "MultiSteps": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
    "MultiSteps(lion)": lambda: optax.MultiSteps(optax.lion(1e-3), 2),
    "skip_when": lambda: optax.adam(1e-2),
    "MultiSteps(skip_when)": lambda: optax.MultiSteps(optax.adam(1e-2), 2),
}


@pytest.mark.parametrize("form", ["update", "apply_gradients"])
@pytest.mark.parametrize("name", MODEL_PARALLEL)
def test_params_sharded_over_a_manual_axis(name, form):
    """Inside a fully manual `jax.shard_map`, each device updating its own
    slice of the params (model parallel, no `axis_name`): the conditional's
    branches disagreed in type (the ordering token and the idle zero updates
    were the same on every device, the running branch's values not) and
    tracing failed. Reference: optax on one device with the whole params
    (every optimizer here acts elementwise)."""
    mesh = jax.make_mesh((N_DEVICES,), ("model",))
    spec = P("model")
    whole = {"w": jnp.linspace(-1.0, 2.0, 4 * N_DEVICES), "b": jnp.arange(8.0)}
    params = jax.device_put(whole, NamedSharding(mesh, spec))
    opt = MODEL_PARALLEL[name]()
    state_spec = jax.tree.map(
        lambda s: spec if s.ndim else P(),
        jax.eval_shape(opt.init, jax.tree.map(jnp.zeros_like, whole)),
    )
    extra = {"skip": jnp.asarray(False)} if "skip_when" in name else {}

    def loss(p):
        return jnp.sum(p["w"] ** 2 * jnp.cos(p["w"])) + jnp.sum(jnp.sin(p["b"]))

    @jax.jit
    @jax.shard_map(mesh=mesh, in_specs=(spec, state_spec), out_specs=(spec, state_spec))
    def step(p, s):
        g = jax.grad(loss)(p)
        if form == "apply_gradients":
            return optax_ext.apply_gradients(opt, g, s, p, **extra)
        updates, s = opt.update(g, s, p, **extra)
        return optax.apply_updates(p, updates), s

    state = jax.jit(
        jax.shard_map(opt.init, mesh=mesh, in_specs=spec, out_specs=state_spec)
    )(params)
    reference = MODEL_PARALLEL_REFERENCE[name]()
    want, want_state = whole, reference.init(whole)
    for _ in range(4):
        params, state = step(params, state)
        updates, want_state = reference.update(jax.grad(loss)(want), want_state, want)
        want = optax.apply_updates(want, updates)
    for key in whole:
        np.testing.assert_allclose(np.asarray(params[key]), want[key], rtol=1e-6)


def test_eager_init_of_explicit_sharded_params_needs_no_mesh_set():
    """optax's `init` takes params sharded over `Explicit` axes outside
    `jax.set_mesh`; `MultiSteps.init` failed there (JAX's `reshard` of its
    eager zeros asked for a mesh context). The accumulator and moments get
    the params' shardings, as optax's moments do."""
    params = _sharded_params(_mesh("Explicit"))
    state = optax_ext.MultiSteps(optax.adam(1e-3), 4).init(params)
    theirs = optax.adam(1e-3).init(params)
    for name, p in params.items():
        assert state.acc_grads[name].sharding == p.sharding, name
        mu = state.inner_opt_state[0].mu[name]
        assert mu.sharding == theirs[0].mu[name].sharding == p.sharding, name


def test_params_placed_as_the_step_returns_them_compile_it_once():
    """docs/data_parallel.md's placement: a `None` per dimension, as the
    data-parallel step returns the params, compiles the step once; `P()`
    (which the page once said would do) and single-device params compile
    it twice (JAX's jit cache tells `P(None, None)` from `P()`)."""
    params, xs, ys = _problem(3)
    mesh = _data_mesh()
    opt = optax_ext.MultiSteps(optax.adam(1e-2), K, axis_name="data")
    specs = opt.state_specs()
    per_dim = jax.tree.map(lambda x: NamedSharding(mesh, P(*[None] * x.ndim)), params)
    placements = {
        "per dimension": per_dim,
        "P()": NamedSharding(mesh, P()),
        "one device": None,  # as made: uncommitted, on the default device
    }
    compiles = {}
    batch = NamedSharding(mesh, P("data"))
    for name, placement in placements.items():
        p = params if placement is None else jax.device_put(params, placement)
        init = jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs)
        state = jax.jit(init)(p)

        @jax.jit
        @jax.shard_map(
            mesh=mesh,
            in_specs=(P(), specs, P("data"), P("data")),
            out_specs=(P(), specs),
        )
        def step(params, state, x, y):
            updates, state = opt.update(_local_grads(params, x, y), state, params)
            return optax.apply_updates(params, updates), state

        for x, y in zip(xs, ys, strict=True):
            p, state = step(
                p, state, jax.device_put(x, batch), jax.device_put(y, batch)
            )
        compiles[name] = step._cache_size()
    assert compiles == {"per dimension": 1, "P()": 2, "one device": 2}
