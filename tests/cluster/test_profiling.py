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
