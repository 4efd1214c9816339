"""Docker's own reading of docker/*.Dockerfile and .dockerignore, small enough to test with.

`parse_dockerfile` joins continuation lines and drops comments as Docker does, and groups the
instructions by build stage. `dockerignore_rules` + `is_excluded` follow moby's patternmatcher
(`MatchesOrParentMatches`): Go-style globs where `**` spans folders, a pattern also matches
everything under a folder it matches, `!` re-includes, the last matching pattern wins.
"""

from __future__ import annotations

import json
import posixpath
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: ROOT / "docker" / f"{name}.Dockerfile"
               for name in ("worker-cpu", "worker-cuda", "router")}


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-case: FROM, RUN, COPY, ...
    value: str    # the rest, continuation lines joined


def parse_dockerfile(path: Path) -> list[list[Instruction]]:
    """Instructions per build stage; stage 0 holds what comes before the first FROM."""
    stages: list[list[Instruction]] = [[]]
    pending = ""
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):  # comments go, also inside a continued line
            continue
        if text.endswith("\\"):
            pending += text[:-1] + " "
            continue
        keyword, _, value = (pending + text).partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append(Instruction(keyword.upper(), " ".join(value.split())))
    return stages


def values(stage: list[Instruction], keyword: str) -> list[str]:
    return [instruction.value for instruction in stage if instruction.keyword == keyword]


def exec_form(value: str) -> list[str]:
    """A JSON-array (exec form) argument list; fails on the shell form."""
    argv = json.loads(value)
    assert isinstance(argv, list) and all(isinstance(arg, str) for arg in argv), value
    return argv


def healthcheck(value: str) -> tuple[dict[str, str], list[str]]:
    """HEALTHCHECK's options (`{"interval": "30s", ...}`) and its CMD in exec form."""
    options, _, command = value.partition(" CMD ")
    pairs = (option.removeprefix("--").split("=", 1) for option in options.split())
    return dict(pairs), exec_form(command)


def environment(stage: list[Instruction]) -> dict[str, str]:
    """The stage's ENV variables (KEY=VALUE form), later ones winning."""
    env: dict[str, str] = {}
    for value in values(stage, "ENV"):
        env.update(item.split("=", 1) for item in shlex.split(value))
    return env


def copy_sources(stages: list[list[Instruction]]) -> list[str]:
    """Paths that COPY takes from the build context (not from another stage)."""
    sources = []
    for stage in stages:
        for value in values(stage, "COPY"):
            words = shlex.split(value)
            if not any(word.startswith("--from=") for word in words):
                sources += [word for word in words[:-1] if not word.startswith("--")]
    return sources


# ---------------------------------------------------------------- .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern:
    regex, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            i += 3 if pattern.startswith("**/", i) else 2
            regex += ".*" if i >= len(pattern) else "(.*/)?"
            continue
        char = pattern[i]
        if char == "[":
            end = pattern.index("]", i)
            regex, i = regex + pattern[i:end + 1], end + 1
            continue
        regex += {"*": "[^/]*", "?": "[^/]"}.get(char, re.escape(char))
        i += 1
    return re.compile(regex)


def dockerignore_rules(path: Path) -> list[tuple[bool, re.Pattern]]:
    """(re-include?, regex) per pattern line, in file order."""
    rules = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        include = text.startswith("!")
        text = posixpath.normpath(text.removeprefix("!").strip()).lstrip("/")
        rules.append((include, _pattern_regex(text)))
    return rules


def is_excluded(path: str, rules: list[tuple[bool, re.Pattern]]) -> bool:
    """Whether Docker leaves `path` (relative, with /) out of the build context."""
    parts = path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]  # parents, then path
    excluded = False
    for include, regex in rules:
        if include != excluded:  # only an exclusion can change a kept path, and vice versa
            continue
        if any(regex.fullmatch(candidate) for candidate in candidates):
            excluded = not include
    return excluded
