"""The opt-in profiler window of a worker's engine loop (services/cluster/profiling.py)."""

import gzip
import json

import pytest
import torch

from services.cluster.profiling import ProfileWindow, parse


def test_parse_defaults_and_errors(tmp_path):
    assert parse(str(tmp_path)) == (tmp_path, 64, 32)
    assert parse(f"{tmp_path},3,2") == (tmp_path, 3, 2)
    for bad in (f"{tmp_path},x", f"{tmp_path},1,0", f"{tmp_path},-1", ",1,1", f"{tmp_path},1,2,3"):
        with pytest.raises(ValueError, match="TESSERA_TORCH_PROFILE"):
            parse(bad)


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv("TESSERA_TORCH_PROFILE", raising=False)
    monkeypatch.delenv("TESSERA_TORCH_PROFILE_DECODE", raising=False)
    w = ProfileWindow("w", "decode")
    for _ in range(5):
        w.tick()
    assert not w.enabled and w._prof is None


def test_role_variable_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_TORCH_PROFILE", f"{tmp_path / 'all'},1,1")
    monkeypatch.setenv("TESSERA_TORCH_PROFILE_PREFILL", f"{tmp_path / 'prefill'},2,1")
    assert ProfileWindow("p", "prefill").dir == tmp_path / "prefill"
    assert ProfileWindow("d", "decode").dir == tmp_path / "all"


@pytest.mark.slow
def test_window_records_only_its_units(tmp_path):
    w = ProfileWindow("unit", "prefill", spec=f"{tmp_path},2,2")
    marks = []
    for i in range(6):
        w.tick()
        with torch.profiler.record_function(f"unit{i}"):
            marks.append(torch.ones(8).sum())
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and files[0].endswith(".json.gz") and files[1].endswith(".txt")
    trace = json.loads(gzip.open(tmp_path / files[0]).read())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"unit2", "unit3"} <= names
    assert not names & {"unit0", "unit1", "unit4", "unit5"}


def test_one_window_at_a_time_in_a_process(tmp_path):
    first = ProfileWindow("first", "prefill", spec=f"{tmp_path / 'a'},0,2")
    second = ProfileWindow("second", "decode", spec=f"{tmp_path / 'b'},0,2")
    first.tick()
    second.tick()                               # declines: the first is recording
    assert first._prof is not None and second._prof is None and not second.enabled
    for _ in range(2):
        first.tick()
        second.tick()
    assert len(list((tmp_path / "a").iterdir())) == 2 and not (tmp_path / "b").exists()
    third = ProfileWindow("third", "decode", spec=f"{tmp_path / 'c'},0,1")
    third.tick()                                # the first one is done: this one may record
    third.close()
    assert len(list((tmp_path / "c").iterdir())) == 2


def test_a_window_the_run_ends_inside_of_is_written_on_close(tmp_path):
    w = ProfileWindow("cut", "decode", spec=f"{tmp_path},1,100")
    for _ in range(3):
        w.tick()
        torch.ones(4).sum()
    assert not list(tmp_path.iterdir())
    w.close()
    assert sorted(p.suffix for p in tmp_path.iterdir()) == [".gz", ".txt"]
    w.close()                                   # nothing left open: no second write
    assert len(list(tmp_path.iterdir())) == 2


@pytest.mark.slow
def test_workers_write_their_profiles_when_stopped_inside_the_window(monkeypatch, tmp_path, tiny_model):
    """Both workers serve from this process here: the first to start a window records (torch runs one
    profiler per process), the other declines; stopping writes the window the run ended inside of."""
    from services.sdk import Client

    from tests.helpers import InProcessCluster, docs

    monkeypatch.setenv("TESSERA_TORCH_PROFILE", f"{tmp_path / 'prof'},0,1000")   # a window no run finishes
    (tmp_path / "store").mkdir()
    cluster = InProcessCluster(tiny_model, tmp_path / "store")
    try:
        with Client(cluster.address) as client:
            chunks = docs(2, 24)
            events = list(client.generate(chunks=chunks, suffix=[5, 6, 7], max_new_tokens=3, temperature=0.0))
        assert sum(len(e.token_ids) for e in events) == 3
    finally:
        cluster.stop()
    names = sorted(p.name.split("-")[0] + p.suffix for p in (tmp_path / "prof").iterdir())
    assert names in (["prefill.gz", "prefill.txt"], ["decode.gz", "decode.txt"])
