"""Records the golden outputs of `tests/_golden_cases.py` for the installed
JAX, into `tests/data/golden/jax-<version>-jaxlib-<version>/`: the inputs,
one compressed `.npz` per group of cases (every recorded array's bits) and
`manifest.json` (versions, XLA flags, the commit recorded at).

Record from a clean checkout of the commit whose behaviour is the
reference (docs/contributing.md, "Golden outputs"):

    WT=$(mktemp -d) && git worktree add "$WT" HEAD
    cd "$WT" && PYTHONPATH="$WT" \\
        /path/to/repo/.venv/bin/python tests/data/golden/make_golden.py

(and with `.venv-newest`), then copy the new `jax-*` directories back.
The single-device groups are recorded in a process with one CPU device
and the multi-device ones in a process with 8, each with the test suite's
XLA settings (`tests/conftest.py` is imported before JAX starts), as
`tests/test_golden.py` runs them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent.parent
MULTIDEVICE_FLAG = "--xla_force_host_platform_device_count=8"


def _relative(path: pathlib.Path, root: pathlib.Path) -> str:
    """`path` relative to `root` where it lies inside it (no machine path
    in a committed record), else as it is."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _child(devices: int, out: pathlib.Path) -> None:
    """Records the groups of `devices` devices into `out`; prints what ran."""
    if devices > 1:
        os.environ["XLA_FLAGS"] = (
            f"{os.environ.get('XLA_FLAGS', '')} {MULTIDEVICE_FLAG}".strip()
        )
    sys.path.insert(0, str(TESTS))
    import conftest  # noqa: F401  (the suite's XLA settings, before JAX starts)

    assert conftest.MULTIDEVICE_FLAG == MULTIDEVICE_FLAG
    import _golden_cases as golden
    import jax
    import numpy as np

    import optax_ext

    assert jax.default_backend() == "cpu", jax.default_backend()
    assert jax.device_count() == devices, jax.device_count()
    if devices == 1:
        np.savez_compressed(out / "inputs.npz", **golden.make_inputs())
    inputs = golden.load_inputs(out)
    for group, names in golden.groups(multidevice=devices > 1).items():
        encoded = {}
        for name in names:
            print(f"  {name}", file=sys.stderr, flush=True)
            encoded[name] = golden.encode(name, golden.CASES[name].run(inputs))
            # What the test reads back is what was recorded.
            golden.save_group(out / "check.npz", {name: encoded[name]})
            back = golden.load_case(out / "check.npz", name)
            assert all(np.array_equal(back[k], v) for k, v in encoded[name].items())
        (out / "check.npz").unlink()
        golden.save_group(out / f"{group}.npz", encoded)
    print(
        json.dumps(
            {
                "optax_ext": optax_ext.__file__,
                "xla_flags": os.environ.get("XLA_FLAGS", ""),
                "xla_flags_compared": golden.xla_flags(),
                "groups": golden.groups(multidevice=devices > 1),
            }
        )
    )


def _git(args: list[str], cwd: pathlib.Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    names = ["jax", "jaxlib", "optax", "numpy", "ml_dtypes"]
    return {n: version(n) for n in names} | {"python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="record although optax_ext/ has uncommitted changes",
    )
    args = parser.parse_args()
    if args.child:
        _child(args.child, args.out)
        return

    versions = _versions()
    out = HERE / f"jax-{versions['jax']}-jaxlib-{versions['jaxlib']}"
    out.mkdir(exist_ok=True)
    for old in out.glob("*"):
        old.unlink()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for name in ("XLA_FLAGS", "OPTAX_EXT_XLA_DEFAULTS", "OPTAX_EXT_DEVICELESS"):
        env.pop(name, None)
    runs: dict[int, dict] = {}
    for devices in (1, 8):
        print(f"recording on {devices} device(s):", file=sys.stderr, flush=True)
        result = subprocess.run(
            [sys.executable, __file__, "--child", str(devices), "--out", str(out)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        runs[devices] = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs[1]["xla_flags_compared"] == runs[8]["xla_flags_compared"], runs

    package = pathlib.Path(runs[1]["optax_ext"]).parent
    repo = pathlib.Path(_git(["rev-parse", "--show-toplevel"], package))
    # The package recorded; the case definitions may be new (not yet in git).
    dirty = _git(["status", "--porcelain", "--", "optax_ext", "pyproject.toml"], repo)
    if dirty and not args.allow_dirty:
        sys.exit(f"{repo} has uncommitted changes:\n{dirty}\nrecord from a clean tree")
    files = {
        p.name: {
            "bytes": p.stat().st_size,
            "sha256": hashlib.sha256(p.read_bytes()).hexdigest(),
        }
        for p in sorted(out.glob("*.npz"))
    }
    manifest = {
        "versions": versions,
        # What the test compares (without the device count), then as set.
        "xla_flags": runs[1]["xla_flags_compared"],
        "xla_flags_by_process": {f"{d} device(s)": runs[d]["xla_flags"] for d in runs},
        "commit": _git(["rev-parse", "HEAD"], repo),
        "uncommitted_changes": dirty,
        # The package recorded, relative to the checkout recorded from.
        "package": _relative(package, repo),
        "cases": runs[1]["groups"] | runs[8]["groups"],
        "files": files,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(f["bytes"] for f in files.values())
    print(f"wrote {out} ({total} bytes of npz)", file=sys.stderr)


if __name__ == "__main__":
    main()
