"""services/cluster/affinity.py: a GPU worker's threads bound to its GPU's local CPUs, from sysfs's cpulist."""

from __future__ import annotations

import os
import threading

import pytest

from services.cluster import affinity
from services.cluster.affinity import bind_threads, bind_to_gpu, local_cpus, parse_cpulist

ADDRESS = "0000:18:00.0"


@pytest.mark.parametrize("text, cpus", [("0-3,8,10-11\n", {0, 1, 2, 3, 8, 10, 11}), ("5", {5}), ("", set()),
                                        ("\n", set()), ("0-0", {0})], ids=["ranges", "one", "empty", "newline", "0-0"])
def test_a_cpulist_parses_to_its_cpus(text, cpus):
    assert parse_cpulist(text) == cpus


@pytest.mark.parametrize("text", ["a", "3-1", "1-", "-1", "0,,x", "1.5"])
def test_a_malformed_cpulist_is_refused(text):
    with pytest.raises(ValueError, match="cpulist"):
        parse_cpulist(text)


def _sysfs(tmp_path, cpulist: str):
    (tmp_path / ADDRESS).mkdir(exist_ok=True)
    (tmp_path / ADDRESS / "local_cpulist").write_text(cpulist)
    return tmp_path


def test_local_cpus_reads_the_device_s_entry_and_says_nothing_without_one(tmp_path):
    assert local_cpus(ADDRESS, _sysfs(tmp_path, "2-3,6\n")) == {2, 3, 6}
    assert local_cpus("0000:99:00.0", tmp_path) == frozenset()
    assert local_cpus(ADDRESS, _sysfs(tmp_path, "garbage")) == frozenset()


@pytest.fixture
def restore_affinity():
    """Every thread of this process back on the CPUs it had (a test binds them)."""
    before = frozenset(os.sched_getaffinity(0))
    yield before
    bind_threads(before)


def test_binding_reaches_threads_already_running_and_those_started_after(restore_affinity):
    one = {min(restore_affinity)}
    stop = threading.Event()
    running = threading.Thread(target=stop.wait)
    running.start()
    try:
        assert bind_threads(frozenset(one)) >= 2
        assert os.sched_getaffinity(0) == one
        assert os.sched_getaffinity(running.native_id) == one
        seen = {}
        later = threading.Thread(target=lambda: seen.update(cpus=os.sched_getaffinity(0)))
        later.start()
        later.join()
        assert seen["cpus"] == one
    finally:
        stop.set()
        running.join()


def test_a_cpu_device_is_not_bound():
    assert bind_to_gpu("cpu") == "not bound: cpu is no GPU"


def test_a_gpu_worker_binds_to_the_local_cpus_it_is_allowed(tmp_path, monkeypatch, restore_affinity):
    monkeypatch.setattr(affinity, "pci_address", lambda device: ADDRESS)
    allowed = sorted(restore_affinity)
    # every allowed CPU local (one node): nothing to do
    said = bind_to_gpu("cuda", _sysfs(tmp_path, ",".join(map(str, allowed))))
    assert said.startswith("not bound: every CPU allowed") and os.sched_getaffinity(0) == set(allowed)
    # the GPU's node holds only CPUs this process may not use (a container's cpuset): left as it is
    said = bind_to_gpu("cuda", _sysfs(tmp_path, "100000-100003"))
    assert said.startswith("not bound: none of the 4 CPUs") and os.sched_getaffinity(0) == set(allowed)
    # no entry for the GPU
    assert bind_to_gpu("cuda", tmp_path / "elsewhere").startswith("not bound: sysfs names no CPUs")
    # no PCI address from torch
    monkeypatch.setattr(affinity, "pci_address", lambda device: "")
    assert bind_to_gpu("cuda", tmp_path).startswith("not bound: torch gives no PCI address")
    if len(allowed) < 2:
        pytest.skip("one allowed CPU: no subset of them to bind to")
    monkeypatch.setattr(affinity, "pci_address", lambda device: ADDRESS)
    # local CPUs beyond those allowed count for nothing; the allowed local ones are bound
    said = bind_to_gpu("cuda", _sysfs(tmp_path, f"{allowed[-1]},100000"))
    assert os.sched_getaffinity(0) == {allowed[-1]}
    assert f"bound to the 1 CPUs local to {ADDRESS} (of {len(allowed)} allowed)" in said


def test_a_refused_binding_leaves_the_worker_serving_where_it_was(tmp_path, monkeypatch, restore_affinity):
    """A sandbox may refuse sched_setaffinity: the worker starts anyway, its threads where they were."""
    allowed = sorted(restore_affinity)
    if len(allowed) < 2:
        pytest.skip("one allowed CPU: nothing would be bound")
    monkeypatch.setattr(affinity, "pci_address", lambda device: ADDRESS)
    real = os.sched_setaffinity
    calls = []

    def refuse_after_one(pid, cpus):
        calls.append(set(cpus))
        if len(calls) == 2:
            raise PermissionError(1, "Operation not permitted")
        real(pid, cpus)

    monkeypatch.setattr(os, "sched_setaffinity", refuse_after_one)
    stop = threading.Event()
    running = threading.Thread(target=stop.wait)
    running.start()
    try:
        said = bind_to_gpu("cuda", _sysfs(tmp_path, str(allowed[0])))
        assert said.startswith(f"not bound: binding to the CPUs local to {ADDRESS} was refused")
        assert os.sched_getaffinity(0) == set(allowed) == os.sched_getaffinity(running.native_id)
    finally:
        stop.set()
        running.join()


def test_a_system_without_cpu_affinity_is_not_bound(monkeypatch):
    monkeypatch.delattr(os, "sched_setaffinity")
    assert bind_to_gpu("cuda") == "not bound: this system sets no CPU affinity"
