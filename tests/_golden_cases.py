"""The golden cases: small training runs whose every output is recorded, bit
for bit, by `tests/data/golden/make_golden.py` and checked against today's
code by `tests/test_golden.py` (docs/contributing.md, "Golden outputs").

Each case runs as users run it (the step jitted once, then called on every
step) and returns its records: every step's params, the drop-in's updates,
and every leaf of the state (counters, `acc_grads`, `acc_weight`,
`skip_state`, the inner optimizer's state), the initial state too. The
inputs (params, gradients, batches) come from `inputs.npz` beside the
recording, so that the bits do not depend on NumPy's random streams.

The generator and the test share this module and the suite's XLA settings
(`tests/conftest.py`: XLA:CPU at -O0), so both produce the same program.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_ext

DATA = pathlib.Path(__file__).parent / "data" / "golden"
DEVICES = 8
STEPS = 9  # 3 windows of k = 3
K = 3
SHAPES = {"w": (3, 5), "b": (5,)}
# Per step, on one device: uneven weights with zeros (the last window's
# sum to 0); skip flags (a skipped step delays the first window's end); the
# step whose gradient holds a NaN for `optax.skip_not_finite`.
WEIGHTS = [3, 0, 5, 2, 7, 1, 0, 0, 0]
SKIPS = [False, False, True, False, True, False, False, False, True]
NAN_STEP = 4
# Host-chosen window ends for `emit=`: windows of 2, 3, 1 and 3 mini-steps.
EMITS = [False, True, False, False, True, True, False, False, True]
BATCH = 32  # rows per batch of `microbatched`, cut into MICRO micro-batches
MICRO = 4
BATCHES = 3
INNERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
    "lion": lambda: optax.lion(1e-3, weight_decay=1e-2),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


# ---------------------------------------------------------------- records


def _path(path) -> str:
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return "/".join(parts)


def _record(records: dict, prefix: str, tree) -> None:
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    if not leaves:
        records[f"{prefix}:empty"] = np.zeros((0,), np.uint8)
    for path, leaf in leaves:
        records[f"{prefix}/{_path(path)}"] = np.asarray(jax.device_get(leaf))


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def encode(case: str, records: dict) -> dict[str, np.ndarray]:
    """`case/record|dtype` -> the record's bits as unsigned integers (a
    bfloat16 as uint16), so that NaNs and -0.0 compare exactly."""
    return {
        f"{case}/{key}|{value.dtype.name}": value.view(_UINT[value.dtype.itemsize])
        for key, value in records.items()
    }


def pack(encoded: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One case's records as two arrays (a few thousand small arrays in an
    `.npz` would take more room in headers than in data): their bytes one
    after the other, and a JSON index of names and shapes."""
    index = [[key, list(bits.shape)] for key, bits in encoded.items()]
    data = b"".join(np.ascontiguousarray(bits).tobytes() for bits in encoded.values())
    return {
        "bytes": np.frombuffer(data, np.uint8),
        "index": np.array(json.dumps(index)),
    }


def unpack(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    data, out, offset = packed["bytes"], {}, 0
    for key, shape in json.loads(str(packed["index"])):
        uint = np.dtype(_UINT[np.dtype(key.rpartition("|")[2]).itemsize])
        size = int(np.prod(shape, dtype=np.int64)) * uint.itemsize
        out[key] = data[offset : offset + size].view(uint).reshape(shape)
        offset += size
    assert offset == data.size, (offset, data.size)
    return out


def save_group(path: pathlib.Path, encoded: dict[str, dict[str, np.ndarray]]) -> None:
    """`encoded`: each case's `encode`d records."""
    arrays = {}
    for case, records in encoded.items():
        for part, array in pack(records).items():
            arrays[f"{case}.{part}"] = array
    np.savez_compressed(path, **arrays)


def load_case(path: pathlib.Path, case: str) -> dict[str, np.ndarray]:
    with np.load(path) as data:
        if f"{case}.bytes" not in data.files:
            return {}
        return unpack({part: data[f"{case}.{part}"] for part in ("bytes", "index")})


# ----------------------------------------------------------------- inputs


def make_inputs() -> dict[str, np.ndarray]:
    """The float32 inputs every case reads (saved once, with the recording)."""
    rng = np.random.default_rng(5021)
    inputs = {}
    for name, shape in SHAPES.items():
        inputs[f"params/{name}"] = rng.normal(size=shape).astype(np.float32)
        inputs[f"grads/{name}"] = rng.normal(size=(STEPS, *shape)).astype(np.float32)
        inputs[f"device_grads/{name}"] = rng.normal(
            size=(STEPS, DEVICES, *shape)
        ).astype(np.float32)
    # Each device's weight per step: uneven, device 5's always 0, step 4's
    # 0 on every device, and the last window's sum 0.
    weights = rng.integers(0, 9, size=(STEPS, DEVICES)).astype(np.int32)
    weights[:, 5] = 0
    weights[4] = 0
    weights[6:] = 0
    inputs["device_weights"] = weights
    inputs["x"] = rng.normal(size=(BATCHES, BATCH, SHAPES["w"][0])).astype(np.float32)
    inputs["y"] = rng.normal(size=(BATCHES, BATCH)).astype(np.float32)
    # Token masks: micro-batch j is rows j, j + MICRO, ...; in the first
    # batch micro-batch 1 holds no token.
    mask = (rng.random((BATCHES, BATCH)) < 0.7).astype(np.int32)
    mask[0, 1::MICRO] = 0
    inputs["mask"] = mask
    return inputs


def _params(inputs, dtype):
    return {n: jnp.asarray(inputs[f"params/{n}"], DTYPES[dtype]) for n in SHAPES}


def _grads(inputs, step, dtype, nan=False):
    grads = {n: jnp.asarray(inputs[f"grads/{n}"][step], DTYPES[dtype]) for n in SHAPES}
    if nan and step == NAN_STEP:
        grads["w"] = grads["w"].at[1, 2].set(jnp.nan)
    return grads


# ------------------------------------------------------------ the steps


def _drop_in(opt):
    @jax.jit
    def step(params, state, grads, extra):
        updates, state = opt.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), updates, state

    return step


def _fused(opt, emit=None):
    @functools.partial(jax.jit, static_argnames="emit")
    def step(params, state, grads, extra, emit=None):
        params, state = optax_ext.apply_gradients(
            opt, grads, state, params, emit=emit, **extra
        )
        return params, None, state

    if emit is None:
        return step
    return lambda *args: step(*args, emit=bool(emit))


def _extra(form, step):
    """The extra arguments of step `step` of a case's `form`."""
    extra = {}
    if "weight" in form:
        extra["weight"] = np.int32(WEIGHTS[step])
    if "skip" in form:
        extra["skip"] = np.bool_(SKIPS[step])
    return extra


def _train(opt, inputs, dtype, form, nan=False):
    """`STEPS` steps of `opt` on one device in `form` ("update" or "fused",
    with "+emit", "+weight", "+skip"): the records of every step."""
    params = _params(inputs, dtype)
    state = opt.init(params)
    records = {}
    _record(records, "init/state", state)
    fused = form.startswith("fused")
    steps = {None: _drop_in(opt)} if not fused else {None: _fused(opt)}
    if "emit" in form:
        steps = {e: _fused(opt, emit=e) for e in (False, True)}
    for s in range(STEPS):
        step = steps[EMITS[s] if "emit" in form else None]
        grads = _grads(inputs, s, dtype, nan)
        params, updates, state = step(params, state, grads, _extra(form, s))
        _record(records, f"{s}/params", params)
        if not fused:
            _record(records, f"{s}/updates", updates)
        _record(records, f"{s}/state", state)
    return records


# ------------------------------------------------------------ the cases


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str
    run: Callable[[dict], dict]
    multidevice: bool = False


CASES: dict[str, Case] = {}


def _case(group, name, run, multidevice=False):
    assert name not in CASES, name
    CASES[name] = Case(name, group, run, multidevice)


def _schedule(step):
    return 2 + step % 2


def _ms(**kwargs):
    return lambda opt: optax_ext.MultiSteps(opt, K, **kwargs)


# The optimizer of each variant, around the inner one.
WRAPS = {
    "": _ms(),
    "sum": _ms(use_grad_mean=False),
    "schedule": lambda opt: optax_ext.MultiSteps(opt, _schedule),
    "acc_none": _ms(accumulator_dtype=None),
    "weighted": _ms(weighted=True),
    "weighted-acc_none": _ms(weighted=True, accumulator_dtype=None),
    "nested": lambda opt: optax_ext.MultiSteps(optax_ext.MultiSteps(opt, 2), 2),
    "nested-schedule": lambda opt: optax_ext.MultiSteps(
        optax_ext.MultiSteps(opt, 2), _schedule
    ),
    "skip_outside": lambda opt: optax_ext.skip_when(_ms()(opt)),
    "skip_inside": lambda opt: _ms()(optax_ext.skip_when(opt)),
    "skip_not_finite": _ms(should_skip_update_fn=optax.skip_not_finite),
}
# (group, form, inner, dtype, variant) for each form: "update" (the
# drop-in), "fused" (apply_gradients); "+emit", "+weight", "+skip": the
# extra arguments each step passes.
TABLE = [
    *(("dropin", "update", inner, "f32", "") for inner in INNERS),
    ("dropin", "update", "adamw", "f32", "sum"),
    *(("fused", "fused", inner, "f32", "") for inner in INNERS),
    *(
        (group, form, inner, dtype, variant)
        for group, form in (("dropin", "update"), ("fused", "fused"))
        for inner, dtype, variant in (
            ("adamw", "f32", "schedule"),
            ("adamw", "bf16", ""),
            ("adamw", "bf16", "acc_none"),
            ("lion", "bf16", ""),
            ("lion", "bf16", "acc_none"),
        )
    ),
    *(
        (group, form + extra, inner, dtype, variant)
        for form in ("update", "fused")
        for group, extra, inner, dtype, variant in (
            ("weighted", "+weight", "adamw", "f32", "weighted"),
            ("weighted", "+weight", "lion", "bf16", "weighted"),
            ("weighted", "+weight", "adamw", "bf16", "weighted-acc_none"),
            ("nested", "", "adamw", "f32", "nested"),
            ("nested", "", "lion", "bf16", "nested-schedule"),
            ("skip", "+skip", "adamw", "f32", "skip_outside"),
            ("skip", "+skip", "adamw", "f32", "skip_inside"),
            ("skip", "", "adamw", "f32", "skip_not_finite"),
            ("skip", "", "lion", "bf16", "skip_not_finite"),
        )
    ),
    ("emit", "fused+emit", "sgd", "f32", ""),
    ("emit", "fused+emit", "adamw", "f32", ""),
    ("emit", "fused+emit", "lion", "bf16", ""),
    ("emit", "fused+emit+weight", "adamw", "f32", "weighted"),
    ("emit", "fused+emit+skip", "adamw", "bf16", "skip_inside"),
]


def _single_device_cases():
    for group, form, inner, dtype, variant in TABLE:

        def run(inputs, form=form, inner=inner, dtype=dtype, variant=variant):
            opt = WRAPS[variant](INNERS[inner]())
            nan = variant == "skip_not_finite"
            return _train(opt, inputs, dtype, form, nan=nan)

        name = "-".join(x for x in (form, inner, dtype, variant) if x)
        _case(group, name, run)
    for kind, dtype, kwargs in (
        ("mean", "f32", {}),
        ("weight_fn", "f32", {}),
        ("weight_fn", "bf16", {}),
        ("weight_fn", "bf16", {"accumulator_dtype": None}),
    ):
        run = functools.partial(
            _microbatched, dtype=dtype, weighted=kind == "weight_fn", **kwargs
        )
        suffix = "-acc_none" if kwargs else ""
        _case("microbatched", f"microbatched-{kind}-{dtype}{suffix}", run)


# ---------------------------------------------------------- microbatched


def _loss(params, batch):
    x, y, mask = batch
    pred = jnp.sum(jnp.tanh(x @ params["w"] + params["b"]), axis=-1)
    err = ((pred - y) ** 2).astype(jnp.float32)
    return jnp.sum(err * mask) / jnp.maximum(jnp.sum(mask), 1)


def _batch(inputs, i, dtype):
    return (
        jnp.asarray(inputs["x"][i], DTYPES[dtype]),
        jnp.asarray(inputs["y"][i], DTYPES[dtype]),
        jnp.asarray(inputs["mask"][i]),
    )


def _microbatched(inputs, dtype, weighted, axis_name=None, **kwargs):
    """`BATCHES` adamw steps on `microbatched(value_and_grad(loss), MICRO)`'s
    loss and gradients (a token mean: each batch's mask, or every row)."""
    weight_fn = (lambda p, b: jnp.sum(b[2])) if weighted else None
    grad_fn = optax_ext.microbatched(
        jax.value_and_grad(_loss),
        MICRO,
        weight_fn=weight_fn,
        axis_name=axis_name,
        **kwargs,
    )
    opt = INNERS["adamw"]()

    def train_step(params, state, batch):
        if not weighted:  # every row counts
            batch = (batch[0], batch[1], jnp.ones_like(batch[2]))
        if axis_name is None:
            loss, grads = grad_fn(params, batch)
        else:
            loss, grads = jax.shard_map(
                grad_fn, in_specs=(P(), P(axis_name)), out_specs=P()
            )(params, batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, grads

    step = jax.jit(train_step)
    params = _params(inputs, dtype)
    state = opt.init(params)
    records = {}
    for i in range(BATCHES):
        batch = _batch(inputs, i, dtype)
        if axis_name is not None:
            batch = jax.device_put(batch, NamedSharding(_mesh(), P(axis_name)))
        params, state, loss, grads = step(params, state, batch)
        _record(records, f"{i}/loss", loss)
        _record(records, f"{i}/grads", grads)
        _record(records, f"{i}/params", params)
        _record(records, f"{i}/state", state)
    return records


# ------------------------------------------------------------ 8 devices


def _mesh():
    return jax.make_mesh((DEVICES,), ("data",))


def _train_on_devices(opt, inputs, dtype, form):
    """`_train` inside `jax.shard_map` on 8 devices, with `axis_name`: each
    device's own gradients (and weights) per step."""
    mesh = _mesh()
    specs = opt.state_specs()
    weighted = "weight" in form

    def body(params, state, grads, weight, emit):
        grads = jax.tree.map(lambda g: g[0], grads)
        extra = {"weight": weight[0]} if weighted else {}
        if form.startswith("fused"):
            params, state = optax_ext.apply_gradients(
                opt, grads, state, params, emit=emit, **extra
            )
            return params, params, state
        updates, state = opt.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), updates, state

    def compile_step(emit):
        return jax.jit(
            jax.shard_map(
                functools.partial(body, emit=emit),
                mesh=mesh,
                in_specs=(P(), specs, P("data"), P("data")),
                out_specs=(P(), P(), specs),
            )
        )

    emits = (False, True) if "emit" in form else (None,)
    steps = {e: compile_step(e) for e in emits}
    records = {}
    with jax.set_mesh(mesh):
        split = NamedSharding(mesh, P("data"))
        params = jax.device_put(_params(inputs, dtype), NamedSharding(mesh, P()))
        init = jax.jit(
            jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs)
        )
        state = init(params)
        _record(records, "init/state", state)
        for s in range(STEPS):
            grads = {
                n: jnp.asarray(inputs[f"device_grads/{n}"][s], DTYPES[dtype])
                for n in SHAPES
            }
            weight = inputs["device_weights"][s]
            step = steps[EMITS[s] if "emit" in form else None]
            params, updates, state = step(
                params,
                state,
                jax.device_put(grads, split),
                jax.device_put(weight, split),
            )
            _record(records, f"{s}/params", params)
            if not form.startswith("fused"):
                _record(records, f"{s}/updates", updates)
            _record(records, f"{s}/state", state)
    return records


def _device_case(form, inner, dtype, variant="", **kwargs):
    def run(inputs):
        opt = optax_ext.MultiSteps(INNERS[inner](), K, axis_name="data", **kwargs)
        return _train_on_devices(opt, inputs, dtype, form)

    name = "-".join(x for x in ("devices", form, inner, dtype, variant) if x)
    _case("devices", name, run, multidevice=True)


def _device_cases():
    for form in ("update", "fused"):
        _device_case(form, "adamw", "f32")
        _device_case(form, "lion", "bf16")
        _device_case(f"{form}+weight", "adamw", "f32", weighted=True)
        _device_case(
            f"{form}+weight",
            "sgd",
            "bf16",
            "acc_none",
            weighted=True,
            accumulator_dtype=None,
        )
    _device_case("fused+emit+weight", "adamw", "f32", weighted=True)

    def microbatched_run(inputs, **kwargs):
        with jax.set_mesh(_mesh()):
            return _microbatched(inputs, axis_name="data", **kwargs)

    for weighted in (False, True):
        kind = "weight_fn" if weighted else "mean"
        _case(
            "devices",
            f"devices-microbatched-{kind}-f32",
            functools.partial(microbatched_run, dtype="f32", weighted=weighted),
            multidevice=True,
        )


_single_device_cases()
_device_cases()


def groups(multidevice: bool) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for case in CASES.values():
        if case.multidevice == multidevice:
            out.setdefault(case.group, []).append(case.name)
    return out


# -------------------------------------------------------- the recording


def versions() -> dict[str, str]:
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def recording_dir() -> pathlib.Path:
    """Where this JAX's recording lives (whether or not there is one)."""
    return DATA / f"jax-{jax.__version__}-jaxlib-{versions()['jaxlib']}"


def recorded_versions() -> list[str]:
    return sorted(p.name for p in DATA.glob("jax-*") if (p / "manifest.json").exists())


def skip_reason() -> str | None:
    """Why the recorded bits cannot be checked in this process (or in the
    8-device child it starts with its own XLA flags), or None: they are
    checked with the JAX, jaxlib and XLA flags they were recorded with.
    Another XLA may legitimately give other bits, and so does another LLVM
    level: XLA:CPU at its default level rounds some results differently
    from the suite's -O0 (`tests/conftest.py`). The backend is the test's
    to check."""
    here = versions()
    if not (recording_dir() / "manifest.json").exists():
        return (
            f"no golden recording for jax {here['jax']} / jaxlib {here['jaxlib']} "
            f"(recorded: {', '.join(recorded_versions()) or 'none'}); "
            "tests/data/golden/make_golden.py records one"
        )
    recorded = manifest()["xla_flags"]
    if xla_flags() != recorded:
        return (
            f"recorded with XLA_FLAGS {' '.join(recorded) or '(none)'}, "
            f"running with {' '.join(xla_flags()) or '(none)'}: XLA:CPU's "
            "bits depend on its LLVM level"
        )
    return None


def multidevice_skips() -> int:
    """How many golden tests the 8-device child skips (its JAX and flags
    are this process's): for `tests/test_multidevice_runner.py`."""
    return len(groups(multidevice=True).get("devices", [])) if skip_reason() else 0


def manifest() -> dict:
    return json.loads((recording_dir() / "manifest.json").read_text())


def load_inputs(directory: pathlib.Path | None = None) -> dict[str, np.ndarray]:
    with np.load((directory or recording_dir()) / "inputs.npz") as data:
        return {k: data[k] for k in data.files}


def xla_flags() -> list[str]:
    """The XLA flags in force, sorted, without the device count."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return sorted(f for f in flags if "force_host_platform_device_count" not in f)
