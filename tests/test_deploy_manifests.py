"""deploy/ checked without a cluster, Docker or a GPU: the Kubernetes manifests against the API's schemas
(kubernetes-validate's bundled copies, offline) and against each other (selectors, ports, probes, the drain's time
budget, the autoscaler's query), the compose file, the HAProxy configuration as HAProxy itself parses it for 1 to 8
workers, the launcher's shell, and the Dockerfile's promises (CUDA runtime base, non-root, no weights inside).
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from conftest import system_tool
from kubernetes_validate.utils import SchemaNotFoundError

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CUSTOM_KINDS = {"ScaledObject", "ServiceMonitor", "Kustomization"}  # CRDs and kustomize: no bundled schema
K8S_VERSIONS = ("1.28", "1.37")  # the oldest cluster the manifests aim at, and the newest schema bundled


def documents() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def one(kind: str, name: str = "rtts") -> dict[str, Any]:
    [doc] = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def seconds(value: str | int) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h)?", str(value))
    assert m, value
    return int(m[1]) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}[m[2]]


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def documented_metrics() -> set[str]:
    return set(re.findall(r"^\| `(rtts_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text(), re.M))


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any attempt to open a network connection fails the test: the validation must use bundled schemas."""

    def refuse(*args: Any, **kw: Any) -> None:
        raise AssertionError("network access during validation")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    yield


# ----------------------------------------------------------------------------------------------------- Kubernetes


def test_manifests_validate_against_the_kubernetes_schemas(offline: None) -> None:
    checked = set()
    for name, doc in documents():
        if doc["kind"] in CUSTOM_KINDS:
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as e:
                pytest.fail(f"{name}: {doc['kind']} invalid for Kubernetes {version}: {e}")
        checked.add(doc["kind"])
    assert {"Deployment", "Service", "Ingress", "PodDisruptionBudget", "PersistentVolumeClaim", "Pod"} <= checked


def test_a_broken_manifest_is_caught() -> None:
    """The validator is not a rubber stamp: a misspelt field and a wrong type fail."""
    doc = one("Deployment")
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    with pytest.raises(SchemaNotFoundError):
        kubernetes_validate.validate(one("ScaledObject"), K8S_VERSIONS[-1], strict=True)


def test_the_deployment_serves_one_gpu_per_pod_and_drains_within_its_grace() -> None:
    dep = one("Deployment")
    pod = dep["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    args = c["args"]
    assert args[0] == "serve" and flag(args, "--device") == "cuda" and flag(args, "--host") == "0.0.0.0"
    port = int(flag(args, "--port"))
    assert [p["containerPort"] for p in c["ports"] if p["name"] == "http"] == [port]
    # Readiness leaves the endpoints while draining; liveness stays up while draining (tests/test_drain.py checks
    # both routes' answers), and a slow start is the startup probe's.
    assert c["readinessProbe"]["httpGet"]["path"] == "/v1/health"
    assert c["livenessProbe"]["httpGet"]["path"] == "/v1/health?live=1"
    start = c["startupProbe"]
    assert start["httpGet"]["path"] == "/v1/health?live=1"
    assert start["periodSeconds"] * start["failureThreshold"] >= 600  # minutes to load, capture graphs, warm up
    # SIGTERM comes after preStop; the drain must end before the kubelet's SIGKILL.
    pre_stop = c["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    budget = float(pre_stop[1]) + float(flag(args, "--drain-grace")) + 10
    assert pod["terminationGracePeriodSeconds"] >= budget, (pod["terminationGracePeriodSeconds"], budget)
    # Non-root, as the image is built; the checkpoint is read-only.
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert flag(args, "--checkpoint").startswith("/models/") and mounts["/models"]["readOnly"]
    assert flag(args, "--voices-dir") in mounts
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_the_other_manifests_point_at_the_deployment() -> None:
    dep, svc = one("Deployment"), one("Service")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    [port] = svc["spec"]["ports"]
    assert port["targetPort"] == "http"
    pdb = one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items() and pdb["spec"]["maxUnavailable"] == 1
    ing = one("Ingress")
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "rtts", "port": {"name": port["name"]}}
    notes = ing["metadata"]["annotations"]
    assert seconds(notes["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 3600  # a call's socket
    assert notes["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # streamed audio
    assert "http_503" in notes["nginx.ingress.kubernetes.io/proxy-next-upstream"]  # a draining pod's refusal
    mon = one("ServiceMonitor")
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert mon["spec"]["endpoints"][0]["port"] == port["name"] and mon["spec"]["endpoints"][0]["path"] == "/metrics"
    claims = {v["persistentVolumeClaim"]["claimName"] for v in dep["spec"]["template"]["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    assert claims <= {d["metadata"]["name"] for _, d in documents() if d["kind"] == "PersistentVolumeClaim"}


def test_keda_scales_on_what_rtts_exports() -> None:
    so, dep = one("ScaledObject"), one("Deployment")
    assert so["apiVersion"] == "keda.sh/v1alpha1"
    assert so["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    [trigger] = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    query = trigger["metadata"]["query"]
    used = set(re.findall(r"rtts_[a-z_]+", query))
    assert used and used <= documented_metrics(), used - documented_metrics()
    # The target per pod is below what a pod serves (--max-running), so that a burst finds room while a pod starts.
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert 0 < float(trigger["metadata"]["threshold"]) < int(flag(args, "--max-running"))
    # The monitor's job label is the Service's name, which the query selects.
    assert f'job="{one("Service")["metadata"]["name"]}"' in query


def test_the_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = set(kust["resources"])
    assert all((K8S / r).is_file() for r in listed)
    # The one-off loader pod stays out: it runs once, before the rest.
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "models-loader.yaml"}
    assert [i["name"] for i in kust["images"]] == [one("Deployment")["spec"]["template"]["spec"]["containers"][0]
                                                   ["image"].split(":")[0]]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return  # (the structure above is what kustomize reads; rendering it is a bonus where kubectl exists)
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert {d["kind"] for d in rendered} >= {"Deployment", "Service", "Ingress", "PodDisruptionBudget",
                                             "ScaledObject", "ServiceMonitor", "Namespace"}
    assert all(d["metadata"].get("namespace") == "rtts" for d in rendered if d["kind"] != "Namespace")


# --------------------------------------------------------------------------------------------------- HAProxy, shell


def render(*addrs: str) -> str:
    out = subprocess.run([str(DEPLOY / "render-haproxy.sh"), *addrs], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("workers", [1, 2, 8])
def test_haproxy_accepts_the_rendered_configuration(workers: int, tmp_path: Path) -> None:
    haproxy = system_tool("haproxy")
    text = render(*(f"127.0.0.1:{8081 + i}" for i in range(workers)))
    assert len(re.findall(r"^    server w\d+ 127\.0\.0\.1:\d+$", text, re.M)) == workers
    for needed in ("balance leastconn", "http-check send meth GET uri /v1/health", "http-check expect status 200",
                   "timeout tunnel", "retry-on conn-failure empty-response 503", "option http-buffer-request"):
        assert needed in text, needed
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(text)
    for env in ({}, {"RTTS_LB_DNS": "127.0.0.11:53", "RTTS_LB_BIND": "127.0.0.1:18080"}):
        out = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True, timeout=30,
                             env={"PATH": "/usr/bin:/bin", **env})
        assert out.returncode == 0, out.stdout + out.stderr
        assert "ALERT" not in out.stdout + out.stderr


def test_haproxy_refuses_a_broken_configuration(tmp_path: Path) -> None:
    haproxy = system_tool("haproxy")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(render("127.0.0.1:8081").replace("balance leastconn", "balance fewestconn"))
    assert subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, timeout=30).returncode != 0


def test_render_refuses_bad_arguments() -> None:
    for args in ([], ["localhost"]):
        out = subprocess.run([str(DEPLOY / "render-haproxy.sh"), *args], capture_output=True, text=True, timeout=30)
        assert out.returncode == 2 and out.stderr


def test_the_launcher_parses_and_explains_itself() -> None:
    assert subprocess.run(["bash", "-n", str(DEPLOY / "launch.sh")], timeout=30).returncode == 0
    out = subprocess.run(["bash", str(DEPLOY / "launch.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "--gpus" in out.stdout and "--drain-grace" in out.stdout
    out = subprocess.run(["bash", str(DEPLOY / "launch.sh"), "--frobnicate"], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2 and "unknown option" in out.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck is not None:  # (not installed in CI: bash -n above is the floor)
        for script in ("launch.sh", "render-haproxy.sh"):
            out = subprocess.run([shellcheck, str(DEPLOY / script)], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout


# ------------------------------------------------------------------------------------------------- Docker, compose


def compose() -> dict[str, Any]:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def test_compose_runs_one_worker_per_gpu_behind_haproxy() -> None:
    services = compose()["services"]
    workers = {name: s for name, s in services.items() if name.startswith("rtts-gpu")}
    assert len(workers) >= 2
    gpus = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for s in workers.values()]
    assert sorted(g for ids in gpus for g in ids) == [str(i) for i in range(len(workers))]  # one GPU each
    lb = services["haproxy"]
    assert sorted(lb["environment"]["RTTS_WORKERS"].split()) == sorted(f"{name}:8080" for name in workers)
    for mount in lb["volumes"]:
        assert (DEPLOY / mount.split(":")[0]).is_file(), mount
    for name, s in workers.items():
        cmd = s["command"]
        assert cmd[0] == "serve" and flag(cmd, "--port") == "8080" and flag(cmd, "--device") == "cuda"
        grace = float(flag(cmd, "--drain-grace").split(":-")[-1].rstrip("}"))
        assert seconds(s["stop_grace_period"]) > grace, name
        assert s["depends_on"]["quantize"]["condition"] == "service_completed_successfully"
        assert "haproxy" in s["depends_on"]  # stopped before HAProxy, which relays their last sessions
        assert any(v.endswith(":/models:ro") for v in s["volumes"])
        assert "?live=1" in " ".join(s["healthcheck"]["test"])
    # The FP8 checkpoint is written once, by rtts quantize, and only when it is missing.
    assert "rtts quantize" in services["quantize"]["command"][0] and "test -d" in services["quantize"]["command"][0]
    build = workers["rtts-gpu0"]["build"]
    context = (DEPLOY / build["context"]).resolve()  # (relative to the compose file)
    assert context == ROOT and (context / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"


def test_docker_compose_accepts_the_file(tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        timeout=30).returncode != 0:
        pytest.skip("docker compose is not available (the file's structure is checked above)")
    out = subprocess.run([docker, "compose", "-f", str(DEPLOY / "docker-compose.yml"), "config", "--quiet"],
                         capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin:/usr/local/bin",
                                                                          "RTTS_MODELS": str(tmp_path)})
    assert out.returncode == 0, out.stderr


def test_the_dockerfile_keeps_its_promises() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG CUDA_IMAGE=(\S+)$", text, re.M)
    assert base and base[1].startswith("nvidia/cuda:") and "-runtime-" in base[1]
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}$", text, re.M)
    user = re.findall(r"^USER (\S+)$", text, re.M)
    assert user and user[-1].split(":")[0] not in ("0", "root")
    assert re.search(r'^ENTRYPOINT \["tini", "--", "rtts"\]$', text, re.M)  # SIGTERM reaches rtts, which drains
    # Weights come from a volume: nothing copied in looks like a checkpoint.
    copied = [p for line in re.findall(r"^COPY (.+)$", text, re.M) for p in line.split()[:-1]]
    assert copied and all((ROOT / p).exists() for p in copied), copied
    assert not any(re.search(r"checkpoint|\.safetensors|\.pth", p) for p in copied)
    assert '"/models"' in text and "/models/" in text
    # The build context is the repository root: the Dockerfile's ignore file admits exactly what it copies.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    admitted = {line[1:] for line in ignore if line.startswith("!")}
    assert set(copied) <= admitted
    cmd_grace = float(re.search(r'"--drain-grace", "(\d+)"', text)[1])  # type: ignore[index]
    worker = next(s for name, s in compose()["services"].items() if name.startswith("rtts-gpu"))
    assert cmd_grace < seconds(worker["stop_grace_period"])
