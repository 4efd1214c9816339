"""JSON schemas for the Prometheus Operator objects deploy/ uses (PodMonitor, ServiceMonitor,
PrometheusRule, API group monitoring.coreos.com/v1), which kubernetes-validate does not ship.

They cover the fields deploy/ sets, typed as in the operator's API reference
(https://prometheus-operator.dev/docs/api-reference/api/), and refuse any other field, so a
misspelt or misplaced key fails the test instead of being dropped by the cluster.
"""

from __future__ import annotations

# the operator's Duration format: 30s, 5m, 1h30m
DURATION = {"type": "string", "pattern": r"^(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                          r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?$"}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
LABEL_SELECTOR = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "matchLabels": STRING_MAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "additionalProperties": False,
            "required": ["key", "operator"],
            "properties": {"key": {"type": "string"},
                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                           "values": {"type": "array", "items": {"type": "string"}}}}}}}
ENDPOINT = {
    "type": "object", "additionalProperties": False, "required": ["port"],
    "properties": {"port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                   "interval": DURATION, "scrapeTimeout": DURATION,
                   "scheme": {"enum": ["http", "https"]}}}
METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                           "labels": STRING_MAP, "annotations": STRING_MAP}}


def _object(kind: str, spec: dict) -> dict:
    return {"type": "object", "additionalProperties": False,
            "required": ["apiVersion", "kind", "metadata", "spec"],
            "properties": {"apiVersion": {"const": "monitoring.coreos.com/v1"},
                           "kind": {"const": kind}, "metadata": METADATA, "spec": spec}}


RULE = {
    "type": "object", "additionalProperties": False, "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {"alert": {"type": "string"}, "record": {"type": "string"},
                   "expr": {"type": "string", "minLength": 1}, "for": DURATION,
                   "labels": STRING_MAP, "annotations": STRING_MAP}}

SCHEMAS = {
    "PodMonitor": _object("PodMonitor", {
        "type": "object", "additionalProperties": False,
        "required": ["selector", "podMetricsEndpoints"],
        "properties": {"selector": LABEL_SELECTOR, "jobLabel": {"type": "string"},
                       "podMetricsEndpoints": {"type": "array", "minItems": 1,
                                               "items": ENDPOINT}}}),
    "ServiceMonitor": _object("ServiceMonitor", {
        "type": "object", "additionalProperties": False, "required": ["selector", "endpoints"],
        "properties": {"selector": LABEL_SELECTOR, "jobLabel": {"type": "string"},
                       "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT}}}),
    "PrometheusRule": _object("PrometheusRule", {
        "type": "object", "additionalProperties": False, "required": ["groups"],
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object", "additionalProperties": False, "required": ["name", "rules"],
            "properties": {"name": {"type": "string"}, "interval": DURATION,
                           "rules": {"type": "array", "minItems": 1, "items": RULE}}}}}}),
}
