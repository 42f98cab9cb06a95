"""``tessera up/down/demo``: refusals at the boundary, and a small demo run end to end."""

from __future__ import annotations

import json

import pytest

from services.cli import main


@pytest.fixture
def state(tmp_path, monkeypatch):
    import services.launch.cli as cli

    path = tmp_path / "cluster.json"
    monkeypatch.setattr(cli, "STATE", path)
    return path


def test_up_with_an_address_needs_a_model(state, capsys):
    assert main(["up", "--address", "10.0.0.1:6379"]) == 2
    assert "--address needs --model" in capsys.readouterr().err


def test_up_refuses_a_missing_model_dir(state, tmp_path, capsys):
    assert main(["up", "--model", str(tmp_path / "nowhere")]) == 2
    assert "is not a model directory" in capsys.readouterr().err


def test_up_refuses_while_a_cluster_is_up(state, capsys):
    state.write_text(json.dumps({"started_ray": False, "temp": []}))
    assert main(["up"]) == 2
    assert "already up" in capsys.readouterr().err


def test_down_with_nothing_up_says_so(state, capsys):
    assert main(["down"]) == 2
    assert "nothing to stop" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_replays_full_and_tessera(local_ray, capsys):
    from services.launch.demo import DemoSettings, run_demo

    settings = DemoSettings(requests=8, docs=4, chunks_per_request=2, doc_tokens=32, suffix_tokens=4,
                            output_tokens=3, concurrency=2)
    assert run_demo(settings) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.strip().startswith("full"))
    assert header.split() == ["full", "tessera"]
    for row in ("Successful requests", "TTFT p50 (ms)", "TTFT p99 (ms)", "Output token throughput (tok/s)",
                "chunk tokens from computed (%)"):
        assert row in out
    ok = next(line for line in out.splitlines() if line.startswith("Successful requests"))
    assert ok.split()[-2:] == ["8", "8"]
