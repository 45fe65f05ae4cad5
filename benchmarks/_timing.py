"""Timing and provenance shared by the benchmarks: how a candidate is timed
on a shared machine (consecutive calls, interleaved round-robin), and the
line that says what was measured where."""

from __future__ import annotations

import os
import platform
import random
import subprocess
from collections.abc import Callable
from pathlib import Path

import jax
import optax

import optax_ext

MIN_SECONDS = 0.05  # a round times each candidate over at least this long


def time_calls(call: Callable[[], float], min_seconds: float = MIN_SECONDS) -> float:
    """Seconds per call over consecutive calls of `call` (which returns the
    seconds it took) totalling `min_seconds` (at least one call): a fast step
    is timed over many calls in a row, as mini-steps run in training, rather
    than once after whatever heavy candidate preceded it."""
    total, calls = 0.0, 0
    while total < min_seconds or calls == 0:
        total += call()
        calls += 1
    return total / calls


def time_interleaved(runners: list, rounds: int) -> None:
    """Times every runner once a round (`time_calls(runner.call)`, appended
    to `runner.times`), in an order shuffled each round with a fixed seed:
    a noisy machine slows all candidates alike, so their ratios hold."""
    order = list(runners)
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for runner in order:
            runner.times.append(time_calls(runner.call))


def machine() -> str:
    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{jax.devices()[0].platform.upper()}, jax {jax.__version__}, "
        f"optax {optax.__version__}, Python {platform.python_version()}; "
        f"optax_ext at {code_version()}"
    )


def code_version() -> str:
    """The commit the measured optax_ext comes from (`OPTAX_EXT_COMMIT`
    when run from an exported copy without git)."""
    if os.environ.get("OPTAX_EXT_COMMIT"):
        return os.environ["OPTAX_EXT_COMMIT"]
    here = Path(optax_ext.__file__).parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit"
    return f"commit {out.stdout.strip()}"
