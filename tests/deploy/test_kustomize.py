"""Every deploy/ overlay renders, validates offline against the Kubernetes schemas, and holds
together: selectors find pods, references find their ConfigMap/Secret/Service, probes name
declared ports, the workers' and router's command lines and DEEPINFER_* settings are accepted by
the real parsers and config classes, and the drain fits in the termination grace period.
"""

from __future__ import annotations

import shlex
import shutil
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest

from crd_schemas import SCHEMAS
from kustomize import render
from manifests import (DEPLOY, KUBERNETES_VERSION, OVERLAYS, ROOT, USER_SECRET, container_env,
                       containers, expand, find, key, kubectl_render, render_overlay,
                       selected_pods)

EACH_OVERLAY = pytest.mark.parametrize("overlay", OVERLAYS)


@pytest.mark.skipif(not shutil.which("kubectl"), reason="kubectl is not installed")
@EACH_OVERLAY
def test_python_renderer_equals_kubectl_kustomize(overlay):
    directory = DEPLOY / "overlays" / overlay
    ours = {key(o): o for o in render(directory)}
    theirs = {key(o): o for o in kubectl_render(directory)}
    assert ours.keys() == theirs.keys()
    for name, obj in theirs.items():
        assert ours[name] == obj, name


@EACH_OVERLAY
def test_every_object_validates_offline(overlay):
    objects = render_overlay(overlay)
    kinds = {o["kind"] for o in objects}
    assert {"Namespace", "ConfigMap", "Deployment", "Service", "PodDisruptionBudget",
            "PodMonitor", "PrometheusRule"} <= kinds
    for obj in objects:
        if obj["kind"] in SCHEMAS:
            jsonschema.validate(obj, SCHEMAS[obj["kind"]])
        else:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "deepinfer", key(obj)
            assert obj["metadata"]["name"].startswith("deepinfer-"), key(obj)


@EACH_OVERLAY
def test_selectors_find_pods_and_references_resolve(overlay):
    objects = render_overlay(overlay)
    for obj in objects:
        spec, namespace = obj.get("spec", {}), obj["metadata"].get("namespace", "")
        selector = {"Service": {"matchLabels": spec.get("selector")},
                    "PodDisruptionBudget": spec.get("selector"),
                    "PodMonitor": spec.get("selector"),
                    "NetworkPolicy": spec.get("podSelector")}.get(obj["kind"])
        if selector is not None:
            assert selected_pods(objects, selector, namespace), f"{key(obj)} selects no pods"
        if obj["kind"] == "ServiceMonitor":
            services = [s for s in objects if s["kind"] == "Service" and
                        spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
            ports = {p["name"] for s in services for p in s["spec"]["ports"]}
            assert services and {e["port"] for e in spec["endpoints"]} <= ports
        if obj["kind"] == "HorizontalPodAutoscaler":
            find(objects, spec["scaleTargetRef"]["kind"], spec["scaleTargetRef"]["name"])
    for workload, container in containers(objects):
        namespace = workload["metadata"]["namespace"]
        container_env(objects, container, namespace)   # every ConfigMap/Secret key exists
        port_names = {p["name"] for p in container.get("ports", [])}
        probes = ["readinessProbe", "livenessProbe"]
        if container["image"].startswith("deepinfer/"):
            probes.append("startupProbe")               # model loading takes minutes
        for probe in probes:
            action = container[probe].get("httpGet") or container[probe].get("tcpSocket")
            assert action["port"] in port_names, (key(workload), probe)
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, key(workload)
        assert container["securityContext"]["allowPrivilegeEscalation"] is False


def _deepinfer_containers(objects):
    for workload, container in containers(objects):
        if container["image"].startswith("deepinfer/"):
            yield workload, container


@EACH_OVERLAY
def test_images_are_built_by_docker_files(overlay):
    for workload, container in _deepinfer_containers(render_overlay(overlay)):
        name, _, tag = container["image"].partition(":")
        assert (ROOT / "docker" / f"{name.split('/')[1]}.Dockerfile").is_file(), name
        assert tag, f"{key(workload)}: pin the image tag"


def _args(objects, workload, container) -> list[str]:
    env = container_env(objects, container, workload["metadata"]["namespace"])
    return [expand(arg, env) for arg in container["args"]]


@EACH_OVERLAY
def test_worker_command_line_and_settings_are_accepted(overlay):
    from deepinfer.engine.config import EngineConfig
    from deepinfer.server.cli import ABORT_MARGIN_S, api_key, build_engine_config, build_parser

    objects = render_overlay(overlay)
    workers = [(w, c) for w, c in _deepinfer_containers(objects) if c["args"][0] == "serve"]
    assert workers
    for workload, container in workers:
        env = container_env(objects, container, workload["metadata"]["namespace"])
        args = build_parser().parse_args(_args(objects, workload, container))
        assert (args.host, args.port) == ("0.0.0.0", container["ports"][0]["containerPort"])
        config = build_engine_config(args, env)     # DEEPINFER_* parsed and range-checked
        assert isinstance(config, EngineConfig)
        assert api_key(args, env) == USER_SECRET["stringData"]["api-key"]
        assert not any("key" in arg or "password" in arg for arg in container["args"])
        assert env["OMP_NUM_THREADS"] == container["resources"]["limits"]["cpu"]
        role = config.kv_transfer.role
        if overlay == "disaggregated":
            assert role == workload["metadata"]["labels"]["app.kubernetes.io/component"]
            store = urlsplit(config.kv_transfer.kv_store)
            service = find(objects, "Service", store.hostname)
            assert store.port in [p["port"] for p in service["spec"]["ports"]]
            assert store.password == env["REDIS_PASSWORD"]
        else:
            assert (role, config.kv_transfer.kv_store) == ("both", "memory")
        pod = workload["spec"]["template"]["spec"]
        drain_s = container["lifecycle"]["preStop"]["sleep"]["seconds"] + \
            args.graceful_shutdown_s + ABORT_MARGIN_S
        assert pod["terminationGracePeriodSeconds"] >= drain_s + 10, key(workload)


@EACH_OVERLAY
def test_gpu_pools_request_gpus_and_the_cpu_worker_none(overlay):
    objects = render_overlay(overlay)
    for workload, container in _deepinfer_containers(objects):
        resources = container["resources"]
        gpus = {resources[k].get("nvidia.com/gpu") for k in ("requests", "limits")}
        component = workload["metadata"]["labels"]["app.kubernetes.io/component"]
        expected = {"1"} if component in ("prefill", "decode") else {None}
        assert gpus == expected, key(workload)
        assert resources["requests"]["memory"] and resources["limits"]["memory"]
    hpas = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    assert len(hpas) == (2 if overlay == "disaggregated" else 0)
    for hpa in hpas:   # a replicas field would reset the autoscaled pool on every apply
        assert "replicas" not in find(objects, "Deployment", hpa["spec"]["scaleTargetRef"]["name"])[
            "spec"]


@EACH_OVERLAY
def test_credentials_are_not_shipped(overlay):
    """Re-applying the manifests must not reset credentials: no Secret is rendered, and only
    the single-CPU overlay may start without the user's Secret (its API is then open)."""
    objects = render_overlay(overlay)
    assert not [o for o in objects if o["kind"] == "Secret"]
    workers = [(w, c) for w, c in _deepinfer_containers(objects) if c["args"][0] == "serve"]
    for workload, container in workers:
        refs = [e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})]
        assert refs and {r["name"] for r in refs} == {"deepinfer-secrets"}
        assert all(r.get("optional", False) is (overlay == "single") for r in refs), refs


def test_router_reaches_both_pools_through_their_headless_services():
    from deepinfer.router.cli import build_parser, config_from_args

    objects = render_overlay("disaggregated")
    workload, container = next((w, c) for w, c in _deepinfer_containers(objects)
                               if c["args"][0] == "router")
    argv = _args(objects, workload, container)
    config = config_from_args(build_parser().parse_args(argv[1:]))
    for role, urls in (("prefill", config.prefill), ("decode", config.decode)):
        assert len(urls) == 1, shlex.join(argv)
        url = urlsplit(urls[0])
        service = find(objects, "Service", url.hostname)
        assert service["spec"]["clusterIP"] == "None"        # DNS gives every pod's address
        assert url.port in [p["port"] for p in service["spec"]["ports"]]
        pods = selected_pods(objects, {"matchLabels": service["spec"]["selector"]}, "deepinfer")
        assert [p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods] == [role]
