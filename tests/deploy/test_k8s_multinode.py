"""deploy/k8s-multinode: one engine over two GPU pods (a LeaderWorkerSet): both pods run the same
engine flags, the leader is node 0 and serves, the worker joins it --headless, only the leader is
behind the engine Service, and the group's unauthenticated channel is closed to every other pod."""
from __future__ import annotations

from pathlib import Path

import yaml

from portcullis.engine.server.cli import build_parser

FOLDER = Path(__file__).resolve().parents[2] / "deploy" / "k8s-multinode"
ENGINE = {"app.kubernetes.io/name": "portcullis", "app.kubernetes.io/component": "engine"}
# What differs between a node 0 and the others; every other flag must be the same on both.
PER_NODE = {"node_rank", "headless", "host", "port", "token_file"}


def _group() -> dict:
    return yaml.safe_load((FOLDER / "engine-leaderworkerset.yaml").read_text())["spec"]["leaderWorkerTemplate"]


def _args(template: dict) -> list[str]:
    (container,) = template["spec"]["containers"]
    assert container["args"][0] == "engine"
    # Kubernetes expands $(VAR) from the pod's environment; the LeaderWorkerSet sets these two.
    values = {"$(LWS_LEADER_ADDRESS)": "10.0.0.7", "$(LWS_WORKER_INDEX)": "1"}
    return [values.get(a, a) for a in container["args"][1:]]


def test_leader_and_worker_run_one_engine_as_node_0_and_a_headless_node():
    group = _group()
    leader = vars(build_parser().parse_args(_args(group["leaderTemplate"])))
    worker = vars(build_parser().parse_args(_args(group["workerTemplate"])))
    assert leader["node_rank"] == 0 and not leader["headless"] and leader["port"] == 8001
    assert worker["node_rank"] == 1 and worker["headless"]
    assert {k: v for k, v in leader.items() if k not in PER_NODE} == {k: v for k, v in worker.items() if k not in PER_NODE}
    assert leader["nnodes"] == group["size"] == 2
    assert leader["pipeline_parallel_size"] * leader["tensor_parallel_size"] % leader["nnodes"] == 0
    assert "$(LWS_LEADER_ADDRESS)" in group["leaderTemplate"]["spec"]["containers"][0]["args"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost rank ends the group
    for template in (group["leaderTemplate"], group["workerTemplate"]):
        assert template["metadata"]["labels"] == ENGINE
        (container,) = template["spec"]["containers"]
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
        assert container["resources"]["limits"]["nvidia.com/gpu"] >= 1
        assert template["spec"]["affinity"]["podAntiAffinity"], "the group's pods belong on different nodes"
    worker_volumes = {v["name"] for v in group["workerTemplate"]["spec"]["volumes"]}
    assert "engine-token" not in worker_volumes, "the worker serves nothing: it holds no token"


def test_only_the_leader_is_behind_the_engine_service():
    patch = yaml.safe_load((FOLDER / "engine-service-patch.yaml").read_text())
    assert patch["metadata"]["name"] == "portcullis-engine"
    assert patch["spec"]["selector"] == {**ENGINE, "leaderworkerset.sigs.k8s.io/worker-index": "0"}


def test_the_groups_channel_is_open_to_its_own_pods_only():
    policy = yaml.safe_load((FOLDER / "networkpolicy-group.yaml").read_text())["spec"]
    assert policy["podSelector"]["matchLabels"] == ENGINE
    assert [peer["podSelector"]["matchLabels"] for rule in policy["ingress"] for peer in rule["from"]] == [ENGINE]
    to_pods = [peer for rule in policy["egress"] for peer in rule["to"] if "namespaceSelector" not in peer]
    assert [peer["podSelector"]["matchLabels"] for peer in to_pods] == [ENGINE]
    dns = [rule for rule in policy["egress"] if any("namespaceSelector" in peer for peer in rule["to"])]
    assert all(p["port"] == 53 for rule in dns for p in rule["ports"])


def test_kustomization_replaces_the_single_pod_engine():
    kustomization = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())
    assert set(kustomization["resources"]) == {"../k8s", "engine-leaderworkerset.yaml", "networkpolicy-group.yaml"}
    deleted = [p for p in kustomization["patches"] if "patch" in p and "$patch: delete" in p["patch"]]
    assert [p["target"] for p in deleted] == [{"kind": "Deployment", "name": "portcullis-engine"}]
    assert {"path": "engine-service-patch.yaml"} in kustomization["patches"]
    present = {p.name for p in FOLDER.glob("*.yaml")} - {"kustomization.yaml"}
    listed = set(kustomization["resources"]) - {"../k8s"} | {p["path"] for p in kustomization["patches"] if "path" in p}
    assert listed == present
