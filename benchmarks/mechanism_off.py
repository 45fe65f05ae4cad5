"""A pytest plugin that runs tests with one `update_if` mechanism off.

    PYTHONPATH=benchmarks MECHANISM_OFF="no clear order" \
        python -m pytest -p mechanism_off tests/test_hlo.py

applies `mechanisms.VARIANTS[MECHANISM_OFF]` for the whole session, so a
contributor can see which tests guard a mechanism (`docs/design.md`, "What
each mechanism costs and buys", names one for each).
"""

from __future__ import annotations

import os

import mechanisms


def pytest_configure(config) -> None:
    name = os.environ.get("MECHANISM_OFF")
    if not name:
        return
    if name not in mechanisms.VARIANTS:
        raise ValueError(
            f"MECHANISM_OFF={name!r} is not a variant of benchmarks/mechanisms.py; "
            f"expected one of {sorted(mechanisms.VARIANTS)}."
        )
    config.mechanism_off = mechanisms.patched(name)  # kept: closing it undoes it
    config.mechanism_off.__enter__()


def pytest_unconfigure(config) -> None:
    patch = getattr(config, "mechanism_off", None)
    if patch is not None:
        patch.__exit__(None, None, None)
