"""A decode worker and its retrieval index service on one Ray node: one placement group per pair.

The index service answers the worker's searches at every layer of every retrieval step, so it runs on the worker's
node (no network hop but loopback). Each pair shares a placement group of one bundle holding the decode worker's
resources (a CPU, its GPU share): Ray reserves the bundle on a node that has them and places both actors in it, the
index service first (the worker's spec carries its address). A restarted actor comes back in its bundle, so on the
same node; a bundle whose node dies is placed again, both actors with it.

NOTE: the index service asks Ray for no CPU of its own: its threads (``ClusterConfig.index_threads``) are a share of
the node's cores that Ray's logical CPUs do not count. Asking for them would leave ``tessera up``'s own head (one
logical CPU per worker) unable to place it, and a GPU pod sized for its worker likewise.

Groups are named ``tessera/<namespace>/<decode worker>``, detached with a detached cluster (they must outlive
``tessera up``); ``remove_groups`` removes a namespace's (``tessera down``, a cluster's stop or failed start), which
also ends any actor still in them.
"""

from __future__ import annotations

from services.cluster.config import ClusterConfig


def group_name(namespace: str, decode: str) -> str:
    return f"tessera/{namespace}/{decode}"


def make_group(cfg: ClusterConfig, decode: str, num_cpus: float, num_gpus: float):
    """A new placement group for decode worker ``decode`` and its index service: one bundle, the worker's resources
    (created asynchronously: an actor placed in it starts once Ray has reserved it)."""
    from ray.util.placement_group import placement_group

    bundle = {"CPU": float(num_cpus), **({"GPU": float(num_gpus)} if num_gpus else {})}
    return placement_group([bundle], name=group_name(cfg.namespace, decode),
                           lifetime="detached" if cfg.detached else None)


def in_group(group) -> dict:
    """Ray actor options that place an actor in ``group``'s bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return {"scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0)}


def remove_groups(namespace: str) -> list[str]:
    """Remove the placement groups of the cluster in ``namespace``; returns their names."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup, placement_group_table, remove_placement_group

    prefix = group_name(namespace, "")
    removed = []
    for group_id, entry in placement_group_table().items():
        if entry["name"].startswith(prefix) and entry["state"] != "REMOVED":
            remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(group_id)))
            removed.append(entry["name"])
    return sorted(removed)
