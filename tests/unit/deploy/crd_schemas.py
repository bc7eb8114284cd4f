"""JSON schemas of the two custom resources deploy/kubernetes/ uses, written from their
projects' documentation (kubernetes-validate ships Kubernetes' own schemas, not these).

- ``ScaledObject`` (keda.sh/v1alpha1): KEDA's "ScaledObject specification" reference page
  (keda.sh/docs/2.15 to latest, reference/scaledobject-spec) for ``spec``, and its Prometheus
  scaler page (keda.sh/docs/latest/scalers/prometheus) for a ``prometheus`` trigger's metadata:
  the fields each documents, no others (``additionalProperties: false``), and what each marks
  mandatory (``scaleTargetRef.name``; a Prometheus trigger's ``serverAddress``, ``query``,
  ``threshold``). Trigger metadata values are strings, as the scaler reads them.
- ``PodMonitor`` (monitoring.coreos.com/v1): prometheus-operator's API reference as the
  OpenShift/OKD "PodMonitor [monitoring.coreos.com/v1]" pages print it: ``spec`` requires
  ``selector``; the fields of a ``podMetricsEndpoints`` entry used here and their types.
"""

from __future__ import annotations

from typing import Any

_STRING = {"type": "string"}
_INT = {"type": "integer", "minimum": 0}
_METADATA = {"type": "object", "required": ["name"], "properties": {"name": _STRING}}

PROMETHEUS_TRIGGER_METADATA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["serverAddress", "query", "threshold"],
    "properties": {
        name: _STRING
        for name in (
            "serverAddress",
            "query",
            "threshold",
            "activationThreshold",
            "namespace",
            "customHeaders",
            "ignoreNullValues",
            "queryParameters",
            "unsafeSsl",
            "timeout",
        )
    },
}

SCALED_OBJECT: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name"],
                    "properties": {
                        "apiVersion": _STRING,
                        "kind": _STRING,
                        "name": _STRING,
                        "envSourceContainerName": _STRING,
                    },
                },
                "pollingInterval": _INT,
                "cooldownPeriod": _INT,
                "initialCooldownPeriod": _INT,
                "idleReplicaCount": _INT,
                "minReplicaCount": _INT,
                "maxReplicaCount": _INT,
                "fallback": {"type": "object"},
                "advanced": {"type": "object"},
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {
                            "type": _STRING,
                            "name": _STRING,
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            "useCachedMetrics": {"type": "boolean"},
                            "authenticationRef": {"type": "object"},
                            "metadata": {"type": "object"},
                        },
                        "if": {"properties": {"type": {"const": "prometheus"}}},
                        "then": {"properties": {"metadata": PROMETHEUS_TRIGGER_METADATA}},
                    },
                },
            },
        },
    },
}

_LABEL_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "matchLabels": {"type": "object", "additionalProperties": _STRING},
        "matchExpressions": {"type": "array"},
    },
}

POD_MONITOR: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": _METADATA,
        "spec": {
            "type": "object",
            "required": ["selector"],
            "properties": {
                "selector": _LABEL_SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": _STRING,
                "podTargetLabels": {"type": "array", "items": _STRING},
                "sampleLimit": _INT,
                "podMetricsEndpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": _STRING,
                            "portNumber": _INT,
                            "path": _STRING,
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "honorLabels": {"type": "boolean"},
                            "params": {"type": "object"},
                            "relabelings": {"type": "array"},
                            "metricRelabelings": {"type": "array"},
                        },
                    },
                },
            },
        },
    },
}
