"""A pytest plugin: the CPU-seconds and wall time of each test module, one JSON line per module.

    PIPELINE_MODULE_CPU_OUT=/tmp/modules.jsonl python -m pytest -q -n 0 -p pipeline_assets_tests.module_cpu

The CPU is that of a cgroup v1 ``cpuacct`` group when ``PIPELINE_MODULE_CPU_CGROUP`` names its directory
(put the shell that starts pytest into it first: every process the tests start, PostgreSQL servers and
Dagster daemons included, is counted, even after it left the process tree); otherwise this process's own
CPU and that of its children it waited for. A module's figure runs from the setup of its first test to
the teardown of its last (module fixtures included). Under xdist each worker moves into a group of its
own below the named one (``gw0``...; the named group keeps the total). Each line names its worker and
its start (epoch seconds). ``PIPELINE_MODULE_CPU_TESTS=1``: a line per test too (``"failed"`` if so).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

OUT_ENV = "PIPELINE_MODULE_CPU_OUT"
CGROUP_ENV = "PIPELINE_MODULE_CPU_CGROUP"
TESTS_ENV = "PIPELINE_MODULE_CPU_TESTS"
_current: dict = {}
_test: dict = {}


def pytest_configure(config: pytest.Config) -> None:
    cgroup, worker = os.environ.get(CGROUP_ENV), os.environ.get("PYTEST_XDIST_WORKER")
    if cgroup and worker:  # before this worker starts anything (its PostgreSQL server included)
        own = Path(cgroup) / worker
        own.mkdir(exist_ok=True)
        (own / "cgroup.procs").write_text(str(os.getpid()))
        os.environ[CGROUP_ENV] = str(own)


def _cpu_seconds() -> float:
    cgroup = os.environ.get(CGROUP_ENV)
    if cgroup:
        return int((Path(cgroup) / "cpuacct.usage").read_text()) / 1e9
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _current.get("module") != _module(item):
        _current.update(
            module=_module(item), cpu=_cpu_seconds(), wall=time.monotonic(), start=time.time(), load=os.getloadavg()[0]
        )
    _test.update(cpu=_cpu_seconds(), wall=time.monotonic())


def _write(record: dict) -> None:
    with open(os.environ.get(OUT_ENV, "module-cpu.jsonl"), "a") as out:
        out.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:  # a failure is known as it happens, not only in the summary at the session's end
        _write({"failed": report.nodeid, "when": report.when})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    if os.environ.get(TESTS_ENV) and _test:
        cpu, wall = _cpu_seconds() - _test["cpu"], time.monotonic() - _test["wall"]
        _write({"test": item.nodeid, "cpu_s": round(cpu, 1), "wall_s": round(wall, 1)})
    if nextitem is not None and _module(nextitem) == _module(item):
        return
    record = {
        "module": _module(item),
        "cpu_s": round(_cpu_seconds() - _current["cpu"], 1),
        "wall_s": round(time.monotonic() - _current["wall"], 1),
        "load": [round(_current["load"], 1), round(os.getloadavg()[0], 1)],
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "start": round(_current["start"], 1),
    }
    _current.clear()
    _write(record)
