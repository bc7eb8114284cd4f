"""deploy/kubernetes/: every manifest is valid against its schema (Kubernetes' own, shipped by
kubernetes-validate; KEDA's and prometheus-operator's documented fields, tests/unit/deploy/
crd_schemas.py), and what the manifests say agrees with the worker: its settings, its
probes, its drain, and the tasks-waiting query promtool evaluates."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from config.settings import Settings
from config.unknown import known_names
from tests.unit.deploy.crd_schemas import POD_MONITOR, SCALED_OBJECT
from tests.unit.deploy.test_alert_rules import evaluates_keda_query
from worker.health.server import Probes

ROOT = Path(__file__).parents[3]
MANIFESTS = ROOT / "deploy" / "kubernetes"
# The Kubernetes release whose schemas the core kinds are checked against: the newest
# kubernetes-validate ships.
KUBERNETES_VERSION = kubernetes_validate.utils.latest_version()
CUSTOM = {"ScaledObject": SCALED_OBJECT, "PodMonitor": POD_MONITOR}


def manifests() -> list[dict[str, Any]]:
    found = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        found += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def one(kind: str) -> dict[str, Any]:
    (found,) = [doc for doc in manifests() if doc["kind"] == kind]
    return found


def worker_container() -> dict[str, Any]:
    (container,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def deployment_settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The settings the Deployment's worker runs with: its env, nothing from this machine's."""
    for name in [name for name in os.environ if name.startswith("WORKER_")]:
        monkeypatch.delenv(name)
    for variable in worker_container()["env"]:
        monkeypatch.setenv(variable["name"], variable["value"])
    return Settings(_env_file=None)  # type: ignore[call-arg]


def test_every_manifest_is_valid_against_its_schema():
    kinds = []
    for doc in manifests():
        kinds.append(doc["kind"])
        if doc["kind"] in CUSTOM:
            jsonschema.validate(doc, CUSTOM[doc["kind"]])
        else:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    assert sorted(kinds) == ["Deployment", "PersistentVolumeClaim", "PodMonitor", "ScaledObject"]


def test_the_custom_schemas_refuse_a_field_their_documents_do_not_name():
    scaled = one("ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["metricName"] = "gone since KEDA 2.12"
    with pytest.raises(jsonschema.ValidationError, match="metricName"):
        jsonschema.validate(scaled, SCALED_OBJECT)
    monitor = one("PodMonitor")
    monitor["spec"]["podMetricsEndpoints"][0]["targetPort"] = 9464
    with pytest.raises(jsonschema.ValidationError, match="targetPort"):
        jsonschema.validate(monitor, POD_MONITOR)


def test_the_env_names_only_settings_and_the_grace_period_outlasts_the_drain(monkeypatch):
    settings = deployment_settings(monkeypatch)
    known = known_names(Settings)
    names = {variable["name"] for variable in worker_container()["env"]}
    assert names <= known, f"not settings: {sorted(names - known)}"
    grace_s = one("Deployment")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace_s >= settings.health.drain_timeout_s + 10, "SIGKILL before the drain ends"


def test_the_probes_ask_the_workers_own_listener_and_paths(monkeypatch):
    settings = deployment_settings(monkeypatch)
    container = worker_container()
    assert settings.metrics.host == "0.0.0.0", "the kubelet and Prometheus reach the pod's IP"
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    probes = Probes(not_live=lambda: "live", not_ready=lambda: "ready")
    asked = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert ports[get["port"]] == settings.metrics.port, f"{probe} asks another port"
        answer = probes.answer(get["path"])
        assert answer is not None, f"{probe}: the worker serves no {get['path']}"
        asked[probe] = answer()
    assert asked == {"startupProbe": "live", "livenessProbe": "live", "readinessProbe": "ready"}
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "a cold model load"
    (endpoint,) = one("PodMonitor")["spec"]["podMetricsEndpoints"]
    assert ports[endpoint["port"]] == settings.metrics.port and endpoint["path"] == "/metrics"


def test_the_model_cache_is_on_the_volume_the_worker_is_told_of(monkeypatch):
    settings = deployment_settings(monkeypatch)
    pod = one("Deployment")["spec"]["template"]["spec"]
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["volumes"]
        if "persistentVolumeClaim" in v
    }
    mounts = {m["mountPath"]: m["name"] for m in worker_container()["volumeMounts"]}
    volume = mounts[settings.model.cache_dir]
    assert claims[volume] == one("PersistentVolumeClaim")["metadata"]["name"]
    # No fsGroup: the init container gives the volume to the worker (fsGroup would do too).
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True and "fsGroup" not in security


def test_the_scaled_objects_query_counts_the_deployments_pipeline(monkeypatch, tmp_path):
    """The ScaledObject's query, evaluated by promtool as the docs' recipe is: its pipeline's
    job consumers and the shared consumer it is among, once each, nothing of another."""
    settings = deployment_settings(monkeypatch)
    scaled = one("ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == one("Deployment")["metadata"]["name"]
    (trigger,) = scaled["spec"]["triggers"]
    evaluates_keda_query(trigger["metadata"]["query"], settings.model.pipeline, tmp_path)
