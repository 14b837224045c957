"""Static checks of deploy/: compose, Envoy, Dockerfiles, observability configs, Kubernetes.

No Docker engine and no cluster: `docker-compose config`, `envoy --mode validate`,
`kubectl kustomize`, kubernetes-validate, hadolint and promtool do the validating, and the tests
check the topology the files describe. A missing tool skips its test locally and fails in
CI (CI=1).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.support import (
    COMPOSE_FILE,
    DEPLOY,
    ENVOY_FILE,
    GPU_KINDS,
    ROOT,
    SERVICE_KINDS,
    active_services,
    as_env,
    as_list,
    envoy_binary,
    flag,
    flags,
    is_job,
    is_meshserve,
    need_module,
    need_tool,
)

K8S = DEPLOY / "k8s"
TRITON_METRICS = (
    "nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
    "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
    "nv_inference_compute_infer_duration_us",
)
GPU_SERVICES = ("tensorrt", "onnx-gpu", "torchscript-gpu")
OLDEST_KUBERNETES = "1.28.0"


# ---- docker-compose config ----------------------------------------------------------------

@cache
def compose_config(profile: str | None) -> dict[str, Any]:
    exe = need_tool("docker-compose")
    argv = [exe, "-f", str(COMPOSE_FILE.relative_to(ROOT))]
    if profile:
        argv += ["--profile", profile]
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_REPOSITORY", "COMPOSE_PROFILES")}
    res = subprocess.run([*argv, "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"docker-compose config failed:\n{res.stderr}"
    config: dict[str, Any] = yaml.safe_load(res.stdout)
    # docker-compose 1.x prints every service whatever the profile; compose 2 only the active.
    config["active"] = active_services(config, {profile} if profile else set())
    return config


def published_ports(svc: dict[str, Any]) -> dict[int, int]:
    """container port -> published host port, for short and long port syntax."""
    out = {}
    for p in svc.get("ports", []):
        if isinstance(p, dict):
            if p.get("published") is not None:
                out[int(p["target"])] = int(str(p["published"]))
        else:
            parts = str(p).split("/")[0].split(":")
            if len(parts) >= 2:
                out[int(parts[-1])] = int(parts[-2])
    return out


def mounts(svc: dict[str, Any]) -> list[dict[str, Any]]:
    """Volumes in long syntax: type, source, target, read_only."""
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, dict):
            out.append({"source": v.get("source"), "target": v["target"], "read_only": bool(v.get("read_only"))})
        else:
            parts = str(v).split(":")
            mode = parts[2] if len(parts) > 2 else "rw"
            out.append({"source": parts[0], "target": parts[1], "read_only": "ro" in mode.split(",")})
    return out


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_compose_config_is_valid(profile: str | None) -> None:
    config = compose_config(profile)
    active = config["active"]
    expected = {"envoy", "gateway", "onnx", "torchscript", "sequence", "python", "redis", "otel-collector",
                "jaeger", "prometheus", "grafana", "example-models"}
    assert expected <= set(active)
    for name in GPU_SERVICES:
        assert (name in active) == (profile == "gpu"), name


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_compose_health_dependencies_and_restart(profile: str | None) -> None:
    active = compose_config(profile)["active"]
    for name, svc in active.items():
        if is_job(svc):
            assert "healthcheck" not in svc, name
            continue
        hc = svc.get("healthcheck")
        assert hc and not hc.get("disable") and as_list(hc.get("test"))[0] in ("CMD", "CMD-SHELL"), \
            f"{name} has no health check"
        assert svc.get("restart") in ("unless-stopped", "always", "on-failure"), f"{name}: restart policy"
        for dep, cond in (svc.get("depends_on") or {}).items():
            assert dep in active, f"{name} depends on {dep}, which is not started with this profile"
            want = "service_completed_successfully" if is_job(active[dep]) else "service_healthy"
            assert cond.get("condition") == want, f"{name} -> {dep}: {cond}"


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_compose_bind_mounts_exist(profile: str | None) -> None:
    config = compose_config(profile)
    named = set(config.get("volumes") or {})
    for name, svc in config["active"].items():
        for m in mounts(svc):
            if m["source"] and m["source"] not in named:
                assert Path(m["source"]).exists(), f"{name}: bind mount source {m['source']} is missing"


def test_compose_front_door_and_gateway() -> None:
    active = compose_config(None)["active"]
    envoy, gateway = active["envoy"], active["gateway"]
    assert published_ports(envoy) == {8000: 8000, 8001: 8001}, "Envoy publishes HTTP and gRPC only (no admin)"
    for name, svc in active.items():
        if name != "envoy":
            for host in published_ports(svc).values():
                assert name in ("jaeger", "prometheus", "grafana"), f"{name} publishes {host}"
                assert str(svc["ports"]).count("127.0.0.1") >= 1, f"{name}: UI ports bind to loopback"
    assert int(gateway["deploy"]["replicas"]) == 2
    envoy_mounts = {m["target"]: m for m in mounts(envoy)}
    mount = envoy_mounts["/etc/envoy/envoy.yaml"]
    assert Path(mount["source"]) == ENVOY_FILE and mount["read_only"]
    assert as_list(envoy["command"])[-4:-2] == ["-c", "/etc/envoy/envoy.yaml"] or \
        "/etc/envoy/envoy.yaml" in as_list(envoy["command"])

    # Envoy's gateway clusters point at the gateway service's ports.
    cmd = as_list(gateway["command"])
    assert flag(cmd, "--host") == "0.0.0.0"
    clusters = {c["name"]: c for c in yaml.safe_load(ENVOY_FILE.read_text())["static_resources"]["clusters"]}
    for cluster, port_flag in (("gateway_http", "--http-port"), ("gateway_grpc", "--grpc-port")):
        (ep,) = clusters[cluster]["load_assignment"]["endpoints"][0]["lb_endpoints"]
        addr = ep["endpoint"]["address"]["socket_address"]
        assert addr["address"] == "gateway" and addr["port_value"] == int(flag(cmd, port_flag) or 0)
        hc_port = ep["endpoint"].get("health_check_config", {}).get("port_value", addr["port_value"])
        assert hc_port == int(flag(cmd, "--http-port") or 0), "health checks go to the gateway's HTTP port"


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu"])
def test_compose_services_and_upstreams(profile: str | None) -> None:
    config = compose_config(profile)
    active, everything = config["active"], config["services"]
    examples = (ROOT / "examples" / "model_repository").resolve()
    # Every DNS name a meshserve service answers to: its service name and network aliases.
    grpc_by_name: dict[str, set[int]] = {}
    for name, svc in everything.items():
        if not is_meshserve(svc) or is_job(svc):
            continue
        cmd = as_list(svc["command"])
        if cmd[0] != "service":
            continue
        kind = cmd[1]
        assert flag(cmd, "--repository") == "/models" and flag(cmd, "--host") == "0.0.0.0", name
        assert {flag(cmd, "--grpc-port"), flag(cmd, "--http-port"), flag(cmd, "--metrics-port")} == \
            {"8101", "8100", "8102"}, name
        model_mounts = [m for m in mounts(svc) if m["target"] == "/models"]
        assert len(model_mounts) == 1 and model_mounts[0]["read_only"], f"{name}: repository read-only"
        assert Path(model_mounts[0]["source"]).resolve() == examples, name
        assert "8100/v2/health/ready" in " ".join(as_list(svc["healthcheck"]["test"])), name
        env = as_env(svc.get("environment"))
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317", name
        assert env["OTEL_SERVICE_NAME"], name
        aliases = ((svc.get("networks") or {}).get("default") or {}).get("aliases") or []
        for dns in (name, *aliases):
            grpc_by_name.setdefault(dns, set()).add(int(flag(cmd, "--grpc-port") or 0))
        gpu = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        if name in GPU_SERVICES:
            assert svc["profiles"] == ["gpu"] and svc["image"].startswith("meshserve-gpu"), name
            assert gpu and gpu[0]["driver"] == "nvidia" and "gpu" in gpu[0]["capabilities"], name
            assert svc["build"]["dockerfile"].endswith("Dockerfile.gpu"), name
            if name != "tensorrt":
                assert aliases == [kind], f"{name} joins the {kind} pool by DNS alias"
        else:
            assert not gpu and not svc.get("profiles"), name
            assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile", name
    upstreams = flags(as_list(active["gateway"]["command"]), "--upstream")
    assert {u.split(":")[0] for u in upstreams} >= {*SERVICE_KINDS, *GPU_KINDS}
    for u in upstreams:
        host, port = u.rsplit(":", 1)
        assert int(port) in grpc_by_name.get(host, set()), f"--upstream {u} matches no service's gRPC port"
    for dockerfile in {svc["build"]["dockerfile"] for svc in everything.values() if "build" in svc}:
        base = Path(next(s["build"]["context"] for s in everything.values()
                         if s.get("build", {}).get("dockerfile") == dockerfile))
        assert (base / dockerfile).is_file(), dockerfile


def size_bytes(value: str | int) -> int:
    """A compose byte size (shm_size: 1gb, 512m, 67108864) in bytes."""
    m = re.fullmatch(r"(\d+)\s*([kmg]?)b?", str(value).strip().lower())
    assert m, f"not a byte size: {value!r}"
    return int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2)]


def test_compose_python_service() -> None:
    """BLS goes to the gateway's gRPC port by its DNS name; no dependency cycle; room in /dev/shm
    for the tensors the service and its workers exchange; the image with torch."""
    active = compose_config(None)["active"]
    python, gateway = active["python"], active["gateway"]
    cmd = as_list(python["command"])
    assert cmd[:2] == ["service", "python"]
    host, port = (flag(cmd, "--bls-target") or ":").rsplit(":", 1)
    assert host == "gateway" and port == flag(as_list(gateway["command"]), "--grpc-port"), cmd
    assert "gateway" not in (python.get("depends_on") or {}), "the gateways depend on python: a cycle"
    assert "python" in (gateway.get("depends_on") or {})
    assert size_bytes(python["shm_size"]) >= 256 << 20, "Docker's default /dev/shm is 64 MB"
    assert python["image"].split(":")[0] == "meshserve-torch" == active["torchscript"]["image"].split(":")[0]
    assert python["build"] == active["torchscript"]["build"], "one torch image for every service that uses it"


def test_compose_offline_override_builds_every_meshserve_image() -> None:
    """compose.offline.yaml points every meshserve image build at the wheelhouse and local base;
    a service it misses would try the package index in scripts/compose-e2e.sh."""
    exe = need_tool("docker-compose")
    res = subprocess.run([exe, "-f", "deploy/compose.yaml", "-f", "deploy/compose.offline.yaml", "config"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k != "COMPOSE_PROFILES"})
    assert res.returncode == 0, res.stderr
    services = yaml.safe_load(res.stdout)["services"]
    default = compose_config(None)["services"]
    for name, svc in services.items():
        if is_meshserve(svc) and "build" in svc and not name.endswith("gpu") and name != "tensorrt":
            args = svc["build"].get("args") or {}
            assert args.get("WHEELHOUSE") == "1" and args.get("PYTHON_IMAGE"), f"{name}: not built offline"
            want = (default[name]["build"].get("args") or {}).get("MESHSERVE_EXTRAS")
            assert args.get("MESHSERVE_EXTRAS") == want, f"{name}: the offline build installs other extras"


def test_compose_observability_wiring() -> None:
    active = compose_config(None)["active"]
    otel = yaml.safe_load((DEPLOY / "otel-collector.yaml").read_text())
    grpc_endpoint = otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    assert grpc_endpoint.endswith(":4317")
    pipeline = otel["service"]["pipelines"]["traces"]
    for kind in ("receivers", "processors", "exporters"):
        for component in pipeline[kind]:
            assert component in otel[kind], f"pipeline uses undefined {kind[:-1]} {component}"
    assert any(e.split("/")[0] in ("otlp", "otlp_grpc") and otel["exporters"][e]["endpoint"] == "jaeger:4317"
               for e in pipeline["exporters"])
    health = otel["extensions"]["health_check"]["endpoint"]
    assert health.endswith(":13133") and ":13133/" in " ".join(as_list(active["otel-collector"]["healthcheck"]["test"]))

    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    gw_cmd = as_list(active["gateway"]["command"])
    assert jobs["gateway"]["dns_sd_configs"][0]["port"] == int(flag(gw_cmd, "--http-port") or 0)
    svc_sd = jobs["services"]["dns_sd_configs"][0]
    assert set(svc_sd["names"]) >= {*SERVICE_KINDS, *GPU_KINDS}
    assert svc_sd["port"] == int(flag(as_list(active["onnx"]["command"]), "--metrics-port") or 0)
    assert jobs["envoy"]["static_configs"][0]["targets"] == ["envoy:9902"]
    assert jobs["envoy"]["metrics_path"] == "/stats/prometheus"

    # Grafana: provisioned data source uids are the ones the dashboard uses.
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/datasources.yaml").read_text())
    uids = {d["uid"] for d in ds["datasources"]}
    assert {"prometheus", "jaeger"} <= uids
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/dashboards.yaml").read_text())
    graf_mounts = {m["target"]: m for m in mounts(active["grafana"])}
    dash_dir = providers["providers"][0]["options"]["path"]
    assert Path(graf_mounts[dash_dir]["source"]) == DEPLOY / "grafana" / "dashboards"
    home = as_env(active["grafana"]["environment"])["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DEPLOY / "grafana" / "dashboards" / Path(home).relative_to(dash_dir)).is_file()


def test_promtool_checks_prometheus_config() -> None:
    exe = need_tool("promtool")
    res = subprocess.run([exe, "check", "config", str(DEPLOY / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_grafana_dashboard() -> None:
    dash = json.loads((DEPLOY / "grafana/dashboards/meshserve.json").read_text())
    exprs: list[str] = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        exprs += [t["expr"] for t in panel["targets"]]
    text = "\n".join(exprs)
    for metric in TRITON_METRICS:
        assert re.search(rf"\b{metric}\b", text), f"no panel shows {metric}"
    assert "meshserve_gateway_requests_total" in text and "meshserve_gateway_upstream_errors_total" in text
    assert "meshserve_event_loop_lag_seconds_bucket" in text  # (every process: docs/observability.md)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert "_bucket" in variables["histogram"]["definition"] and "histogram_quantile" in text
    assert variables["datasource"]["current"]["value"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


# ---- Envoy --------------------------------------------------------------------------------

def test_envoy_validates() -> None:
    res = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(ENVOY_FILE)],
                         capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "OK" in out, out
    assert "Deprecated field" not in out, out


def test_envoy_routes_and_limits() -> None:
    cfg = yaml.safe_load(ENVOY_FILE.read_text())
    assert cfg["admin"]["address"]["socket_address"]["address"] == "127.0.0.1"
    listeners = {lst["name"]: lst for lst in cfg["static_resources"]["listeners"]}
    assert listeners["http"]["address"]["socket_address"]["port_value"] == 8000
    assert listeners["grpc"]["address"]["socket_address"]["port_value"] == 8001
    text = ENVOY_FILE.read_text()
    assert "envoy.filters.http.buffer" not in text, "a buffer filter would hold whole tensors in memory"
    for name in ("http", "grpc"):
        hcm = listeners[name]["filter_chains"][0]["filters"][0]["typed_config"]
        filters = [f["name"] for f in hcm["http_filters"]]
        assert filters == ["envoy.filters.http.router"], filters
        routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
        default = routes[-1]["route"]
        assert default["timeout"] == "60s"
        assert default["cluster"] == f"gateway_{name}"
    grpc_routes = listeners["grpc"]["filter_chains"][0]["filters"][0]["typed_config"]["route_config"][
        "virtual_hosts"][0]["routes"]
    stream = next(r for r in grpc_routes if r["match"].get("path") == "/inference.GRPCInferenceService/ModelStreamInfer")
    assert stream["route"]["timeout"] == "0s" and stream["route"]["idle_timeout"] == "0s"
    for cluster in cfg["static_resources"]["clusters"]:
        if cluster["name"].startswith("gateway_"):
            assert cluster["type"] == "STRICT_DNS" and cluster["lb_policy"] == "LEAST_REQUEST"
            (hc,) = cluster["health_checks"]
            assert hc["http_health_check"]["path"] == "/v2/health/ready"


# ---- Dockerfiles --------------------------------------------------------------------------

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfile_structure(name: str) -> None:
    instructions = dockerfile_instructions(DEPLOY / "docker" / name)
    froms = [i for i, (word, _) in enumerate(instructions) if word == "FROM"]
    assert len(froms) >= 2, "multi-stage build"
    final = instructions[froms[-1]:]
    users = [arg for word, arg in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), "final stage runs as a non-root user"
    assert ("ENTRYPOINT", '["meshserve"]') in final
    final_runs = " ".join(arg for word, arg in final if word == "RUN")
    for tool in ("gcc", "g++", "build-essential", "python3-dev", "pip install", "python3-pip"):
        assert tool not in final_runs, f"{tool} in the final stage"
    assert any(word == "COPY" and arg.startswith("--from=") for word, arg in final)
    if name == "Dockerfile":
        assert "slim" in instructions[0][1] or any("slim" in a for w, a in instructions if w == "ARG")
    else:
        build_runs = " ".join(arg for word, arg in instructions[:froms[-1]] if word == "RUN")
        assert "[torch,gpu,tensorrt]" in build_runs and "onnxruntime-gpu" in build_runs
        assert any("nvidia/cuda:" in arg and "runtime" in arg for w, arg in instructions if w == "ARG")


def test_hadolint() -> None:
    exe = need_tool("hadolint")
    files = sorted((DEPLOY / "docker").glob("Dockerfile*"))
    res = subprocess.run([exe, *map(str, files)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerignore_sends_only_sources() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "exclude everything, then let sources back in"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert {"pyproject.toml", "meshserve", "gateway", "services", "protos"} <= allowed
    assert not allowed & {"tests", "examples", ".git", "deploy", ".venv"}


# ---- Kubernetes ---------------------------------------------------------------------------

@cache
def kustomize(path: str) -> list[dict[str, Any]]:
    exe = need_tool("kubectl")
    res = subprocess.run([exe, "kustomize", path], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


OVERLAYS = ["deploy/k8s", "deploy/k8s/overlays/gpu", "deploy/k8s/overlays/model-mesh"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("path", OVERLAYS)
def test_kustomize_builds_and_validates(path: str) -> None:
    docs = kustomize(path)
    kv = need_module("kubernetes_validate")
    errors = []
    # The newest schemas kubernetes-validate knows, and an older cluster still in wide use.
    for version in (kv.latest_version(), OLDEST_KUBERNETES):
        for d in docs:
            try:
                kv.validate(d, version, strict=True)
            except Exception as e:  # kubernetes_validate raises several error types
                errors.append(f"{version} {d['kind']}/{d['metadata']['name']}: {e}")
    assert not errors, "\n".join(errors)
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == "meshserve", d["metadata"]["name"]


def _container_ports(deploy: dict[str, Any]) -> dict[str | int, int]:
    ports: dict[str | int, int] = {}
    for c in deploy["spec"]["template"]["spec"]["containers"]:
        for p in c.get("ports", []):
            ports[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                ports[p["name"]] = p["containerPort"]
    return ports


@pytest.mark.parametrize("path", OVERLAYS)
def test_k8s_selectors_probes_and_resources(path: str) -> None:
    docs = kustomize(path)
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    for name, d in deployments.items():
        tmpl_labels = d["spec"]["template"]["metadata"]["labels"]
        selector = d["spec"]["selector"]["matchLabels"]
        assert selector.items() <= tmpl_labels.items(), f"{name}: selector does not match its pods"
        ports = _container_ports(d)
        for c in d["spec"]["template"]["spec"]["containers"]:
            res = c.get("resources", {})
            for section in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(res.get(section, {})), f"{name}/{c['name']}: {section}"
            for probe in ("readinessProbe", "livenessProbe"):
                assert probe in c, f"{name}/{c['name']}: {probe}"
                http = c[probe].get("httpGet")
                if http:
                    assert http["port"] in ports, f"{name}: {probe} port {http['port']} is not a container port"
            if c["image"].split(":")[0] in ("meshserve", "meshserve-gpu"):
                assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready", name
                assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live", name
                args = c["args"]
                http_port = int(flag(args, "--http-port") or 0)
                assert ports[c["readinessProbe"]["httpGet"]["port"]] == http_port, name
    for name, s in services.items():
        selector = s["spec"]["selector"]
        matches = [d for d in deployments.values()
                   if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert len(matches) == 1, f"Service {name} selects {len(matches)} Deployments"
        ports = _container_ports(matches[0])
        for p in s["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) in ports, f"Service {name}: targetPort {p.get('targetPort')}"
    load_balancers = [n for n, s in services.items() if s["spec"].get("type") == "LoadBalancer"]
    assert load_balancers == ["envoy"], "only Envoy is exposed"
    hpa = by_kind(docs, "HorizontalPodAutoscaler")["gateway"]
    assert hpa["spec"]["scaleTargetRef"]["name"] in deployments
    assert hpa["spec"]["minReplicas"] >= 2


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist)."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@pytest.mark.parametrize("path", OVERLAYS)
def test_k8s_only_gateways_reach_the_services(path: str) -> None:
    """Only gateways may reach a service (docs/security.md: defence in depth beside the
    authenticated hop, and a service serves every model to whoever reaches it): every
    service Deployment's pods are selected by an Ingress NetworkPolicy under which their
    inference ports (gRPC, HTTP) admit gateway pods only; the /metrics-only port may stay open;
    the quota store is the gateways' alone."""
    docs = kustomize(path)
    deployments = by_kind(docs, "Deployment")
    policies = [p for p in by_kind(docs, "NetworkPolicy").values() if "Ingress" in p["spec"].get("policyTypes", [])]
    gateway_labels = deployments["gateway"]["spec"]["template"]["metadata"]["labels"]
    service_deployments = {n: d for n, d in deployments.items()
                           if d["spec"]["template"]["spec"]["containers"][0].get("args", [""])[0] == "service"}
    kinds = {*SERVICE_KINDS, *GPU_KINDS} if path.endswith("gpu") else set(SERVICE_KINDS)
    assert set(service_deployments) == kinds

    def guarded(name: str, private_ports: set[int]) -> None:
        d = deployments[name]
        labels = d["spec"]["template"]["metadata"]["labels"]
        mine = [p for p in policies if _selects(p["spec"]["podSelector"], labels)]
        assert mine, f"{name}: no Ingress NetworkPolicy selects its pods"
        reached: set[int] = set()
        for policy in mine:
            for rule in policy["spec"].get("ingress", []):
                ports = {p["port"] for p in rule.get("ports", [])} or {"*"}
                if not ports & (private_ports | {"*"}):
                    continue  # (e.g. the metrics port, open to scrapers)
                peers = rule.get("from")
                assert peers, f"{name}: {policy['metadata']['name']} opens {ports} to everyone"
                for peer in peers:
                    assert set(peer) == {"podSelector"}, f"{name}: {policy['metadata']['name']}: {peer}"
                    selected = [n for n, other in deployments.items()
                                if _selects(peer["podSelector"], other["spec"]["template"]["metadata"]["labels"])]
                    assert selected == ["gateway"], f"{name}: {policy['metadata']['name']} admits {selected}"
                    assert _selects(peer["podSelector"], gateway_labels)
                reached |= ports & private_ports
        assert reached == private_ports, f"{name}: the gateways cannot reach ports {private_ports - reached}"

    for name, d in service_deployments.items():
        args = d["spec"]["template"]["spec"]["containers"][0]["args"]
        guarded(name, {int(flag(args, "--grpc-port") or 0), int(flag(args, "--http-port") or 0)})
    guarded("redis", {6379})


@pytest.mark.parametrize("path", OVERLAYS)
def test_k8s_discovery_storage_and_gpus(path: str) -> None:
    docs = kustomize(path)
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    gpu = path.endswith("gpu")
    gateway = deployments["gateway"]["spec"]["template"]["spec"]["containers"][0]
    upstreams = flags(gateway["args"], "--upstream")
    kinds = {*SERVICE_KINDS, *GPU_KINDS} if gpu else set(SERVICE_KINDS)
    assert {u.split(":")[0] for u in upstreams} == kinds
    assert services["gateway"]["spec"]["clusterIP"] == "None", "Envoy needs one DNS record per gateway pod"
    for u in upstreams:
        host, port = u.rsplit(":", 1)
        svc = services[host]
        assert svc["spec"]["clusterIP"] == "None", f"{host}: headless, so DNS lists every replica"
        assert int(port) in [p["port"] for p in svc["spec"]["ports"]]
        pod = deployments[host]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["args"][:2] == ["service", host] and flag(c["args"], "--grpc-port") == port
        models = [m for m in c["volumeMounts"] if m["mountPath"] == "/models"]
        assert models and models[0]["readOnly"], host
        claim = next(v for v in pod["volumes"] if v["name"] == models[0]["name"])["persistentVolumeClaim"]
        assert claim["claimName"] == "model-repository" and claim["readOnly"]
        wants_gpu = gpu and host in ("tensorrt", "onnx", "torchscript")
        limits = c["resources"]["limits"]
        assert (limits.get("nvidia.com/gpu") == "1") == wants_gpu, host
        assert c["image"].split(":")[0] == ("meshserve-gpu" if wants_gpu else "meshserve"), host
        if wants_gpu:
            assert any(t["key"] == "nvidia.com/gpu" for t in pod.get("tolerations", [])), host
    assert "model-repository" in by_kind(docs, "PersistentVolumeClaim")
    assert "redis" in deployments and "redis" in services

    # The python service: BLS to the gateway Service's gRPC port, /dev/shm sized for its tensors.
    pod = deployments["python"]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    host, port = (flag(c["args"], "--bls-target") or ":").rsplit(":", 1)
    assert host == "gateway" and port == flag(gateway["args"], "--grpc-port"), c["args"]
    assert int(port) in [p["port"] for p in services["gateway"]["spec"]["ports"]]
    (shm,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    shm_volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])["emptyDir"]
    assert shm_volume["medium"] == "Memory" and shm_volume["sizeLimit"], shm_volume

    # The gateway's tenants, routes and quota store: the ConfigMap at /config, the redis Service.
    store = flag(gateway["args"], "--quota-store") or ""
    m = re.fullmatch(r"redis://([a-z0-9-]+):(\d+)(/\d+)?", store)
    assert m and int(m.group(2)) in [p["port"] for p in services[m.group(1)]["spec"]["ports"]], store
    (config,) = [m for m in gateway["volumeMounts"] if m["mountPath"] == "/config"]
    gw_pod = deployments["gateway"]["spec"]["template"]["spec"]
    assert next(v for v in gw_pod["volumes"] if v["name"] == config["name"])["configMap"]["name"].startswith(
        "gateway-config")
    assert flag(gateway["args"], "--tenants") == "/config/tenants.yaml"
    assert flag(gateway["args"], "--routes") == "/config/routes.yaml"
    cms = {n.rsplit("-", 1)[0]: cm for n, cm in by_kind(docs, "ConfigMap").items()}
    assert {"routes.yaml", "tenants.yaml"} <= set(cms["gateway-config"]["data"])
    assert cms["envoy-bootstrap"]["data"]["envoy.yaml"] == ENVOY_FILE.read_text(), \
        "deploy/k8s/base/envoy-bootstrap.yaml must be a copy of deploy/envoy.yaml"


# ---- the mesh flags of the services (docs/model-mesh.md): said in every deployment ------------

def _compose_with_mesh() -> dict[str, Any]:
    exe = need_tool("docker-compose")
    env = {k: v for k, v in os.environ.items() if k not in ("MODEL_REPOSITORY", "COMPOSE_PROFILES")}
    res = subprocess.run([exe, "-f", str(COMPOSE_FILE.relative_to(ROOT)), "-f", "deploy/compose.mesh.yaml", "config"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"docker-compose config failed:\n{res.stderr}"
    return yaml.safe_load(res.stdout)["services"]  # type: ignore[no-any-return]


def _meshserve_commands() -> dict[str, list[str]]:
    """Every meshserve command line of the deployments: compose (every profile, and the mesh
    override on top) and each Kubernetes overlay, by where it is."""
    out = {f"compose {name}": as_list(svc["command"]) for name, svc in compose_config("gpu")["services"].items()
           if is_meshserve(svc) and not is_job(svc)}
    out.update({f"compose.mesh {name}": as_list(svc["command"]) for name, svc in _compose_with_mesh().items()
                if is_meshserve(svc) and not is_job(svc)})
    for path in OVERLAYS:
        for name, d in by_kind(kustomize(path), "Deployment").items():
            c = d["spec"]["template"]["spec"]["containers"][0]
            if c["image"].split(":")[0].startswith("meshserve"):
                out[f"{path} {name}"] = [str(a) for a in c["args"]]
    return out


def test_every_meshserve_command_of_the_deployments_parses_and_says_the_mesh_flags() -> None:
    """Each command line is one meshserve's own parser accepts (a misspelt or retired flag fails
    here, not in a pod's crash loop); a service that manages models (the mesh's onnx) says its
    eviction grace, each GPU service its GPU memory budget, with the defaults."""
    from meshserve.cli import build_parser

    parser = build_parser()
    commands = _meshserve_commands()
    for where, cmd in commands.items():
        try:
            parser.parse_args(cmd)
        except SystemExit:
            pytest.fail(f"{where}: meshserve refuses {cmd}")
    for where in ("compose.mesh onnx", "deploy/k8s/overlays/model-mesh onnx"):
        assert flag(commands[where], "--eviction-grace") == "2", (where, commands[where])
    gpu = [w for w in commands if w.split()[-1] in GPU_SERVICES
           or (w.startswith("deploy/k8s/overlays/gpu ") and w.split()[-1] in GPU_KINDS + ("onnx", "torchscript"))]
    assert len(gpu) >= 6, sorted(commands)  # compose: 3 (+ the same under the mesh override); k8s: 3
    for where in gpu:
        assert flag(commands[where], "--gpu-memory-budget") == "80%", (where, commands[where])
