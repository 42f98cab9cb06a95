"""EngineOptions: one frozen, validated object given at construction; the engine launches under its kernel
options and nothing else; workers read theirs from the environment once (services/env.py)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kernels import options as kernel_options
from kernels.options import KernelOptions
from services import env
from services.engine import Engine
from services.engine.options import EngineOptions

from .conftest import random_request

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_the_measured_winners_and_frozen():
    opts = EngineOptions()
    assert (opts.skinny_gemm, opts.reuse_graph, opts.blend_graph) == (True, True, True)
    assert opts.kernels == KernelOptions(pdl=True, tma=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.blend_graph = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.kernels.pdl = False


@pytest.mark.parametrize("kwargs, match", [({"skinny_gemm": 0}, "EngineOptions.skinny_gemm must be True or False"),
                                           ({"blend_graph": "no"}, "EngineOptions.blend_graph must be True or False"),
                                           ({"kernels": {"pdl": False}}, "EngineOptions.kernels must be a KernelOptions"),
                                           ({"index_threads": 0}, "EngineOptions.index_threads must be"),
                                           ({"index_host_dtype": "float16"}, "EngineOptions.index_host_dtype must be"),
                                           ({"layered_prefill": True}, "EngineOptions.layered_prefill must be"),
                                           ({"decode_while_building": 1},
                                            "EngineOptions.decode_while_building must be True or False")])
def test_bad_options_are_refused_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineOptions(**kwargs)
    with pytest.raises(ValueError, match="KernelOptions.tma must be True or False, got None"):
        KernelOptions(tma=None)


def test_an_engine_refuses_what_is_not_an_options_object(tiny_dir):
    with pytest.raises(ValueError, match="options must be an EngineOptions"):
        Engine.load(tiny_dir, options={"blend_graph": False})


def test_the_engine_launches_under_its_own_kernel_options(tiny_dir):
    """Every pass and step runs with the engine's kernel options current, and the caller's come back after; two
    engines in one process do not see each other's."""
    off = EngineOptions(kernels=KernelOptions(pdl=False, tma=False))
    a, b = Engine.load(tiny_dir, options=off), Engine.load(tiny_dir)
    seen = []
    for eng in (a, b):
        embed = eng.forward.model.embed
        eng.forward.model.embed = lambda ids, embed=embed: (seen.append(kernel_options.current()), embed(ids))[1]
    chunks, suffix = random_request(3)
    a.generate(chunks, suffix, max_new_tokens=3, stop_token_ids=[])
    assert seen and set(seen) == {off.kernels}
    seen.clear()
    b.prefill(chunks, suffix)
    assert seen and set(seen) == {KernelOptions()}
    seen.clear()  # the warm-up's direct call of the pass (graphs/warmup.py) too
    _, seq, _ = a._prefill(chunks, suffix, "tessera", 0.0, ids=[a.chunk_id(c) for c in chunks])
    a.release(seq)
    assert seen and set(seen) == {off.kernels}
    assert kernel_options.current() == kernel_options.DEFAULT


def test_general_paths_give_the_graph_paths_tokens(tiny_dir):
    """The options that keep a peer switchable select a path, not a result: an engine with both graph paths off
    generates the default engine's tokens (static tails on, run eagerly on the CPU)."""
    chunks, suffix = random_request(11, lengths=(24, 31), suffix_len=6)
    outs = []
    for opts in (EngineOptions(), EngineOptions(reuse_graph=False, blend_graph=False, skinny_gemm=False)):
        eng = Engine.load(tiny_dir, static_tails=True, options=opts)
        for ratio in (0.0, 0.3):
            eng.prefill(chunks, suffix, recompute_ratio=ratio)  # the chunks cached: the reuse passes below
            outs.append(eng.generate(chunks, suffix, max_new_tokens=5, recompute_ratio=ratio, stop_token_ids=[]))
    assert outs[:2] == outs[2:]


def test_workers_read_their_options_from_the_environment():
    assert EngineOptions.from_env({}) == EngineOptions()
    got = EngineOptions.from_env({"TESSERA_PDL": "0", "TESSERA_BLEND_GRAPH": "0", "TESSERA_SKINNY_GEMM": ""})
    assert got == EngineOptions(blend_graph=False, kernels=KernelOptions(pdl=False))
    with pytest.raises(ValueError, match="TESSERA_TMA must be 0 or 1, got 'off'"):
        EngineOptions.from_env({"TESSERA_TMA": "off"})
    with pytest.raises(KeyError):
        env.read("TESSERA_NOT_A_VARIABLE", {})


def test_every_variable_is_read_in_one_place_and_listed_in_the_readme():
    """Only services/env.py reads os.environ for a TESSERA_ name; README.md's table lists exactly its rows."""
    readers = []
    for folder in ("services", "kernels", "loadgen"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py") or path == ROOT / "services/env.py":
                continue
            text = path.read_text()
            if re.search(r"environ(?:\.get)?[\[(]\s*f?[\"']TESSERA_|getenv\(\s*f?[\"']TESSERA_", text):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == []
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(r"^\| `(TESSERA_[A-Z_]+)` \|", readme, flags=re.M)
    assert rows == [v.name for v in env.VARIABLES]


def test_a_worker_loads_its_engine_with_the_index_host_dtype_it_is_given(tiny_model):
    """EngineSettings.index_host_dtype (ClusterConfig's, ``tessera up --index-host-dtype``) reaches the engine's
    options, beside what the environment turned off."""
    from services.cluster.config import EngineSettings

    for dtype in ("float32", "bfloat16"):
        eng = EngineSettings(tiny_model, index_host_dtype=dtype).load()
        assert eng.forward.options.index_host_dtype == dtype
        assert eng.forward.options.kernels == EngineOptions.from_env().kernels
