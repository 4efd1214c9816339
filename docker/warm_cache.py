"""Warm a worker image at build time, so that its first start needs no compiler and no network.

    python warm_cache.py                   # build stage: convert the embedded GGUF model into
                                           # DEEPINFER_CACHE_DIR, compile the C++ CPU kernels
                                           # into TORCH_EXTENSIONS_DIR
    python warm_cache.py --check           # runtime stage (no compiler): fail if either of the
                                           # two had to be done again
    python warm_cache.py --no-cpu-kernels  # CUDA image: the model only

It makes the calls a worker makes when it starts: `engine.loader.resolve_model_dir` (from
`EngineCore.__init__`) and, on CPU, `kernels.cpu_extension.cpu_extension` (from
`ModelRunner.__init__`). Run it as the user the image runs as, so that the cache is theirs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Warm a deepinfer worker image's caches.")
    parser.add_argument("--check", action="store_true",
                        help="fail if the model had to be converted or the kernels compiled now")
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                        help="leave the C++ CPU kernels out (CUDA image)")
    return parser


def _entry_names(directory: Path) -> set[str]:
    return {path.name for path in directory.iterdir()} if directory.is_dir() else set()


def _warm_model(check: bool) -> str | None:
    """Convert the configured model (the embedded default) into the cache; an error or None."""
    from deepinfer.engine.config import EngineConfig, env_overrides
    from deepinfer.engine.loader import DEFAULT_CACHE_DIR, resolve_model_dir

    model = EngineConfig().replace(**env_overrides()).model
    cache_root = Path(model.cache_dir or DEFAULT_CACHE_DIR).expanduser()
    before = _entry_names(cache_root)
    model_dir = resolve_model_dir(model.model, model.cache_dir)
    if check and _entry_names(cache_root) != before:
        return (f"the model was converted again into {model_dir}: the cache built in the build "
                f"stage was not reused (changed GGUF mtime or cache dir?)")
    print(f"warm_cache: model {model_dir}", flush=True)
    return None


def _warm_cpu_kernels() -> str | None:
    """Compile (or, when up to date, only load) the C++ CPU kernels; an error or None."""
    from deepinfer.kernels.cpu_extension import _cpu_has_avx2, cpu_extension

    if not _cpu_has_avx2():
        print("warm_cache: this CPU lacks AVX2/FMA/F16C, the C++ CPU kernels are not built; "
              "build the image on an x86-64 machine with AVX2", flush=True)
        return None
    extension = cpu_extension()
    if extension is None:
        return ("the C++ CPU kernels did not load (the warning above says why); in the runtime "
                "stage this means they were out of date and a rebuild was tried without a "
                "compiler")
    print(f"warm_cache: C++ CPU kernels {extension.__file__}", flush=True)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    errors = [_warm_model(args.check)] + ([_warm_cpu_kernels()] if args.cpu_kernels else [])
    for error in filter(None, errors):
        print(f"warm_cache: {error}", file=sys.stderr)
    return 1 if any(errors) else 0


if __name__ == "__main__":
    sys.exit(main())
