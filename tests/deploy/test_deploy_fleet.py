"""The fleet examples (issue 17 item 6): docker-compose.fleet.yml with config/policy-fleet.yaml,
and the Kustomize overlay k8s-fleet/ over k8s/. Two models, at least two engine replicas each,
every replica listed in the gateway's policy as an upstream it can reach, and the same walls as
the one-engine deployments (tests/deploy/test_deploy_files.py checks their command lines'
flags, secrets and ports for these files too)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from .test_deploy_files import (
    DEPLOY,
    ENGINE,
    IMAGE_UID,
    LOADER,
    compose,
    container,
    flag_value,
    k8s_one,
    load_yaml,
    selects,
    service_networks,
)

FLEET_COMPOSE = "docker-compose.fleet.yml"
OVERLAY = DEPLOY / "k8s-fleet"


def _without_fleet(policy: dict[str, Any]) -> dict[str, Any]:
    rest = copy.deepcopy(policy)
    rest.pop("upstreams", None)
    rest.pop("upstream_strategy", None)
    return rest


def _load_policy_text(text: str, tmp_path: Path):
    from portcullis.gateway.policy.loader import load_policy

    (tmp_path / "policy.yaml").write_text(text)
    return load_policy(tmp_path / "policy.yaml")


# ---- Compose -------------------------------------------------------------------------------

def _engines(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in doc["services"].items() if (s.get("command") or [None])[0] == "engine"}


def test_compose_fleet_runs_two_models_two_replicas_each_behind_the_gateway():
    doc = compose(FLEET_COMPOSE)
    engines = _engines(doc)
    served: dict[str, list[str]] = {}
    for name, service in engines.items():
        served.setdefault(flag_value([str(a) for a in service["command"]], "--served-model-name"), []).append(name)
    assert len(served) >= 2 and all(len(names) >= 2 for names in served.values()), served
    nets = doc["networks"]
    for name, service in engines.items():
        assert "ports" not in service and "expose" not in service and "network_mode" not in service
        assert all(nets[n].get("internal") is True for n in service_networks(service)), name
        assert service["user"] == f"{IMAGE_UID}:{IMAGE_UID}" and service["read_only"] is True
        assert service["cap_drop"] == ["ALL"] and "engine_token" in service["secrets"]
        assert flag_value([str(a) for a in service["command"]], "--token-file") == "/run/secrets/engine_token"
        assert service["healthcheck"]["test"][-1] == "http://127.0.0.1:8001/health"
    gateway = doc["services"]["gateway"]
    assert set(service_networks(engines["engine-chat-1"])) <= set(service_networks(gateway))
    assert {n for n, s in doc["services"].items() if s.get("ports")} == {"gateway"}


def test_compose_fleet_policy_lists_every_engine_and_is_the_deployment_policy_otherwise():
    from portcullis.gateway.policy.loader import load_policy

    doc = compose(FLEET_COMPOSE)
    command = [str(a) for a in doc["services"]["gateway"]["command"]]
    policy_path = DEPLOY / "config" / Path(flag_value(command, "--policy")).relative_to("/etc/portcullis")
    loaded = load_policy(policy_path)
    engines = _engines(doc)
    listed = {urlsplit(u.url).hostname: (u.models, urlsplit(u.url).port) for u in loaded.policy.upstreams}
    assert set(listed) == set(engines), "each engine container is one upstream, and nothing else is"
    for name, service in engines.items():
        argv = [str(a) for a in service["command"]]
        assert listed[name] == ([flag_value(argv, "--served-model-name")], int(flag_value(argv, "--port")))
    base = load_yaml(DEPLOY / "config" / "policy.yaml")
    assert _without_fleet(load_yaml(policy_path)) == base, "policy-fleet.yaml drifted from policy.yaml"
    assert loaded.policy.upstream_strategy == "prefix"


# ---- Kubernetes ----------------------------------------------------------------------------

def _overlay_documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(OVERLAY.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.load_all(path.read_text(), Loader=LOADER) if d]
    return docs


def _statefulsets() -> list[dict[str, Any]]:
    return [d for d in _overlay_documents() if d["kind"] == "StatefulSet"]


def test_kustomize_overlay_builds_on_the_base_and_replaces_its_engine():
    kustomization = load_yaml(OVERLAY / "kustomization.yaml")
    assert "../k8s" in kustomization["resources"] and kustomization["namespace"] == "portcullis"
    for resource in kustomization["resources"]:
        assert (OVERLAY / resource).exists(), resource
    listed = {r for r in kustomization["resources"] if r.endswith(".yaml")}
    assert listed == {p.name for p in OVERLAY.glob("engine-*.yaml")}
    deleted = {(p["target"]["kind"], p["target"]["name"]) for p in kustomization["patches"] if "target" in p}
    assert deleted == {("Deployment", ENGINE), ("Service", ENGINE)}
    assert all("$patch: delete" in p["patch"] for p in kustomization["patches"] if "target" in p)


def test_k8s_fleet_two_models_two_replicas_each_with_the_base_engine_pod():
    base_pod = k8s_one("Deployment", ENGINE)["spec"]["template"]["spec"]
    network_policy = k8s_one("NetworkPolicy", ENGINE)["spec"]["podSelector"]["matchLabels"]
    services = {d["metadata"]["name"]: d for d in _overlay_documents() if d["kind"] == "Service"}
    models = set()
    for sts in _statefulsets():
        spec = sts["spec"]
        assert spec["replicas"] >= 2
        labels = spec["template"]["metadata"]["labels"]
        assert selects(spec["selector"]["matchLabels"], labels)
        assert selects(network_policy, labels), "only gateway pods may reach these engines"
        service = services[spec["serviceName"]]
        assert service["spec"]["clusterIP"] == "None" and service["spec"].get("type", "ClusterIP") == "ClusterIP"
        assert selects(service["spec"]["selector"], labels)
        pod = spec["template"]["spec"]
        for key in ("securityContext", "automountServiceAccountToken", "volumes", "terminationGracePeriodSeconds"):
            assert pod[key] == base_pod[key], f"{sts['metadata']['name']}: {key} differs from the base engine's"
        mine, base = container(sts), base_pod["containers"][0]
        for key in ("securityContext", "volumeMounts", "ports", "startupProbe", "readinessProbe", "livenessProbe",
                    "resources"):
            assert mine[key] == base[key], f"{sts['metadata']['name']}: {key} differs from the base engine's"
        models.add(flag_value(mine["args"], "--served-model-name"))
    assert len(models) >= 2


def test_k8s_fleet_policy_lists_each_pod_by_its_stable_name(tmp_path):
    patch = next(d for d in _overlay_documents() if d["kind"] == "ConfigMap")
    assert patch["metadata"]["name"] == "portcullis-policy"
    text = patch["data"]["policy.yaml"]
    loaded = _load_policy_text(text, tmp_path)
    base_text = k8s_one("ConfigMap", "portcullis-policy")["data"]["policy.yaml"]
    assert _without_fleet(yaml.safe_load(text)) == yaml.safe_load(base_text), "the fleet policy drifted from the base"
    expected = set()
    for sts in _statefulsets():
        name, args = sts["metadata"]["name"], container(sts)["args"]
        port = int(flag_value(args, "--port"))
        for index in range(sts["spec"]["replicas"]):
            expected.add((f"{name}-{index}.{sts['spec']['serviceName']}", port, flag_value(args, "--served-model-name")))
    listed = {(urlsplit(u.url).hostname, urlsplit(u.url).port, *u.models) for u in loaded.policy.upstreams}
    assert listed == expected
