"""The Helm chart rendered by the real `helm` (v3.17.1, which `scripts/setup.sh --test` installs
into the venv), not only read by Python (tests/test_deploy.py does that):
- `helm lint --strict` passes with the default values and with docs/DEPLOY.md's autoscaling
  example, on either autoscaler;
- `helm template` renders every combination the chart offers (autoscaling off, KEDA or HPA; nodes
  of one pod or a LeaderWorkerSet; the ServiceMonitor) into well-formed Kubernetes objects, each
  named once;
- the launch ConfigMap that the pods read is what `pdserve launch` needs: every pod's command line
  made from the rendered values.json parses with the real subcommand parsers;
- each autoscaler scales a StatefulSet of the same render, between the values' bounds;
- minReplicas over maxReplicas fails the render, naming the role.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from tests.test_deploy import (
    CHART,
    NODE_GROUPS,
    ROOT,
    autoscaled_values,
    chart_autoscaling_launch_values,
    load_yaml,
    parsed,
)

HELM = ROOT / ".venv" / "bin" / "helm"
HELM_BIN = str(HELM) if HELM.exists() else shutil.which("helm")
pytestmark = pytest.mark.skipif(
    HELM_BIN is None, reason="no helm: scripts/setup.sh --test installs it into .venv/bin"
)
RELEASE = "pd"


def helm(*args: str, values: dict | None = None, tmp=None) -> subprocess.CompletedProcess:
    cmd = [str(HELM_BIN), *args, str(CHART)]
    if values is not None:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(path)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def render(values: dict, tmp) -> list[dict]:
    out = helm("template", RELEASE, values=values, tmp=tmp)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def variants() -> dict[str, dict]:
    base = load_yaml(CHART / "values.yaml")
    auto = autoscaled_values()
    hpa = json.loads(json.dumps(auto))
    hpa["autoscaling"]["provider"] = "hpa"
    lws = json.loads(json.dumps(auto))
    lws["lws"]["enabled"] = True
    for role in NODE_GROUPS:
        lws[role]["ranksPerPod"] = 1
    return {"defaults": base, "keda": auto, "hpa": hpa, "keda-lws": lws}


@pytest.mark.parametrize("name", ["defaults", "keda", "hpa"])
def test_lint_strict(name, tmp_path):
    out = helm("lint", "--strict", values=variants()[name], tmp=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("name", ["defaults", "keda", "hpa", "keda-lws"])
def test_renders_objects_whose_pods_launch(name, tmp_path, monkeypatch):
    from pdserve import launch

    values = variants()[name]
    docs = render(values, tmp_path)
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert all(d.get("apiVersion") for d in docs)
    assert len(keys) == len(set(keys)), "an object is rendered twice"
    kinds = {k for k, _ in keys}
    assert {"Deployment", "Service", "ConfigMap", "Secret"} <= kinds
    node_kind = "LeaderWorkerSet" if values["lws"]["enabled"] else "StatefulSet"
    nodes = {n for k, n in keys if k == node_kind}
    assert len(nodes) == len(NODE_GROUPS), keys

    # the values.json every pod reads, as rendered, through `pdserve launch`
    (launch_cm,) = [
        d for d in docs if d["kind"] == "ConfigMap" and "values.json" in d.get("data", {})
    ]
    rendered = json.loads(launch_cm["data"]["values.json"])
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "leader.lws")
    for role in NODE_GROUPS:
        for rank in range(launch.pods_per_node(rendered, role)):
            args = parsed(launch.argv_for(rendered, role, 0, rank, "0.0.0.0"))
            assert args.pp == values[role]["pp"] and args.node_rank == rank
    parsed(launch.argv_for(rendered, "router", 0, 0, "0.0.0.0"))
    if values["autoscaling"]["enabled"]:
        assert rendered["autoscaling"] == chart_autoscaling_launch_values(values)
    else:
        assert "autoscaling" not in rendered
    mounted = {
        v["configMap"]["name"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for v in d["spec"]["template"]["spec"].get("volumes", [])
        if "configMap" in v
    }
    assert launch_cm["metadata"]["name"] in mounted


@pytest.mark.parametrize("name", ["keda", "hpa"])
def test_autoscalers_scale_the_rendered_nodes(name, tmp_path):
    values = variants()[name]
    docs = render(values, tmp_path)
    sets = {d["metadata"]["name"] for d in docs if d["kind"] == "StatefulSet"}
    kind = "ScaledObject" if name == "keda" else "HorizontalPodAutoscaler"
    scalers = [d for d in docs if d["kind"] == kind]
    assert len(scalers) == len(NODE_GROUPS)
    for role in NODE_GROUPS:
        want = values["autoscaling"][role]
        (scaler,) = [s for s in scalers if s["spec"]["scaleTargetRef"]["name"].endswith(role)]
        spec = scaler["spec"]
        assert spec["scaleTargetRef"]["name"] in sets
        assert spec["scaleTargetRef"].get("kind", "StatefulSet") == "StatefulSet"
        lo, hi = (
            ("minReplicaCount", "maxReplicaCount")
            if name == "keda"
            else ("minReplicas", "maxReplicas")
        )
        assert (spec[lo], spec[hi]) == (want["minReplicas"], want["maxReplicas"])
        # the register sidecar sends the pod's ordinal, which a scale-down stops from the top
        (nodes,) = [
            d
            for d in docs
            if d["kind"] == "StatefulSet"
            and d["metadata"]["name"] == spec["scaleTargetRef"]["name"]
        ]
        pod = nodes["spec"]["template"]["spec"]
        (register,) = [c for c in pod["containers"] if c["name"] == "register"]
        env = {e["name"]: e for e in register["env"]}
        ordinal = env["PDSERVE_REPLICA"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert ordinal == "metadata.labels['apps.kubernetes.io/pod-index']"


def test_min_over_max_replicas_fails_the_render(tmp_path):
    values = autoscaled_values()
    values["autoscaling"]["decode"] = {"minReplicas": 5, "maxReplicas": 2}
    out = helm("template", RELEASE, values=values, tmp=tmp_path)
    assert out.returncode != 0
    assert "decode" in out.stderr and "minReplicas" in out.stderr, out.stderr
