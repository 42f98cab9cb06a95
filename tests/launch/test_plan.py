"""What a launcher is told to start (services/launch/plan.py): one retrieval index service per decode worker, with the
cluster's "index" identity, its address in that worker's spec, stopped after the workers; none with the role off."""

from __future__ import annotations

import pytest

from services.cluster.config import ClusterConfig
from services.launch.plan import Plan, stop_order


@pytest.fixture
def plan(tmp_path):
    (tmp_path / "config.json").write_text("{}")     # all a worker's EngineSettings looks at
    made = []

    def make(**fields) -> Plan:
        p = Plan.make(ClusterConfig(model_dir=str(tmp_path), stores=1, store_dir=str(tmp_path / "db"), **fields))
        made.append(p)
        return p
    yield make
    for p in made:
        p.remove_scratch()


def test_each_decode_worker_gets_an_index_service_of_its_own_with_the_index_identity(plan):
    p = plan(prefill=1, decode=2, index_threads=3, index_host_dtype="bfloat16")
    assert p.names["index"] == ["tessera-index-0", "tessera-index-1"]
    specs = p.index_specs()
    assert [s.name for s in specs] == p.names["index"] and {s.role for s in specs} == {"index"}
    assert all(s.cluster_tls.role == "index" and s.index_threads == 3 and s.engine is None for s in specs)
    # the services and the decode workers that offload to them hold (and send) one dtype
    assert {s.index_host_dtype for s in specs} == {"bfloat16"}
    assert p.role("tessera-index-1") == "index" and p.workers == ["tessera-prefill-0", "tessera-decode-0",
                                                                    "tessera-decode-1"]
    addresses = {"tessera-index-0": "127.0.0.1:7000", "tessera-index-1": "127.0.0.1:7001"}
    stores = ("127.0.0.1:6000",)
    assert p.worker_spec("tessera-decode-1", stores, addresses).index_address == "127.0.0.1:7001"
    assert p.worker_spec("tessera-decode-0", stores, addresses).cluster_tls.role == "decode"
    assert p.worker_spec("tessera-decode-0", stores, addresses).engine.index_host_dtype == "bfloat16"
    assert p.worker_spec("tessera-prefill-0", stores, addresses).index_address is None
    with pytest.raises(ValueError, match="tessera-decode-0 needs the address of its index service tessera-index-0"):
        p.worker_spec("tessera-decode-0", stores)


def test_with_the_role_off_decode_workers_index_in_process(plan):
    p = plan(decode=2, index_threads=0)
    assert p.names["index"] == [] and p.index_specs() == []
    assert p.worker_spec("tessera-decode-1", ()).index_address is None


def test_without_mutual_tls_the_index_service_serves_plain(plan):
    spec = plan(internal_tls=False).index_specs()[0]
    assert spec.cluster_tls is None and spec.index_threads == 4     # the default threads


def test_index_services_stop_after_the_workers_and_before_the_stores():
    names = ["tessera-store-0", "tessera-index-0", "tessera-decode-0", "tessera-gateway", "tessera-prefill-0",
             "tessera-index-1", "tessera-decode-1"]
    assert stop_order(names) == ["tessera-gateway", "tessera-decode-0", "tessera-decode-1", "tessera-prefill-0",
                                 "tessera-index-0", "tessera-index-1", "tessera-store-0"]


@pytest.mark.parametrize("flags, threads, loads", [([], 4, "cost"), (["--index-threads", "2"], 2, "cost"),
                                                   (["--no-index", "--store-loads", "never", "--nixl-slab-mb", "0",
                                                     "--admit-during-step", "--no-cpu-affinity",
                                                     "--index-host-dtype", "bfloat16"], 0, "never")],
                         ids=["default", "threads-2", "no-index-no-loads"])
def test_up_takes_the_index_role_s_threads_or_turns_it_off(tmp_path, tiny_model, monkeypatch, capsys, flags, threads,
                                                           loads):
    import services.launch.cli as cli
    import services.launch.on_ray as launch
    from services.cli import main
    from services.launch.on_ray import LocalHead

    monkeypatch.setattr(cli, "STATE", tmp_path / "cluster.json")
    seen = {}

    def cluster(cfg, progress):
        seen["cfg"] = cfg
        return type("C", (), dict(gateway_address="127.0.0.1:1", actors={}, addresses={}, metrics={}, shm_scratch=None))()

    head = LocalHead("127.0.0.1:40001", str(tmp_path / "ray"), str(tmp_path / "token"))
    monkeypatch.setattr(launch, "start_local_head", lambda n, root, cli_path: head)
    monkeypatch.setattr(launch, "use_local_head", lambda h: None)
    monkeypatch.setattr(launch, "ensure_ray", lambda address: None)
    monkeypatch.setattr(launch, "start_cluster", cluster)
    assert main(["up", "--model", tiny_model, "--stores", "0", "--device", "cpu", "--decode", "2", *flags]) == 0
    assert seen["cfg"].index_threads == threads and seen["cfg"].prefill_settings.store_loads == loads
    slab = 0 if loads == "never" else 512 << 20
    assert seen["cfg"].prefill_settings.nixl_slab_bytes == seen["cfg"].decode_settings.nixl_slab_bytes == slab
    assert seen["cfg"].decode_settings.admit_during_step is ("--admit-during-step" in flags)
    assert seen["cfg"].cpu_affinity is seen["cfg"].engine().cpu_affinity is ("--no-cpu-affinity" not in flags)
    dtype = "bfloat16" if "--index-host-dtype" in flags else "float32"
    assert seen["cfg"].index_host_dtype == seen["cfg"].engine().index_host_dtype == dtype
    assert f"{2 if threads else 0} index service(s)" in capsys.readouterr().out


def test_up_refuses_negative_index_threads(tmp_path, tiny_model, monkeypatch, capsys):
    import services.launch.cli as cli
    from services.cli import main

    monkeypatch.setattr(cli, "STATE", tmp_path / "cluster.json")
    assert main(["up", "--model", tiny_model, "--stores", "0", "--device", "cpu", "--index-threads", "-1"]) == 2
    assert "--index-threads must be in [0, 1024], got -1" in capsys.readouterr().err
    assert main(["up", "--model", tiny_model, "--stores", "0", "--device", "cpu", "--nixl-slab-mb", "-1"]) == 2
    assert "nixl_slab_bytes must be" in capsys.readouterr().err
