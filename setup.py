"""The package map pyproject.toml cannot state: the repository's top-level directories install
as one import namespace, `deepinfer.engine`, `deepinfer.kernels`, `deepinfer.kvstore`,
`deepinfer.server`, `deepinfer.router` (beside `deepinfer/` itself). A directory absent from the
build context (the router image copies only server/ and router/) is left out.
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent
PARTS = ("engine", "kernels", "kvstore", "server", "router")

package_dir = {"deepinfer": "deepinfer"}
packages = ["deepinfer"]
for part in PARTS:
    if (ROOT / part / "__init__.py").is_file():
        package_dir[f"deepinfer.{part}"] = part
        packages += sorted("deepinfer." + ".".join(init.parent.relative_to(ROOT).parts)
                           for init in (ROOT / part).rglob("__init__.py"))

setup(packages=packages, package_dir=package_dir)
