"""The embedded default of ``tessera up`` (no ``--address``) is safe as started, and ``tessera down``
stops what it started and nothing else; a crashed service is restarted at a bounded rate.

The Ray tests start real Ray heads (``ray start``, a few seconds each) and talk to them from
subprocesses: Ray reads its address and token settings once per process, when imported.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import psutil
import pytest

from services.cli import main
from services.launch.actors import RestartBudget, RestartLimitExceeded
from services.cluster.config import ClusterConfig
from services.launch.on_ray import LOOPBACK_ENV, LocalHead, head_processes, start_local_head, stop_local_head

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RAY_CLI = str(Path(sys.executable).with_name("ray"))
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without Ray's auth and loopback settings, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", LOOPBACK_ENV, "RAY_ADDRESS")}
    return {**env, **extra}


def _listening(procs) -> tuple[set[str], list[str]]:
    """(every address ``procs`` listen on, those that are not loopback): TCP listeners and bound UDP sockets."""
    everywhere, exposed = set(), []
    for proc in procs:
        try:
            conns = proc.net_connections(kind="inet")
            name = proc.name()
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr):
                everywhere.add(f"{c.laddr.ip}:{c.laddr.port}")
                if c.laddr.ip not in LOOPBACK:
                    exposed.append(f"{name}[{proc.pid}] {c.laddr.ip}:{c.laddr.port}")
    return everywhere, exposed


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    h = start_local_head(2, tmp_path_factory.mktemp("state"), RAY_CLI)
    yield h
    stop_local_head(h)


# --- restart rate: no Ray ------------------------------------------------------------------------------

def test_restart_budget_counts_restarts_within_the_window():
    budget = RestartBudget(max_restarts=2, window_s=60)
    history = budget.record([], now=1000.0)
    history = budget.record(history, now=1010.0)
    assert history == [1000.0, 1010.0]
    with pytest.raises(RestartLimitExceeded, match="restarted 3 times within 60 s, more than the 2 allowed"):
        budget.record(history, now=1020.0)
    # the first restart has left the window: a third one is allowed, and forgotten history stays forgotten
    assert budget.record(history, now=1061.0) == [1010.0, 1061.0]
    assert RestartBudget(max_restarts=-1, window_s=60).record([1.0] * 100, now=2.0)[-1] == 2.0
    with pytest.raises(RestartLimitExceeded):
        RestartBudget(max_restarts=0, window_s=60).record([], now=0.0)


@pytest.mark.parametrize("fields, message", [
    ({"max_restarts": -2}, "--max-restarts must be >= 0"),
    ({"restart_window_s": 0}, "--restart-window-s must be > 0"),
    ({"restart_window_s": float("nan")}, "--restart-window-s must be > 0"),
], ids=["restarts--2", "window-0", "window-nan"])
def test_cluster_config_refuses_bad_restart_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(model_dir="unused", **fields)
    assert ClusterConfig(model_dir="unused").max_restarts == 5


def test_up_records_its_own_head_and_connects_to_it_only(tmp_path, tiny_model, monkeypatch, capsys):
    """``up`` hands the recorded head's address to Ray (never "auto") and keeps --max-restarts and
    --restart-window-s in the cluster's config."""
    import services.launch.cli as cli
    import services.launch.on_ray as launch

    state = tmp_path / "cluster.json"
    monkeypatch.setattr(cli, "STATE", state)
    fake = LocalHead("127.0.0.1:40001", str(tmp_path / "ray"), str(tmp_path / "token"))
    seen: dict = {}

    def cluster(cfg, progress):
        seen["cfg"] = cfg
        return type("C", (), dict(gateway_address="127.0.0.1:1", actors={}, addresses={}, metrics={}, shm_scratch=None))()

    monkeypatch.setattr(launch, "start_local_head", lambda n, root, cli_path: seen.update(root=root) or fake)
    monkeypatch.setattr(launch, "use_local_head", lambda h: seen.update(used=h))
    monkeypatch.setattr(launch, "ensure_ray", lambda address: seen.update(address=address))
    monkeypatch.setattr(launch, "start_cluster", cluster)
    assert main(["up", "--model", tiny_model, "--stores", "0", "--device", "cpu",
                 "--max-restarts", "7", "--restart-window-s", "30"]) == 0
    assert seen["address"] == "127.0.0.1:40001" and seen["used"] == fake and seen["root"] == tmp_path
    assert (seen["cfg"].max_restarts, seen["cfg"].restart_window_s) == (7, 30.0)
    assert json.loads(state.read_text())["head"] == asdict(fake)


def test_up_refuses_a_bad_restart_window(tmp_path, tiny_model, monkeypatch, capsys):
    import services.launch.cli as cli

    monkeypatch.setattr(cli, "STATE", tmp_path / "cluster.json")
    assert main(["up", "--model", tiny_model, "--stores", "0", "--device", "cpu", "--restart-window-s", "0"]) == 2
    assert "--restart-window-s must be > 0" in capsys.readouterr().err


# --- a real head -----------------------------------------------------------------------------------------

def test_local_head_listens_on_loopback_only_and_keeps_its_token_private(head):
    port = head.address.rsplit(":", 1)[1]
    everywhere, exposed = _listening(head_processes(head))
    assert exposed == [], f"the local Ray head listens beyond loopback: {exposed}"
    assert {f"127.0.0.1:{port}", f"::ffff:127.0.0.1:{port}"} & everywhere, f"GCS not among {everywhere}"
    token = Path(head.token_path)
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(Path(head.temp_dir).stat().st_mode) == 0o700
    assert len(token.read_text()) >= 40


@pytest.mark.parametrize("auth", [{}, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "not-the-token"}],
                         ids=["no-token", "wrong-token"])
def test_a_caller_without_the_token_is_refused(head, tmp_path, auth):
    # HOME: no ~/.ray/auth_token to fall back on; a short connect window (~1 s per try), refusal is final
    env = _clean_env(HOME=str(tmp_path), RAY_gcs_server_port_wait_time_s="2", **{LOOPBACK_ENV: "0"}, **auth)
    code = (f"import ray\ntry:\n    ray.init(address={head.address!r}, log_to_driver=False)\n"
            "except ConnectionError:\n    print('REFUSED')\nelse:\n    print('CONNECTED')\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert run.stdout.strip() == "REFUSED", run.stdout + run.stderr[-2000:]
    assert "Authentication token is missing or incorrect" in run.stderr


RESTART_DRIVER = r"""
import json, os, signal, sys, time
import ray
from services.launch.actors import ServiceSpec
from services.cluster.config import ClusterConfig
from services.launch.on_ray import start_actor
from services.kvstore import StoreConfig

ns = "tessera-test-restarts"
ray.init(address=sys.argv[1], namespace=ns, log_to_driver=False)
cfg = ClusterConfig(model_dir="unused", namespace=ns, max_restarts=2, restart_window_s=600)
spec = ServiceSpec("store", "tessera-store-0", store=StoreConfig(dram_bytes=1 << 20), namespace=ns)
actor = start_actor(cfg, spec, 0, 0)


def next_pid(old):
    # the actor's new pid once it is back, or the error that keeps it dead
    end = time.monotonic() + 90
    while time.monotonic() < end:
        try:
            pid = ray.get(actor.pid.remote(), timeout=10)
            if pid != old:
                return pid
        except Exception as exc:
            if "not starting again" in str(exc):
                return str(exc)
        time.sleep(0.25)
    return None


pid = next_pid(None)
print("RESULT", json.dumps({"alive": pid}), flush=True)
sys.stdin.readline()               # the test looks at the sockets of the head, this driver and the actor
results = []
for _ in range(3):
    os.kill(pid, signal.SIGKILL)
    pid = next_pid(pid)
    results.append(pid)
print("RESULT", json.dumps({"after_kills": results}), flush=True)
"""


def _result(driver) -> dict:
    """The driver's next RESULT line (Ray prints its own lines on stdout too); {} once it has ended."""
    for line in driver.stdout:
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {}


def test_restarts_are_limited_to_n_per_window_and_actors_listen_on_loopback(head, tmp_path):
    """A store actor (cheap: no model) under a budget of 2 restarts per 600 s, killed three times: back
    twice, then dead with the reason. While it lives, nothing of the head, the driver or the actor listens
    beyond loopback."""
    env = _clean_env(**head.env())
    with subprocess.Popen([sys.executable, "-c", RESTART_DRIVER, head.address], env=env, cwd=REPO,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "driver.err", "w"),
                          text=True) as driver:
        try:
            alive = _result(driver).get("alive")
            assert isinstance(alive, int), (tmp_path / "driver.err").read_text()[-3000:]
            procs = head_processes(head) + [psutil.Process(driver.pid)]
            assert alive in {p.pid for p in procs}
            _, exposed = _listening(procs)
            assert exposed == [], f"listening beyond loopback: {exposed}"
            driver.stdin.write("go\n")
            driver.stdin.flush()
            kills = _result(driver).get("after_kills")
            assert kills, (tmp_path / "driver.err").read_text()[-3000:]
            first, second, third = kills
        finally:
            driver.kill()
    assert isinstance(first, int) and isinstance(second, int) and len({alive, first, second}) == 3
    assert isinstance(third, str) and "RestartLimitExceeded" in third
    assert "tessera-store-0 restarted 3 times within 600 s, more than the 2 allowed" in third


def test_down_stops_its_own_head_and_nothing_else(head, tmp_path):
    """``tessera down`` stops the head its ``up`` recorded; another Ray head (``head``) and a process that
    looks like a Ray worker of some other session (what ``ray stop`` would kill too) survive."""
    ours = start_local_head(1, tmp_path / "state", RAY_CLI)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                              "ray/_private/workers/default_worker.py", "--session-dir=/tmp/ray/session_other",
                              "--gcs-address=127.0.0.1:1"])
    try:
        our_procs, other_procs = head_processes(ours), head_processes(head)
        assert our_procs and other_procs and not {p.pid for p in our_procs} & {p.pid for p in other_procs}
        state = tmp_path / "state" / "cluster.json"
        state.write_text(json.dumps({"temp": [], "head": asdict(ours), "address": None,
                                     "namespace": "tessera-test-down"}))
        run = subprocess.run([sys.executable, "-m", "services.cli", "down"], cwd=REPO, capture_output=True,
                             text=True, timeout=180, env=_clean_env(TESSERA_STATE=str(state)))
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Tessera is down" in run.stdout
        assert not [p for p in our_procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert not head_processes(ours)
        assert not Path(ours.temp_dir).exists() and not Path(ours.token_path).parent.exists() and not state.exists()
        assert all(p.is_running() for p in other_procs), "tessera down stopped another Ray"
        assert decoy.poll() is None, "tessera down stopped a process of another Ray session"
    finally:
        decoy.kill()
        decoy.wait()
        stop_local_head(ours)
