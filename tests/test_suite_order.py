"""The suite's own scheduling (`tests/conftest.py`): the long tests it
starts first exist, and are dealt to the start of each worker's share."""

import ast
import os
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
def test_long_tests_start_each_worker_s_share(workers):
    """With W workers, worksteal hands worker w the next
    len(pending) // (W - w) tests; the long ones open those shares, in
    turn, longest first, and no test is lost or repeated."""
    short = [
        types.SimpleNamespace(nodeid=f"tests/test_x.py::test_{i}") for i in range(40)
    ]
    long = [types.SimpleNamespace(nodeid=f"tests/{n}") for n in conftest.LONG_FIRST]
    items = short[:7] + long[::-1] + short[7:]
    conftest._long_first(items, workers)
    assert sorted(id(i) for i in items) == sorted(id(i) for i in short + long)
    assert [i for i in items if i in short] == short
    start, pending = 0, len(items)
    for w in range(workers):
        share = pending // (workers - w)
        mine = long[w::workers]
        assert items[start : start + len(mine)] == mine, (w, start)
        start, pending = start + share, pending - share


@pytest.mark.parametrize("worker", [True, False])
def test_the_hook_deals_over_the_workers(worker):
    """The collection hook calls `_long_first` with xdist's worker count in
    a worker, and puts the long tests first outside xdist. It runs last
    (`trylast`), after `-k` and `-m` have chosen the items."""
    hook = conftest.pytest_collection_modifyitems
    assert hook.pytest_impl["trylast"]
    short = [
        types.SimpleNamespace(nodeid=f"tests/test_x.py::test_{i}") for i in range(9)
    ]
    first, second = (
        types.SimpleNamespace(nodeid=f"tests/{name}")
        for name in conftest.LONG_FIRST[:2]
    )
    for item in (*short, first, second):
        item.get_closest_marker = lambda name: None
    config = types.SimpleNamespace(getoption=lambda name: False)
    if worker:
        config.workerinput = {"workercount": 2}
    items = short[:3] + [second] + short[3:6] + [first] + short[6:]
    hook(config, items)
    if worker:
        # 11 items: worker 0 takes the first 11 // 2, worker 1 the rest
        assert items == [first] + short[:4] + [second] + short[4:]
    else:
        assert items == [first, second] + short


def test_every_quick_entry_names_a_test_of_the_suite():
    """A renamed file or test would silently leave `--quick`."""
    for name in conftest.QUICK | conftest.NOT_QUICK:
        file, _, test = name.partition("::")
        assert (TESTS / file).exists(), f"{name}: no such file"
        function = test.partition("[")[0]
        if function:
            tree = ast.parse((TESTS / file).read_text())
            defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
            assert function in defined, f"{name}: no such test function"


def test_quick_keeps_the_quick_files_and_tests_only():
    kept = [
        types.SimpleNamespace(nodeid="tests/test_multi_steps.py::test_a[x/y]"),
        types.SimpleNamespace(
            nodeid="tests/test_docs.py::test_python_blocks_of_page_run_in_order"
            "[README.md]"
        ),
    ]
    dropped = [
        types.SimpleNamespace(
            nodeid="tests/test_apply.py::test_fused_step_has_no_params_sized_temporary"
            "[300-x]"
        ),
        types.SimpleNamespace(nodeid="tests/test_docs.py::test_other"),
        types.SimpleNamespace(nodeid="tests/test_hlo.py::test_a"),
    ]
    seen = []
    config = types.SimpleNamespace(
        getoption=lambda name: name == "quick",
        hook=types.SimpleNamespace(pytest_deselected=lambda items: seen.extend(items)),
    )
    items = [dropped[0], kept[0], dropped[1], kept[1], dropped[2]]
    conftest._keep_quick(config, items)
    assert items == kept and seen == dropped
    config.getoption = lambda name: False
    items = [dropped[0], kept[0]]
    conftest._keep_quick(config, items)
    assert items == [dropped[0], kept[0]]


def _config(dist, args, distload=False):
    return types.SimpleNamespace(
        pluginmanager=types.SimpleNamespace(hasplugin=lambda name: True),
        invocation_params=types.SimpleNamespace(args=args),
        option=types.SimpleNamespace(dist=dist),
        getoption=lambda name: {"dist": dist, "distload": distload}[name],
    )


@pytest.mark.parametrize(
    "dist, args, addopts, expected",
    [
        ("load", ("-n", "2", "tests"), "", "worksteal"),  # -n alone: xdist says load
        ("load", ("-n", "2", "--dist", "load"), "", "load"),
        ("load", ("-n", "2", "--dist=load"), "", "load"),
        ("load", ("-n", "2", "-d"), "", "load"),  # -d: --dist=load
        ("load", ("-n", "2"), "--dist=load", "load"),
        ("loadgroup", ("-n", "2", "--dist", "loadgroup"), "", "loadgroup"),
        ("no", ("tests",), "", "no"),  # no -n, or an xdist worker's own config
    ],
)
def test_n_alone_schedules_by_worksteal(dist, args, addopts, expected, monkeypatch):
    monkeypatch.setenv("PYTEST_ADDOPTS", addopts)
    config = _config(dist, args, distload="-d" in args)
    conftest.pytest_configure(config)
    assert config.option.dist == expected


def test_n_alone_schedules_by_worksteal_in_a_real_run():
    """The same through xdist's own option parsing."""
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "2",
            "-v",
            str(TESTS / "test_suite_order.py")
            + "::test_every_long_test_is_a_test_of_the_suite",
        ],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
        env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "scheduling tests via WorkStealingScheduling" in run.stdout, run.stdout


def test_the_suite_runs_without_xdist():
    """No xdist option in `addopts`: `pytest -p no:xdist` runs."""
    import subprocess
    import sys

    config = _config(None, ())
    config.pluginmanager = types.SimpleNamespace(hasplugin=lambda name: False)
    config.getoption = None  # reading an option xdist adds would fail
    conftest.pytest_configure(config)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-q",
            "--co",
            str(TESTS / "test_suite_order.py"),
        ],
        capture_output=True,
        text=True,
        cwd=TESTS.parent,
    )
    assert run.returncode == 0, run.stdout + run.stderr
