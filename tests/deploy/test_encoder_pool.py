"""The optional vision-encoder pool of the `disaggregated` overlay (component `with-encoder`):
enabled in a copy of deploy/, it renders a GPU pool whose command line and settings the real
parsers accept as `--role encoder` on the shared Redis store, the router's `--encoder` URL
reaches exactly those pods through their headless Service, and Redis admits them."""

from __future__ import annotations

import shutil
from urllib.parse import urlsplit

import yaml

from kustomize import render
from manifests import DEPLOY, container_env, expand, find, selected_pods


def test_with_encoder_component_adds_an_encoder_pool_the_router_uses(tmp_path):
    from deepinfer.router.cli import build_parser as router_parser, config_from_args
    from deepinfer.server.cli import build_engine_config, build_parser

    shutil.copytree(DEPLOY, tmp_path / "deploy")
    overlay = tmp_path / "deploy" / "overlays" / "disaggregated"
    spec = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    spec["components"] = ["with-encoder"]
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    objects = render(overlay)

    encoder = find(objects, "Deployment", "deepinfer-encoder-worker")
    container = encoder["spec"]["template"]["spec"]["containers"][0]
    env = container_env(objects, container, "deepinfer")
    args = build_parser().parse_args([expand(a, env) for a in container["args"]])
    config = build_engine_config(args, env)
    assert config.kv_transfer.role == "encoder"
    assert config.kv_transfer.kv_store.startswith("redis://")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"

    router = find(objects, "Deployment", "deepinfer-router")
    router_container = router["spec"]["template"]["spec"]["containers"][0]
    router_env = container_env(objects, router_container, "deepinfer")
    argv = [expand(a, router_env) for a in router_container["args"]]
    routed = config_from_args(router_parser().parse_args(argv[1:]))
    url = urlsplit(routed.encoders[0])
    service = find(objects, "Service", url.hostname)
    assert service["spec"]["clusterIP"] == "None"
    pods = selected_pods(objects, {"matchLabels": service["spec"]["selector"]}, "deepinfer")
    assert [p["metadata"]["labels"]["app.kubernetes.io/component"] for p in pods] == ["encoder"]
    policy = find(objects, "NetworkPolicy", "deepinfer-redis")
    allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchExpressions"][1]
    assert "encoder" in allowed["values"]
