"""The hop key in deploy/ (docs/security.md, "The authenticated hop"; deploy/README.md "The hop
key"): compose's override gives the gateway and every meshserve service the key through a
one-shot job, and the Kubernetes component mounts the Secret into each of their Deployments
(base and gpu overlay) and passes --hop-key-file. No Docker engine and no cluster."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import ROOT, is_job, is_meshserve, need_tool

DEPLOY = ROOT / "deploy"
MESH_DEPLOYMENTS = {"gateway", "onnx", "torchscript", "sequence", "python", "fil", "tensorrt"}


def test_compose_override_gives_every_meshserve_container_the_key() -> None:
    exe = need_tool("docker-compose")
    res = subprocess.run([exe, "-f", "compose.yaml", "-f", "compose.hop-key.yaml", "config"], cwd=DEPLOY,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    services: dict[str, Any] = yaml.safe_load(res.stdout)["services"]
    job = services["hop-key"]
    assert is_job(job) and job["command"] == ["/run/meshserve-hop/hop.key"]
    mesh = {n: s for n, s in services.items() if is_meshserve(s) and not is_job(s)}
    assert {"gateway", "onnx", "python"} <= set(mesh)
    for name, svc in mesh.items():
        assert svc["environment"]["MESHSERVE_HOP_KEY_FILE"] == "/run/meshserve-hop/hop.key", name
        assert any(v.get("source") == "hop-key" and v.get("read_only") for v in svc["volumes"] if isinstance(v, dict)), name
        assert svc["depends_on"]["hop-key"]["condition"] == "service_completed_successfully", name
        assert svc["environment"].get("OTEL_SERVICE_NAME"), name  # (merged with compose.yaml's, not replaced)


@pytest.mark.parametrize("base", ["base", "overlays/gpu"])
def test_k8s_component_mounts_the_secret_into_every_meshserve_deployment(base: str, tmp_path: Path) -> None:
    exe = need_tool("kubectl")
    overlay = DEPLOY / "k8s" / "overlays" / f"hop-key-test-{tmp_path.name}"
    overlay.mkdir()
    try:
        (overlay / "kustomization.yaml").write_text(
            f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [../../{base}]\n"
            "components: [../../components/hop-key]\n")
        res = subprocess.run([exe, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    finally:
        shutil.rmtree(overlay)
    assert res.returncode == 0, res.stderr
    deployments = {d["metadata"]["name"]: d for d in yaml.safe_load_all(res.stdout)
                   if d and d.get("kind") == "Deployment"}
    mesh = set(deployments) & MESH_DEPLOYMENTS
    assert mesh >= {"gateway", "onnx", "python"}
    for name in mesh:
        spec = deployments[name]["spec"]["template"]["spec"]
        container = spec["containers"][0]
        assert container["args"][-2:] == ["--hop-key-file", "/etc/meshserve/hop/hop.key"], name
        assert {"name": "hop-key", "mountPath": "/etc/meshserve/hop", "readOnly": True} in container["volumeMounts"]
        assert {"name": "hop-key", "secret": {"secretName": "meshserve-hop-key", "defaultMode": 0o444}} in spec["volumes"]
    for name in set(deployments) - MESH_DEPLOYMENTS:  # envoy, redis: untouched
        assert "--hop-key-file" not in deployments[name]["spec"]["template"]["spec"]["containers"][0].get("args", [])
