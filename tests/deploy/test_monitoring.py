"""The monitoring in deploy/ against the real thing: a `deepinfer serve` worker (embedded
SmolLM2) and a `deepinfer router` in front of it, started as processes, and a real Prometheus
(Debian's `prometheus`, which `.ci/run` installs) scraping both.

Proves: the probe paths of every rendered container answer 200; every metric named by the
Grafana dashboard, the alert rules and the HPA's prometheus-adapter rule is exported by the
worker or the router; Prometheus evaluates every one of those queries (and the dashboard's give
data); promtool accepts the rules and their unit tests pass; the HPA asks for the metric the
adapter serves.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from manifests import DEPLOY, OVERLAYS, containers, render_overlay
from tests.processes import ServerProcess, deepinfer, free_port

pytestmark = pytest.mark.slow

MODEL = "smollm2-monitoring"
RULES = DEPLOY / "base" / "common" / "prometheusrule.yaml"
DASHBOARD = DEPLOY / "grafana" / "deepinfer-dashboard.json"
ADAPTER = DEPLOY / "monitoring" / "prometheus-adapter.yaml"
METRIC_NAME = re.compile(r"\bdeepinfer(?:_router)?:[A-Za-z0-9_]+")
# Grafana's variables, as a query over everything a local Prometheus holds
GRAFANA_VARS = {"$namespace": ".*", "$model_name": ".*", "$__rate_interval": "10s"}
# series that exist only once the event happened (per-backend labels): may come back empty
EVENT_ONLY = ("deepinfer_router:retries_total", "deepinfer_router:ejections_total",
              "deepinfer_router:discovery_failures_total",
              # labelled series that exist only once their event happened: an encoder step
              # (by outcome), a verified draft (by position; speculation is off by default)
              "deepinfer_router:encoder_steps_total",
              "deepinfer:spec_decode_num_accepted_tokens_per_pos_total")
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum"),
            "gauge": ("",)}


def need(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed (.ci/run installs Debian's prometheus)")
    return path


def alert_rules() -> list[dict]:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    return [rule for group in spec["groups"] for rule in group["rules"]]


def dashboard_targets() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query in the dashboard, rows included."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    panels += [p for row in panels for p in row.get("panels", [])]
    return [(p["title"], t["expr"]) for p in panels for t in p.get("targets", [])]


def adapter_query() -> tuple[str, str]:
    """(the name the custom metrics API serves, the PromQL the adapter runs for one pod)."""
    rule = yaml.safe_load(ADAPTER.read_text())["rules"]["custom"][0]
    series = METRIC_NAME.search(rule["seriesQuery"]).group(0)
    served = re.sub(rule["name"]["matches"], rule["name"]["as"].replace("${1}", r"\1"), series)
    query = (rule["metricsQuery"].replace("<<.Series>>", series)
             .replace("<<.LabelMatchers>>", 'namespace="deepinfer",pod="worker-0"')
             .replace("<<.GroupBy>>", "pod"))
    return served, query


def for_prometheus(expr: str) -> str:
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace(name, value)
    return expr


def exported_names(url: str) -> set[str]:
    """Every sample name the /metrics page can carry, declared families without samples yet
    included (a labelled counter's name is exported before its first event)."""
    names = set()
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        names |= {family.name + s for s in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A worker, a router before it, a few requests through both, and their /metrics."""
    tmp = tmp_path_factory.mktemp("monitoring")
    procs = []
    try:
        worker = ServerProcess("worker", deepinfer(
            "serve", "--served-model-name", MODEL, "--max-num-seqs", "4",
            "--num-kv-blocks", "128"), tmp / "worker.log")
        procs.append(worker)
        worker.wait_ready(900)
        router = ServerProcess("router", deepinfer(
            "router", "--backend", worker.url, "--health-interval-s", "0.5",
            "--log-level", "warning"), tmp / "router.log")
        procs.append(router)
        router.wait_ready(60)
        body = {"model": MODEL, "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": "Say hi."}]}
        for stream in (False, True, False):
            reply = httpx.post(router.url + "/v1/chat/completions", timeout=120,
                               json={**body, "stream": stream})
            assert reply.status_code == 200, reply.text
        yield {"worker": worker, "router": router, "tmp": tmp}
    finally:
        for proc in procs:
            proc.kill()


def test_probe_paths_answer_200(stack):
    processes = {8000: stack["worker"], 8080: stack["router"]}   # container port -> process
    checked = set()
    for overlay in OVERLAYS:
        for workload, container in containers(render_overlay(overlay)):
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                action = container.get(probe, {}).get("httpGet")
                if action is None:
                    continue
                port = ports.get(action["port"], action["port"])
                proc = processes[port]
                assert httpx.get(proc.url + action["path"]).status_code == 200, \
                    (workload["metadata"]["name"], probe)
                checked.add((port, action["path"]))
    assert checked == {(8000, "/health"), (8000, "/liveness"), (8080, "/health"),
                       (8080, "/liveness")}


def test_every_metric_queried_is_exported(stack):
    exported = exported_names(stack["worker"].url) | exported_names(stack["router"].url)
    queried = {"alerts": {n for r in alert_rules() for n in METRIC_NAME.findall(r["expr"])},
               "dashboard": {n for _, e in dashboard_targets() for n in METRIC_NAME.findall(e)},
               "adapter": set(METRIC_NAME.findall(adapter_query()[1]))}
    for source, names in queried.items():
        assert names, source
        assert names <= exported, f"{source} queries unexported metrics: {names - exported}"
    # the dashboard covers every family the worker and router export
    families = {n for n in exported if not n.endswith(("_created", "_count", "_sum"))}
    assert families - queried["dashboard"] - queried["alerts"] <= {
        "deepinfer:request_prompt_tokens_bucket", "deepinfer:request_generation_tokens_bucket",
        "deepinfer:kv_store_saved_blocks_total", "deepinfer:kv_store_misses_total",
        "deepinfer:kv_store_load_latency_seconds_bucket",
        "deepinfer:kv_store_save_latency_seconds_bucket"} | {
        n for n in families if not n.startswith("deepinfer")}


def test_hpa_asks_for_the_metric_the_adapter_serves():
    served, _ = adapter_query()
    hpas = [o for o in render_overlay("disaggregated") if o["kind"] == "HorizontalPodAutoscaler"]
    assert hpas and {m["pods"]["metric"]["name"] for h in hpas for m in h["spec"]["metrics"]} \
        == {served}


@pytest.fixture(scope="module")
def prometheus(stack):
    """A real Prometheus scraping the worker and the router every second."""
    binary = need("prometheus")
    tmp: Path = stack["tmp"]
    port = free_port()
    targets = [(stack["worker"], "worker-0"), (stack["router"], "router-0")]
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": pod, "static_configs": [{
                  "targets": [proc.url.removeprefix("http://")],
                  "labels": {"namespace": "deepinfer", "pod": pod}}]} for proc, pod in targets]}
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = open(tmp / "prometheus.log", "w")
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:   # both targets up, with 3+ scrapes in the window
            try:
                up = query(url, "count_over_time(up[10s]) >= 3 and up == 1")
                if len(up) == 2:
                    break
            except (httpx.TransportError, AssertionError, ValueError):
                pass   # not listening yet, or 503 "Service Unavailable" while it starts
            time.sleep(0.5)
        else:
            raise RuntimeError(f"Prometheus did not scrape both targets:\n"
                               f"{(tmp / 'prometheus.log').read_text()}")
        yield url
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()


def query(url: str, expr: str) -> list:
    reply = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def test_prometheus_evaluates_every_dashboard_alert_and_adapter_query(prometheus):
    for title, expr in dashboard_targets():
        result = query(prometheus, for_prometheus(expr))
        assert result or any(name in expr for name in EVENT_ONLY), (title, expr)
    for rule in alert_rules():
        query(prometheus, rule["expr"])      # valid PromQL over real series; need not fire
    served, expr = adapter_query()
    assert [sample["value"][1] for sample in query(prometheus, expr)] == ["0"], served


def test_alert_rules_pass_promtool_and_their_unit_tests(tmp_path):
    promtool = need("promtool")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(yaml.safe_load(RULES.read_text())
                                                        ["spec"]))
    shutil.copy(DEPLOY / "monitoring" / "alerts-test.yaml", tmp_path)
    for args in (["check", "rules", "rules.yaml"], ["test", "rules", "alerts-test.yaml"]):
        run = subprocess.run([promtool, *args], cwd=tmp_path, capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
    tested = set(re.findall(r"alertname: (\w+)", (tmp_path / "alerts-test.yaml").read_text()))
    assert tested == {rule["alert"] for rule in alert_rules()}


def test_dashboard_is_valid_grafana_json():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        for target in panel.get("targets", []):
            used = set(re.findall(r"\$(\w+)", target["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used)
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("request rate", "time to first token", "inter-token latency",
                  "tokens per second", "running and waiting", "kv cache usage",
                  "prefix cache", "kv store", "by backend", "router errors"):
        assert topic in titles, topic
