"""The rendered deploy/ overlays and lookups over them, shared by the deploy tests.

`render_overlay(name)` is `kubectl kustomize deploy/overlays/NAME` when kubectl is on PATH,
else the Python renderer in kustomize.py (test_kustomize.py checks both agree).
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import yaml

from kustomize import render

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OVERLAYS = ("single", "disaggregated")
KUBERNETES_VERSION = "1.32"  # the oldest release we support: preStop `sleep` is on by default

Obj = dict[str, Any]

# The Secret deploy/README.md tells users to create (not shipped, so re-applying the manifests
# never resets it), with values for the tests to resolve references against.
USER_SECRET: Obj = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                    "metadata": {"name": "deepinfer-secrets", "namespace": "deepinfer"},
                    "stringData": {"api-key": "test-api-key", "redis-password": "0123abcdef"}}


def kubectl_render(directory: Path) -> list[Obj]:
    out = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True,
                         text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@functools.cache
def _render(name: str) -> tuple[str, ...]:
    directory = DEPLOY / "overlays" / name
    objects = kubectl_render(directory) if shutil.which("kubectl") else render(directory)
    return tuple(yaml.safe_dump(obj) for obj in objects)   # immutable cache entries


def render_overlay(name: str) -> list[Obj]:
    """Fresh copies of the overlay's objects (callers may mutate them)."""
    return [yaml.safe_load(text) for text in _render(name)]


def key(obj: Obj) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def find(objects: list[Obj], kind: str, name: str) -> Obj:
    matches = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in ("Deployment", "StatefulSet")]


def containers(objects: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(workload, container) for every container of every workload."""
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            yield workload, container


def selector_matches(selector: Obj, labels: dict[str, str]) -> bool:
    """Kubernetes LabelSelector semantics (matchLabels and matchExpressions)."""
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if (op == "In" and value not in expr["values"]) or \
                (op == "NotIn" and value in expr["values"]) or \
                (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def selected_pods(objects: list[Obj], selector: Obj, namespace: str) -> list[Obj]:
    """The workloads whose pod template the selector matches, in `namespace`."""
    return [w for w in workloads(objects)
            if w["metadata"].get("namespace", "") == namespace
            and selector_matches(selector, w["spec"]["template"]["metadata"]["labels"])]


def container_env(objects: list[Obj], container: Obj, namespace: str) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: envFrom ConfigMaps, then `env`
    (values from Secrets resolved, `USER_SECRET` standing for the one the user creates; CPU
    limits from the container's resources; `$(VAR)` references expanded in order)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        config_map = find(objects, "ConfigMap", source["configMapRef"]["name"])
        assert config_map["metadata"]["namespace"] == namespace
        env.update(config_map["data"])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        elif "resourceFieldRef" in item["valueFrom"]:
            field = item["valueFrom"]["resourceFieldRef"]
            assert field["resource"] == "limits.cpu" and field["divisor"] == "1"
            env[item["name"]] = container["resources"]["limits"]["cpu"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            secret = find(objects + [USER_SECRET], "Secret", ref["name"])
            env[item["name"]] = {**secret.get("stringData", {}), **secret.get("data", {})}[
                ref["key"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion (an undefined variable stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: env.get(m.group(1), m.group(0)), text)
