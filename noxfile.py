"""Developer tasks. Run `nox -l` to list the sessions, `nox -s NAME` to run one."""

import pathlib

import nox
import tomllib

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["tests", "lint", "typecheck", "docs"]

PYTHON = "3.11"
LINT_PATHS = ["optax_ext", "tests", "examples", "benchmarks", "noxfile.py"]
# Packages whose lowest declared version the `minversions` session pins.
MIN_PINNED = ["jax", "jaxlib", "optax", "equinox", "chex"]
MULTIDEVICE_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
}


def _run_tests(session: nox.Session) -> None:
    """The README test command, then the multi-device tests.

    Extra pytest arguments go after `--`: `nox -s tests -- -k multi_steps`.
    """
    args = ["tests", *session.posargs]
    session.run("pytest", "-n", "2", *args, env={"JAX_PLATFORMS": "cpu"})
    # Multi-device tests need XLA_FLAGS set before jax starts, so they run in
    # their own process. Exit code 5 ("no tests collected") is fine here.
    session.run(
        "pytest", "-m", "multidevice", *args, env=MULTIDEVICE_ENV, success_codes=[0, 5]
    )


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


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    session.install("-e", ".[bench]")
    session.run("python", "benchmarks/run.py", *session.posargs)
    session.run("python", "benchmarks/data_parallel.py")
