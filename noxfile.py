"""Developer tasks. Run `nox -l` to list the sessions, `nox -s NAME` to run one."""

import os
import pathlib
import sys

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # nox itself depends on tomli before Python 3.11
    import tomli as tomllib

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck", "docs"]

# The oldest Python the package supports (jax >= 0.8.1 needs 3.11), and the
# newest one the `newest` session tests with the newest JAX.
PYTHON = "3.11"
NEWEST_PYTHON = "3.13"
LINT_PATHS = ["optax_ext", "tests", "examples", "benchmarks", "noxfile.py"]
# Packages whose lowest declared version the `minversions` session pins.
MIN_PINNED = ["jax", "jaxlib", "optax", "equinox", "chex"]
# CPU unless the caller sets JAX_PLATFORMS (`cuda` for a GPU: README).
TEST_ENV = {"JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}


def _run_tests(session: nox.Session, xla_defaults: bool = False) -> None:
    """The README test command. It runs the multi-device tests too, once, in a
    child process with 8 host devices (tests/test_multidevice_runner.py).
    `xla_defaults`: XLA:CPU compiles at its default level, not the suite's
    -O0 (tests/conftest.py).

    Extra pytest arguments go after `--`: `nox -s tests -- -k multi_steps`.
    """
    env = dict(TEST_ENV, OPTAX_EXT_XLA_DEFAULTS="1") if xla_defaults else TEST_ENV
    session.run("pytest", "-n", "2", "tests", *session.posargs, env=env)


def _minimum_versions() -> list[str]:
    """`name==version` for each package in MIN_PINNED, from pyproject's `>=` bounds."""
    pyproject = tomllib.loads(pathlib.Path("pyproject.toml").read_text())
    pins = {}
    for requirement in pyproject["project"]["dependencies"]:
        name, sep, version = requirement.partition(">=")
        name = name.strip()
        if sep and name in MIN_PINNED:
            pins[name] = f"{name}=={version.split(',')[0].strip()}"
    missing = set(MIN_PINNED) - set(pins)
    if missing:
        raise RuntimeError(
            f"no `>=` lower bound in pyproject.toml for {sorted(missing)}"
        )
    return [pins[name] for name in MIN_PINNED]


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test,examples]")
    _run_tests(session)


@nox.session(python="3.12")
def deviceless(session: nox.Session) -> None:
    """The GPU and TPU compile checks alone, in their pinned environment
    (`tests/data/deviceless-requirements.txt`)."""
    session.install("-r", "tests/data/deviceless-requirements.txt", "-e", ".")
    # `-p _compiled` (tests/ on the path): each `xdist_group` to one worker
    # under pytest 9.2 (tests/_compiled.py), each case's programs compiled once.
    session.run(
        "pytest", "-p", "_compiled", "-n", "2", "--dist", "loadgroup",
        "-k", "gpu or tpu or lion or clip or MultiSteps or accumulator",
        "tests/test_compiled_backends.py", "tests/test_train_step_memory.py",
        *session.posargs,
        env={
            "JAX_PLATFORMS": "cpu",
            "OPTAX_EXT_DEVICELESS": "here",
            "OPTAX_EXT_FULL_MATRIX": "1",
            "PYTHONPATH": str(pathlib.Path(__file__).parent / "tests"),
        },
    )  # fmt: skip


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", *LINT_PATHS)
    session.run("ruff", "format", "--check", *LINT_PATHS)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".", "pyright")
    session.run("pyright", "optax_ext")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    session.install("-e", ".[docs]")
    session.run("mkdocs", "build", "--strict")


@nox.session(python=PYTHON)
def minversions(session: nox.Session) -> None:
    # One resolver run, so test-only dependencies (flax) pick versions that
    # work with the pinned minimums.
    session.install("-e", ".[test,examples]", *_minimum_versions())
    session.run("pip", "list")
    _run_tests(session)


@nox.session(python=NEWEST_PYTHON)
def newest(session: nox.Session) -> None:
    # The newest releases of every dependency, so that a JAX release that
    # breaks a fast path shows up here before users see it; compiled as
    # users compile, at XLA's default level.
    session.install(
        "--upgrade", "--upgrade-strategy", "eager", "-e", ".[test,examples]"
    )
    session.run("pip", "list")
    _run_tests(session, xla_defaults=True)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/train_step.py", *session.posargs)
    session.run("python", "benchmarks/compile_time.py")
    session.run("python", "benchmarks/investigations/run.py")
    session.run("python", "benchmarks/data_parallel.py")
    session.run("python", "benchmarks/microbatched.py")
    session.run("python", "benchmarks/investigations/cpu_runtime.py")
    session.run("python", "docs/sync_docs.py")
