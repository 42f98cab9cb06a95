"""The Kubernetes deployment: helm/tessera (chart) and k8s/ (the same objects as plain manifests, kustomize).

No cluster and no helm binary here: the chart is checked for what can go wrong without rendering it (every value
a template reads exists, template blocks close, the job's flags are options of `tessera up`), the plain manifests
by parsing them, their `tessera up` arguments with the command's own parser, and against the chart's defaults.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from services.cli import build_parser
from services.cluster.config import ClusterConfig
from services.launch.on_ray import GATEWAY_NAME, HEAD_RESOURCE, actor_options

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "tessera"
K8S = ROOT / "k8s"
TEMPLATES = sorted((CHART / "templates").glob("*"))


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _k8s() -> dict[str, dict]:
    docs = [d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["kind"]: d for d in docs}


def _job_args(job: dict) -> list[str]:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["tessera", "up"]
    return [str(a) for a in container["args"]]


def test_only_the_gateway_is_pinned_to_the_head_and_only_when_asked():
    on = ClusterConfig(model_dir="m", gateway_on_head=True)
    assert actor_options(on, GATEWAY_NAME, 0, 0)["resources"] == {HEAD_RESOURCE: 0.01}
    for name in ("tessera-prefill-0", "tessera-decode-0", "tessera-store-0"):
        assert "resources" not in actor_options(on, name, 1, 1)
    assert "resources" not in actor_options(ClusterConfig(model_dir="m"), GATEWAY_NAME, 0, 0)


def test_chart_metadata_and_values():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "tessera" and chart["version"]
    values = _values()
    assert {"image", "model", "tessera", "head", "gpuWorkers", "storage", "service", "bootstrap"} <= set(values)
    assert {t.name for t in TEMPLATES} >= {"_helpers.tpl", "raycluster.yaml", "bootstrap-job.yaml", "service.yaml"}


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_every_value_a_template_reads_is_in_values_yaml(template):
    values = _values()
    used = set(re.findall(r"\.Values\.([A-Za-z0-9_.]+)", template.read_text()))
    for path in used:
        node = values
        for key in path.split("."):
            assert isinstance(node, dict) and key in node, f"{template.name} reads .Values.{path}, not in values.yaml"
            node = node[key]


@pytest.mark.parametrize("template", TEMPLATES, ids=lambda p: p.name)
def test_template_actions_are_balanced(template):
    text = template.read_text()
    assert text.count("{{") == text.count("}}")
    actions = re.findall(r"\{\{-?\s*(\w+)", text)
    opened = sum(a in ("if", "with", "range", "define") for a in actions)
    assert opened == actions.count("end"), f"{template.name}: {opened} blocks opened, {actions.count('end')} ended"


def test_the_charts_job_passes_only_options_tessera_up_has():
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = {s for action in commands.choices["up"]._actions for s in action.option_strings}
    flags = re.findall(r"^\s*- (--[a-z-]+)", (CHART / "templates" / "bootstrap-job.yaml").read_text(), re.M)
    assert flags and set(flags) <= options, set(flags) - options
    # the plain job passes the same flags (the chart adds these only when their values are set)
    k8s_flags = {a for a in _job_args(_k8s()["Job"]) if a.startswith("--")}
    assert k8s_flags == set(flags) - {"--warmup-tokens", "--certs-dir", "--tenants"}


def test_the_plain_manifests_are_the_charts_defaults():
    objs, values = _k8s(), _values()
    assert set(objs) == {"RayCluster", "Job", "Service"}
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / r).is_file() for r in kust["resources"])
    args = build_parser().parse_args(["up", *_job_args(objs["Job"])])  # the command's own parser takes them
    t = values["tessera"]
    assert (args.prefill, args.decode, args.stores, args.port) == (t["prefill"], t["decode"], t["stores"], t["port"])
    assert args.model == values["model"]["path"] and args.gateway_on_head and args.device == "cuda"
    assert args.address == "ray://tessera-head-svc:10001" and args.host == "0.0.0.0"
    assert args.store_dir.startswith(values["storage"]["mountPath"] + "/")
    ray = objs["RayCluster"]["spec"]
    (group,) = ray["workerGroupSpecs"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == args.prefill + args.decode
    (worker,) = group["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == values["gpuWorkers"]["gpusPerPod"] == 1
    assert ray["rayVersion"] == values["head"]["rayVersion"]
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    heads = ray["headGroupSpec"]["template"]["spec"]["containers"]
    assert {c["image"] for c in [*heads, worker, *objs["Job"]["spec"]["template"]["spec"]["containers"]]} == {image}
    assert {p["containerPort"] for p in heads[0]["ports"]} >= {6379, 10001, args.port}
    svc = objs["Service"]["spec"]
    assert svc["selector"] == {"ray.io/cluster": "tessera", "ray.io/node-type": "head"}
    assert svc["ports"][0]["targetPort"] == args.port and svc["ports"][0]["port"] == values["service"]["port"]
    for spec in (ray["headGroupSpec"]["template"]["spec"], group["template"]["spec"],
                 objs["Job"]["spec"]["template"]["spec"]):
        assert {v["name"] for v in spec["volumes"]} == {"model", "data"}
        assert spec["volumes"][0]["hostPath"]["path"] == values["model"]["hostPath"]


def test_the_ray_version_is_the_one_the_project_pins():
    pins = (ROOT / "pyproject.toml").read_text()
    assert f'"ray=={_values()["head"]["rayVersion"]}"' in pins
