"""The suite's own scheduling (`tests/conftest.py`): the long tests it
starts first exist, and are dealt to the start of each worker's share."""

import ast
import pathlib
import types

import conftest
import pytest

TESTS = pathlib.Path(__file__).parent


def test_every_long_test_is_a_test_of_the_suite():
    """A renamed long test would silently lose its place at the start."""
    for name in conftest.LONG_FIRST:
        file, _, function = name.partition("::")
        tree = ast.parse((TESTS / file).read_text())
        defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert function in defined, f"{name}: no such test function"


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_long_tests_start_each_worker_s_share(monkeypatch, workers):
    """With W workers, worksteal hands worker w the next
    len(pending) // (W - w) tests; the long ones open those shares, in
    turn, longest first, and no test is lost or repeated."""
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    short = [
        types.SimpleNamespace(nodeid=f"tests/test_x.py::test_{i}") for i in range(40)
    ]
    long = [types.SimpleNamespace(nodeid=f"tests/{n}") for n in conftest.LONG_FIRST]
    items = short[:7] + long[::-1] + short[7:]
    conftest._long_first(items)
    assert sorted(id(i) for i in items) == sorted(id(i) for i in short + long)
    assert [i for i in items if i in short] == short
    start, pending = 0, len(items)
    for w in range(workers):
        share = pending // (workers - w)
        mine = long[w::workers]
        assert items[start : start + len(mine)] == mine, (w, start)
        start, pending = start + share, pending - share
