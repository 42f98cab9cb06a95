"""A GPU worker on Ray sees the GPU Ray assigned it first and its node's other GPUs after it, as the local launcher
starts one, so that hand-offs between a node's GPUs go GPU to GPU; the choice refuses what it cannot make sense of."""

from __future__ import annotations

import pytest

from services.launch.actors import NODE_GPUS_ENV, node_gpu_order


def test_the_assigned_gpu_comes_first_then_the_nodes_others():
    assert node_gpu_order([2], None, 4) == "2,0,1,3"
    assert node_gpu_order(["1"], "", 2) == "1,0"
    # a raylet started under CUDA_VISIBLE_DEVICES: Ray's ids are among those
    assert node_gpu_order(["6"], "4,5,6,7", 4) == "6,4,5,7"
    assert node_gpu_order(["0"], None, 1) == "0"


@pytest.mark.parametrize(("assigned", "inherited", "count", "says"), [
    ([], None, 4, "no GPU"),
    ([4], None, 4, "not among the node's GPUs"),
    (["1"], "4,5", 2, "not among the node's GPUs"),
])
def test_an_assignment_outside_the_node_is_refused(assigned, inherited, count, says):
    with pytest.raises(RuntimeError, match=says):
        node_gpu_order(assigned, inherited, count)


def test_only_gpu_actors_ask_ray_not_to_narrow_their_gpus(tmp_path):
    from services.cluster.config import ClusterConfig
    from services.launch.on_ray import actor_options

    cfg = ClusterConfig(model_dir=str(tmp_path))
    assert actor_options(cfg, "tessera-prefill-0", 1, 1)["runtime_env"] == {"env_vars": NODE_GPUS_ENV}
    assert actor_options(cfg, "tessera-decode-0", 1, 0.5)["runtime_env"] == {"env_vars": NODE_GPUS_ENV}
    assert "runtime_env" not in actor_options(cfg, "tessera-store-0", 1, 0)
    assert "runtime_env" not in actor_options(cfg, "tessera-prefill-0", 1, 0)       # a CPU cluster


def test_outside_ray_nothing_changes(monkeypatch):
    import os

    from services.launch import actors

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv(next(iter(NODE_GPUS_ENV)), "1")
    actors._see_node_gpus("tessera-prefill-0")           # not a Ray actor (Ray may be connected: a driver)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"


@pytest.mark.slow
def test_a_ray_actor_that_was_assigned_no_gpu_refuses_to_choose(local_ray):
    """Inside an actor with the variable set but no GPU (this machine has none), the choice fails loudly rather than
    leave every worker on the node's first GPU."""
    import ray

    from services.launch import actors

    @ray.remote(num_cpus=0, runtime_env={"env_vars": dict(NODE_GPUS_ENV)})
    class Probe:
        def choose(self):
            try:
                actors._see_node_gpus("tessera-prefill-0")
            except RuntimeError as exc:
                return str(exc)
            return "chose"

    probe = Probe.remote()
    try:
        assert ray.get(probe.choose.remote(), timeout=120) == "Ray assigned this GPU worker no GPU"
    finally:
        ray.kill(probe)
