"""infra/k8s: every manifest is valid against Kubernetes' own schemas (kubernetes-validate bundles
them: no cluster, no network), strictly (a misspelt field fails), and wired together as intended:
probes run the health command of their role, selectors match, the password comes from the Secret."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from common.redis_url import PASSWORD_FILE_ENV, check_redis_url
from infra.stack import REPO

pytestmark = pytest.mark.unit

K8S = REPO / "infra" / "k8s"
BASE = K8S / "base"
# The oldest Kubernetes these manifests target, and the newest schemas the validator bundles.
VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version() + ".0"]
ROLES = ("gateway", "scheduler", "executor")


def _manifests() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def _load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _resources() -> dict[tuple[str, str], dict[str, Any]]:
    """The base's resources by (kind, name)."""
    return {
        (d["kind"], d["metadata"]["name"]): d
        for p in sorted(BASE.glob("*.yaml"))
        if p.name != "kustomization.yaml"
        for d in _load(p)
    }


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", _manifests(), ids=lambda p: str(p.relative_to(K8S)))
def test_manifest_is_valid(path: Path, version: str) -> None:
    docs = _load(path)
    assert docs, f"{path} has no resources"
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_a_misspelt_field() -> None:
    doc = _resources()[("Deployment", "conveyor-gateway")]
    doc["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = doc["spec"]["template"]["spec"]["containers"][0].pop(
        "readinessProbe"
    )
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def test_kustomization_lists_every_base_manifest() -> None:
    listed = set(yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}


def _pod(resource: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = resource["spec"]["template"]["spec"]
    return spec


def test_each_role_is_probed_by_its_health_command() -> None:
    resources = _resources()
    for role in ROLES:
        container = _pod(resources[("Deployment", f"conveyor-{role}")])["containers"][0]
        assert container["args"][0] == role
        probes = [container[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in container]
        assert len(probes) >= 2, role
        for probe in probes:
            assert probe["exec"]["command"] == ["conveyor", "health", "--role", role]


def test_selectors_and_references_match() -> None:
    resources = _resources()
    for (kind, name), res in resources.items():
        if kind in ("Deployment", "StatefulSet"):
            labels = res["spec"]["template"]["metadata"]["labels"]
            assert res["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
    pods = [res for (kind, _), res in resources.items() if kind in ("Deployment", "StatefulSet")]
    for (kind, name), res in resources.items():
        if kind == "Service":
            assert any(res["spec"]["selector"].items() <= p["spec"]["template"]["metadata"]["labels"].items() for p in pods), name
    hpa = resources[("HorizontalPodAutoscaler", "conveyor-gateway")]
    target = hpa["spec"]["scaleTargetRef"]
    gateway = resources[(target["kind"], target["name"])]
    assert "cpu" in _pod(gateway)["containers"][0]["resources"]["requests"]  # the HPA's utilization is of requests


def test_config_and_the_redis_password() -> None:
    resources = _resources()
    config = resources[("ConfigMap", "conveyor-config")]["data"]
    check_redis_url(config["CONVEYOR_REDIS_URL"])
    sources = "".join(p.read_text() for d in ("common", "gateway", "scheduler", "executor") for p in (REPO / d).rglob("*.py"))
    for key in config:
        if key.startswith("CONVEYOR_"):
            assert re.search(rf"\b{key}\b", sources), f"{key} is read by no service"
    secret = _load(K8S / "redis-secret.example.yaml")[0]
    password_file = Path(config[PASSWORD_FILE_ENV])
    assert password_file.name in secret["stringData"]
    for role in ROLES:
        pod = _pod(resources[("Deployment", f"conveyor-{role}")])
        volumes = {v["name"]: v for v in pod["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in pod["containers"][0]["volumeMounts"]}
        assert volumes[mounts[str(password_file.parent)]]["secret"]["secretName"] == secret["metadata"]["name"], role
        assert {"configMapRef": {"name": "conveyor-config"}} in pod["containers"][0]["envFrom"]
    redis_env = _pod(resources[("StatefulSet", "conveyor-redis")])["containers"][0]["env"]
    assert redis_env[0]["valueFrom"]["secretKeyRef"]["name"] == secret["metadata"]["name"]
    redis_args = " ".join(_pod(resources[("StatefulSet", "conveyor-redis")])["containers"][0]["args"])
    assert "--appendonly yes" in redis_args and "requirepass" in redis_args
    assert "nvidia.com/gpu" in _pod(resources[("Deployment", "conveyor-executor")])["containers"][0]["resources"]["limits"]


@pytest.mark.stack
def test_cpu_overlay_renders_without_a_gpu() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the kustomize overlay is not rendered (the base is validated above)")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "cpu")], capture_output=True, text=True, timeout=60, check=True)
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    for doc in docs:
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
    executor = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "conveyor-executor")
    container = _pod(executor)["containers"][0]
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert {"name": "CONVEYOR_DEVICE", "value": "cpu"} in container["env"]
    assert len(docs) == len(_resources())
