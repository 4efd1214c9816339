"""A Python rendering of `kubectl kustomize DIR` for the features deploy/ uses, so the deploy
tests run where kubectl is absent. Where kubectl is present, tests/deploy/test_kustomize.py
checks that both give the same objects for every overlay.

Supported (kustomize v5 semantics, https://kubectl.docs.kubernetes.io/references/kustomize/):
`resources` (YAML files and kustomization directories), `components` (kind Component),
`configMapGenerator` (files, literals, `disableNameSuffixHash: true` only, options.labels),
`patches` (strategic-merge patches, inline or by path, and JSON 6902 op lists with a
kind/name target), `namespace`, `namePrefix`/`nameSuffix` with the name references that follow
a rename, and `labels` (`includeSelectors`). Anything else raises `NotImplementedError`, so an
unsupported field in a new manifest fails loudly instead of rendering wrong.

The steps of one kustomization run in kustomize's order: resources, components, generators,
patches, then the namespace, name and label transformers.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import yaml

Obj = dict[str, Any]

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "components", "configMapGenerator",
                "patches", "namespace", "namePrefix", "nameSuffix", "labels"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
# strategic-merge keys of the lists deploy/ patches (k8s.io/api struct tags `patchMergeKey`)
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def render(directory: Path) -> list[Obj]:
    """The objects `kubectl kustomize directory` prints, in no particular order.

    Raises:
        NotImplementedError: the kustomization uses a field this renderer does not support.
        FileNotFoundError: a resource, patch or kustomization file is missing.
    """
    return _build(Path(directory), expect_kind="Kustomization")


def _load_kustomization(directory: Path, expect_kind: str) -> Obj:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN_FIELDS
    if unknown:
        raise NotImplementedError(f"{directory}: kustomization fields {sorted(unknown)}")
    if spec.get("kind", "Kustomization") != expect_kind:
        raise ValueError(f"{directory}: kind {spec.get('kind')}, expected {expect_kind}")
    return spec


def _build(directory: Path, expect_kind: str, objects: list[Obj] | None = None) -> list[Obj]:
    spec = _load_kustomization(directory, expect_kind)
    objects = [] if objects is None else objects
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            objects += _build(path, "Kustomization")
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for entry in spec.get("components", []):
        objects = _build(directory / entry, "Component", objects)
    objects += [_config_map(directory, gen) for gen in spec.get("configMapGenerator", [])]
    for patch in spec.get("patches", []):
        _apply_patch(objects, directory, patch)
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    _rename(objects, spec.get("namePrefix", ""), spec.get("nameSuffix", ""))
    for label in spec.get("labels", []):
        _add_labels(objects, label)
    return objects


def _config_map(directory: Path, generator: Obj) -> Obj:
    options = generator.get("options", {})
    if not options.get("disableNameSuffixHash"):
        raise NotImplementedError("configMapGenerator without disableNameSuffixHash: true")
    data = {}
    for entry in generator.get("files", []):
        key, _, name = entry.rpartition("=")
        data[key or Path(name).name] = (directory / name).read_text()
    for entry in generator.get("literals", []):
        key, _, value = entry.partition("=")
        data[key] = value
    metadata = {"name": generator["name"]}
    if options.get("labels"):
        metadata["labels"] = dict(options["labels"])
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


# --- patches ---------------------------------------------------------------------------------

def _apply_patch(objects: list[Obj], directory: Path, patch: Obj) -> None:
    text = (directory / patch["path"]).read_text() if "path" in patch else patch["patch"]
    body = yaml.safe_load(text)
    if isinstance(body, list):                     # JSON 6902 ops
        target = patch["target"]
        for obj in _targets(objects, target["kind"], target["name"]):
            for op in body:
                _json6902(obj, op)
        return
    target = patch.get("target", {"kind": body["kind"], "name": body["metadata"]["name"]})
    matches = _targets(objects, target["kind"], target["name"])
    for obj in matches:
        merged = _merge(obj, {k: v for k, v in body.items() if k not in ("apiVersion", "kind")}
                        | {"metadata": {k: v for k, v in body["metadata"].items()
                                        if k != "name"}})
        obj.clear()
        obj.update(merged)


def _targets(objects: list[Obj], kind: str, name: str) -> list[Obj]:
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if not found:
        raise ValueError(f"patch target {kind}/{name} not found")
    return found


def _merge(original: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge: maps merge key by key, keyed lists merge item by item (the patch's
    items first, in its order, merged with their originals; then the other originals, as
    kustomize orders them), other lists and scalars are replaced."""
    if isinstance(original, dict) and isinstance(patch, dict):
        out = dict(original)
        for key, value in patch.items():
            out[key] = _merge(original[key], value, key) if key in original else \
                copy.deepcopy(value)
        return out
    if isinstance(original, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        by_key = {item[key]: item for item in original}
        patched = {item[key] for item in patch}
        return [_merge(by_key[item[key]], item, field) if item[key] in by_key else
                copy.deepcopy(item) for item in patch] + \
            [item for item in original if item[key] not in patched]
    return copy.deepcopy(patch)


def _json6902(obj: Obj, op: Obj) -> None:
    *parents, last = [part.replace("~1", "/").replace("~0", "~")
                      for part in op["path"].strip("/").split("/")]
    node = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if op["op"] == "add" and isinstance(node, list):
        node.insert(len(node) if last == "-" else int(last), op["value"])
    elif op["op"] in ("add", "replace"):
        node[int(last) if isinstance(node, list) else last] = op["value"]
    elif op["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    else:
        raise NotImplementedError(f"JSON patch op {op['op']!r}")


# --- names and their references --------------------------------------------------------------

def _name_refs(obj: Obj) -> list[tuple[str, dict, str]]:
    """(referenced kind, the dict holding the name, its key) for every name reference in obj
    that kustomize rewrites on a rename."""
    refs: list[tuple[str, dict, str]] = []
    if obj["kind"] == "HorizontalPodAutoscaler":
        target = obj["spec"]["scaleTargetRef"]
        refs.append((target["kind"], target, "name"))
    if obj["kind"] not in WORKLOADS:
        return refs
    pod = obj["spec"]["template"]["spec"]
    for container in pod.get("containers", []) + pod.get("initContainers", []):
        for source in container.get("envFrom", []):
            for kind, field in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                if field in source:
                    refs.append((kind, source[field], "name"))
        for env in container.get("env", []):
            for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
                if field in env.get("valueFrom", {}):
                    refs.append((kind, env["valueFrom"][field], "name"))
    for volume in pod.get("volumes", []):
        for kind, field, key in (("ConfigMap", "configMap", "name"),
                                 ("Secret", "secret", "secretName"),
                                 ("PersistentVolumeClaim", "persistentVolumeClaim",
                                  "claimName")):
            if field in volume:
                refs.append((kind, volume[field], key))
    return refs


def _rename(objects: list[Obj], prefix: str, suffix: str) -> None:
    if not (prefix or suffix):
        return
    renamed: dict[tuple[str, str], str] = {}
    for obj in objects:
        if obj["kind"] == "Namespace":
            continue
        old = obj["metadata"]["name"]
        renamed[(obj["kind"], old)] = obj["metadata"]["name"] = f"{prefix}{old}{suffix}"
    for obj in objects:
        for kind, holder, key in _name_refs(obj):
            holder[key] = renamed.get((kind, holder[key]), holder[key])


# --- labels ----------------------------------------------------------------------------------

def _selector_paths(obj: Obj) -> list[Callable[[Obj], dict]]:
    """Getters of the label maps `labels: includeSelectors: true` also writes, by kind."""
    kind = obj["kind"]
    if kind == "Service":
        return [lambda o: o["spec"].setdefault("selector", {})]
    if kind in WORKLOADS:
        return [lambda o: o["spec"]["selector"].setdefault("matchLabels", {}),
                lambda o: o["spec"]["template"]["metadata"].setdefault("labels", {})]
    if kind == "PodDisruptionBudget":
        return [lambda o: o["spec"]["selector"].setdefault("matchLabels", {})]
    if kind == "NetworkPolicy":
        return [lambda o: o["spec"]["podSelector"].setdefault("matchLabels", {})]
    return []


def _add_labels(objects: list[Obj], label: Obj) -> None:
    unknown = set(label) - {"pairs", "includeSelectors"}
    if unknown:
        raise NotImplementedError(f"labels fields {sorted(unknown)}")
    pairs = label["pairs"]
    for obj in objects:
        obj["metadata"].setdefault("labels", {}).update(pairs)
        if label.get("includeSelectors"):
            for getter in _selector_paths(obj):
                getter(obj).update(pairs)
