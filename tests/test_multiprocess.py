"""Two processes x two CPU devices, joined by `jax.distributed`, train as one
process does on the whole batch.

The test starts this file twice as a script (`python test_multiprocess.py
PROCESS_ID PORT OUT`), with `XLA_FLAGS` giving each process 2 CPU devices and
gloo as the CPU collectives. Each process feeds only its own rows, through
`jax.make_array_from_process_local_data`, to two training loops:

- the deferred step of docs/data_parallel.md: `MultiSteps(adam, K,
  axis_name="data")` inside `jax.shard_map`, one mini-step per micro-batch;
- `microbatched(jax.grad(loss), K)` under `jax.jit` on the whole batch (its
  data axis read from the batch's `Explicit` sharding), then adam.

and the same two with the params split over all 4 devices (FSDP / ZeRO-3
style, under plain `jax.jit`): `MultiSteps(adam, K)` one jitted, donated
mini-step per micro-batch (drop-in `update` + `apply_updates`, and the fused
`apply_gradients`), and `microbatched` (which then runs its loop under the
partitioner).

All must give the params of adam on the whole batch's gradient, computed here
in one process on one device.
"""

from __future__ import annotations

import functools
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
K = 4  # micro-batches per optimizer step
ROWS = 8  # rows per micro-batch, over all devices (2 per device)
WINDOWS = 3  # optimizer steps
LR = 1e-2
IN, HIDDEN = 8, 16


def data():
    """The same global data and initial params in every process."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(WINDOWS, K * ROWS, IN)).astype(np.float32)
    y = rng.normal(size=(WINDOWS, K * ROWS)).astype(np.float32)
    params = {
        "w": (rng.normal(size=(IN, HIDDEN)) / np.sqrt(IN)).astype(np.float32),
        "b": np.zeros(HIDDEN, np.float32),
        "v": (rng.normal(size=(HIDDEN,)) / np.sqrt(HIDDEN)).astype(np.float32),
    }
    return x, y, params


def loss(params, batch):
    x, y = batch
    hidden = jnp.tanh(x @ params["w"] + params["b"])
    return jnp.mean((hidden @ params["v"] - y) ** 2)


def _child(process_id: int, port: int, out: str) -> None:
    import optax_ext

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", NUM_PROCESSES, process_id)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    assert jax.device_count() == NUM_PROCESSES * DEVICES_PER_PROCESS
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rows = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    x, y, params0 = data()

    def local(batch):
        """This process's rows of a global batch, as one sharded array."""
        size = batch[0].shape[0]
        starts = [
            idx[0].start or 0
            for idx in rows.addressable_devices_indices_map((size,)).values()
        ]
        start, stop = min(starts), max(starts) + size // jax.device_count()
        return tuple(
            jax.make_array_from_process_local_data(rows, b[start:stop]) for b in batch
        )

    def everywhere(tree):
        return jax.tree.map(
            lambda a: jax.make_array_from_process_local_data(replicated, a), tree
        )

    def to_host(tree):
        return {k: np.asarray(v.addressable_data(0)) for k, v in tree.items()}

    results = {}
    with jax.set_mesh(mesh):
        # The deferred step of docs/data_parallel.md: one mini-step per
        # micro-batch, one all-reduce per window.
        opt = optax_ext.MultiSteps(optax.adam(LR), K, axis_name="data")
        specs = opt.state_specs()
        params = everywhere(params0)
        state = jax.jit(
            jax.shard_map(opt.init, mesh=mesh, in_specs=P(), out_specs=specs)
        )(params)

        @jax.jit
        @functools.partial(
            jax.shard_map,
            mesh=mesh,
            in_specs=(P(), specs, P("data")),
            out_specs=(P(), specs),
        )
        def mini_step(params, state, batch):
            if hasattr(jax.lax, "pcast"):
                varying = jax.lax.pcast(params, "data", to="varying")
            else:  # jax < 0.9
                varying = jax.lax.pvary(params, "data")
            grads = jax.grad(loss)(varying, batch)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for t in range(WINDOWS):
            for j in range(K):  # micro-batch j: rows j, j + K, ...
                params, state = mini_step(
                    params, state, local((x[t, j::K], y[t, j::K]))
                )
        results["multi_steps"] = to_host(params)

        # microbatched on the whole batch, under plain jit.
        adam = optax.adam(LR)
        grad_fn = optax_ext.microbatched(jax.grad(loss), K)

        @jax.jit
        def step(params, adam_state, batch):
            grads = grad_fn(params, batch)
            updates, adam_state = adam.update(grads, adam_state, params)
            return optax.apply_updates(params, updates), adam_state

        params = everywhere(params0)
        adam_state = jax.jit(adam.init)(params)
        for t in range(WINDOWS):
            params, adam_state = step(params, adam_state, local((x[t], y[t])))
        results["microbatched"] = to_host(params)

    for mode in ("Auto", "Explicit"):
        results.update(_fsdp_runs(mode, local, to_host, x, y, params0))

    np.savez(out, **{f"{k}.{n}": v for k, p in results.items() for n, v in p.items()})
    jax.distributed.shutdown()


def gathered_loss(params, batch):
    """`loss` with the params gathered where the forward pass uses them, as
    a model written for FSDP under `Explicit` axes does (JAX will not guess
    the sharding of `x @ w` with `w` split on the contracted axis)."""
    from jax.sharding import PartitionSpec as P

    params = jax.tree.map(lambda a: jax.sharding.reshard(a, P()), params)
    return loss(params, batch)


def _fsdp_runs(mode, local, to_host, x, y, params0) -> dict:
    """The FSDP loops on a mesh of `mode` axes: MultiSteps (drop-in and
    fused) one mini-step per micro-batch, and microbatched on the whole
    batch, with every params leaf split on its first axis over all 4
    devices under plain `jax.jit`."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    import optax_ext

    mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(getattr(AxisType, mode),)
    )
    split = NamedSharding(mesh, P("data"))
    loss_fn = gathered_loss if mode == "Explicit" else loss

    def fsdp(tree):
        return {
            k: jax.make_array_from_callback(v.shape, split, lambda i, v=v: v[i])
            for k, v in tree.items()
        }

    def batch(b):
        return tuple(jax.device_put(a, split) for a in local(b))

    def to_host_whole(tree):
        for v in tree.values():
            assert v.sharding.is_equivalent_to(split, v.ndim), v.sharding
        replicated = NamedSharding(mesh, P())
        return to_host(jax.jit(lambda t: t, out_shardings=replicated)(tree))

    results = {}
    with jax.set_mesh(mesh):
        for form in ("update", "apply_gradients"):
            opt = optax_ext.MultiSteps(optax.adam(LR), K)

            @functools.partial(jax.jit, donate_argnums=(0, 1))
            def mini_step(params, state, batch, opt=opt, form=form):
                grads = jax.grad(loss_fn)(params, batch)
                if form == "apply_gradients":
                    return optax_ext.apply_gradients(opt, grads, state, params)
                updates, state = opt.update(grads, state, params)
                return optax.apply_updates(params, updates), state

            params = fsdp(params0)
            state = jax.jit(opt.init)(params)
            for t in range(WINDOWS):
                for j in range(K):
                    params, state = mini_step(
                        params, state, batch((x[t, j::K], y[t, j::K]))
                    )
            results[f"fsdp_{mode}_multi_steps_{form}"] = to_host_whole(params)

        adam = optax.adam(LR)
        grad_fn = optax_ext.microbatched(jax.grad(loss_fn), K)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(params, adam_state, batch):
            grads = grad_fn(params, batch)
            updates, adam_state = adam.update(grads, adam_state, params)
            return optax.apply_updates(params, updates), adam_state

        params = fsdp(params0)
        adam_state = jax.jit(adam.init)(params)
        for t in range(WINDOWS):
            params, adam_state = step(params, adam_state, batch((x[t], y[t])))
        results[f"fsdp_{mode}_microbatched"] = to_host_whole(params)
    return results


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _reference() -> dict:
    """Adam on the whole batch's gradient, one process, one device."""
    x, y, params = data()
    adam = optax.adam(LR)
    state = adam.init(params)
    for t in range(WINDOWS):
        grads = jax.grad(loss)(params, (x[t], y[t]))
        updates, state = adam.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(np.asarray, params)


def test_two_processes_train_as_one_process_on_the_whole_batch(tmp_path):
    port = _free_port()
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    env["JAX_PLATFORMS"] = "cpu"
    root = str(pathlib.Path(__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    outs = [tmp_path / f"process{i}.npz" for i in range(NUM_PROCESSES)]
    procs = []
    try:
        for i in range(NUM_PROCESSES):
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, str(i), str(port), str(outs[i])],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
        assert p.returncode == 0, f"process {i} exited {p.returncode}:\n{log[-6000:]}"
    reference = _reference()
    for i, out in enumerate(outs):
        got = np.load(out)
        forms = ["multi_steps", "microbatched"] + [
            f"fsdp_{mode}_{form}"
            for mode in ("Auto", "Explicit")
            for form in (
                "multi_steps_update",
                "multi_steps_apply_gradients",
                "microbatched",
            )
        ]
        assert sorted(forms) == sorted({k.split(".")[0] for k in got.files})
        for form in forms:
            for name, want in reference.items():
                np.testing.assert_allclose(
                    got[f"{form}.{name}"],
                    want,
                    rtol=1e-6,
                    atol=1e-6,
                    err_msg=f"process {i}, {form}, params[{name!r}]",
                )
        # Adam moved the params well beyond the tolerance: a process that
        # trained on its own rows only would not pass.
        assert np.abs(got["microbatched.w"] - data()[2]["w"]).max() > 1e-2
        assert np.abs(got["fsdp_Auto_microbatched.w"] - data()[2]["w"]).max() > 1e-2


if __name__ == "__main__":
    _child(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
