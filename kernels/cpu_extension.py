"""Build and load deepinfer's one CPU C++ extension (AVX2 + FMA + F16C, OpenMP).

One torch extension module holds every CPU kernel, so a machine pays one ~60 s compile, on
first use, and never again whatever the launch:
- `q4_1_linear`, `q8_0_linear`: `csrc/quantized_linear_avx2.cpp` (kernels/quantized_linear.py),
  whose few-row nest runs `csrc/quantized_linear_avx512.cpp` on CPUs with AVX-512F (chosen at
  run time; those functions alone are compiled for AVX-512, so the module runs on AVX2 CPUs);
  with `row_invariant` (batch-invariant mode) a row's summation order does not depend on M.
- `f32_linear`: `csrc/f32_linear_avx2.cpp`, the batch-invariant float32 linear (kernels/linear.py).
- `rms_norm`: `csrc/rms_norm_avx2.cpp` (used by kernels/rms_norm.py).
- `paged_decode_attention`: `csrc/paged_attention_cpu.cpp` (used by kernels/paged_attention_cpu.py).
Bindings and tensor checks: `csrc/quantized_linear_bindings.cpp`.

The build is cached by what changes the object: a key over the csrc files' contents, the
compiler flags, the torch version and the Python tag, in `{torch extensions dir}/{name}-{key}/`
(`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions). The sources are copied there, so the
build commands do not depend on where the checkout lives; once a build has completed, later
processes import the module from that directory without running ninja at all. When a build is
needed, it runs with one fixed ninja: the `ninja` package's (a dependency, installed beside this
Python), whatever PATH says. A system ninja of another version on PATH used to rebuild the
other's objects (its build log format differs), ~45 s per launch style.

`cpu_extension()` returns the module, or None where the CPU lacks AVX2/FMA/F16C or the build
fails; either is logged once, saying what failed, and every caller then takes its torch path.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Iterator, Sequence

_CSRC_DIR = Path(__file__).parent / "csrc"
_NAME = "deepinfer_cpu_ops"
_SOURCES = ("quantized_linear_avx2.cpp", "quantized_linear_avx512.cpp", "f32_linear_avx2.cpp",
            "rms_norm_avx2.cpp", "paged_attention_cpu.cpp", "quantized_linear_bindings.cpp")
_CFLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_DONE = "complete"   # written into a build directory once its module has loaded

logger = logging.getLogger(__name__)


class ExtensionBuildError(RuntimeError):
    """A C++ extension could not be built; the message says what was missing or failed."""


def _cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return all(flag in flags for flag in ("avx2", "fma", "f16c"))


def build_key(csrc_dir: Path, cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """16 hex digits over what changes the built object: every file of `csrc_dir` (names and
    contents, not their location), the flags, the torch version and the Python tag."""
    import torch

    digest = hashlib.sha256()
    for path in sorted(p for p in csrc_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    digest.update(repr((tuple(cflags), tuple(ldflags), torch.__version__, tag)).encode())
    return digest.hexdigest()[:16]


def packaged_ninja() -> Path | None:
    """The `ninja` package's binary (the one ninja every build uses), else a ninja beside this
    Python (a venv's bin/), else None."""
    with contextlib.suppress(ImportError):
        import ninja

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.is_file():
            return candidate
    beside = Path(sys.executable).parent / "ninja"
    return beside if beside.is_file() else None


@contextlib.contextmanager
def _only_this_ninja(ninja: Path, bin_dir: Path) -> Iterator[None]:
    """torch runs `ninja` from PATH: put a directory holding only a link to `ninja` first on
    PATH for the build, then restore PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    if (bin_dir / "ninja").resolve() != ninja.resolve():   # absent, or another venv's
        temporary = bin_dir / f"ninja.{os.getpid()}"
        temporary.unlink(missing_ok=True)
        temporary.symlink_to(ninja)
        temporary.replace(bin_dir / "ninja")
    old_path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{old_path}"
    try:
        yield
    finally:
        os.environ["PATH"] = old_path


def _import_built(name: str, build_dir: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, build_dir / f"{name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _why(error: BaseException) -> str:
    """What a failed build lacked or said, in one line a user can act on."""
    if packaged_ninja() is None and shutil.which("ninja") is None:
        return ("no ninja: the `ninja` package is missing from this Python environment; "
                f"run `{sys.executable} -m pip install ninja`")
    if shutil.which("c++") is None:
        return "no C++ compiler: `c++` is not on PATH; install g++ (or clang) and restart"
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    diagnostics = [line for line in lines if "error:" in line]   # file:line:col: error: ...
    first = (diagnostics or lines or [repr(error)])[0]
    return f"the compiler failed: {first[:300]}"


def build_or_load(name: str, csrc_dir: Path, sources: Sequence[str], build_root: Path,
                  cflags: Sequence[str] = (), ldflags: Sequence[str] = ()) -> ModuleType:
    """The extension `name` built from `csrc_dir`/`sources` (`TORCH_EXTENSION_NAME` = `name`):
    imported from `build_root/{name}-{key}` when a build completed there before, else built
    there (with the packaged ninja) and imported. Raises ExtensionBuildError saying why not."""
    from torch.utils.cpp_extension import load

    build_dir = Path(build_root) / f"{name}-{build_key(csrc_dir, cflags, ldflags)}"
    if (build_dir / _DONE).exists():
        with contextlib.suppress(ImportError, OSError):   # else (deleted?) built again
            return _import_built(name, build_dir)
    ninja = packaged_ninja()
    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    for path in csrc_dir.iterdir():
        if path.is_file() and not (src_dir / path.name).exists():
            temporary = src_dir / f".{path.name}.{os.getpid()}"
            shutil.copyfile(path, temporary)
            temporary.replace(src_dir / path.name)   # whole, for a build running meanwhile
    logger.info("building deepinfer's C++ CPU kernels in %s (once per machine, ~1 min)",
                build_dir)
    use_ninja = (_only_this_ninja(ninja, build_dir / "bin") if ninja is not None
                 else contextlib.nullcontext())
    try:
        with use_ninja:
            module = load(name=name, sources=[str(src_dir / s) for s in sources],
                          extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                          build_directory=str(build_dir), verbose=False)
    except Exception as error:  # noqa: BLE001 - compiler, ninja or loader: say which
        raise ExtensionBuildError(f"{_why(error)}; the whole log: `{ninja or 'ninja'} -v -C "
                                  f"{build_dir}`") from error
    (build_dir / _DONE).touch()
    return module


@functools.cache
def cpu_extension() -> ModuleType | None:
    """The compiled CPU kernels module, or None (logged once) where it cannot be built or run."""
    if not _cpu_has_avx2():
        logger.warning("CPU lacks AVX2/FMA/F16C: deepinfer's C++ CPU kernels are off (quantized "
                       "linear uses float32 weights; RMSNorm and attention use torch ops).")
        return None
    from torch.utils.cpp_extension import get_default_build_root

    try:
        return build_or_load(_NAME, _CSRC_DIR, _SOURCES, Path(get_default_build_root()),
                             _CFLAGS, _LDFLAGS)
    except ExtensionBuildError as error:
        logger.warning("building deepinfer's C++ CPU kernels failed (%s); falling back to the "
                       "~4x slower torch ops (quantized linear uses float32 weights).", error)
        return None


def batch_invariant_summary() -> str:
    """What the batch-invariant mode (`KernelConfig.batch_invariant`) runs on this CPU, for the
    start-up log: the invariant forms are slower than the default kernels where said."""
    ext = cpu_extension()
    if ext is None:
        return ("the C++ extension is unavailable: every linear row is its own F.linear call "
                "and attention runs the float32 reference token by token (much slower)")
    quantized = ("the AVX-512 few-row nest in tiles of 8 rows (as fast as the default at decode)"
                 if ext.avx512_available() else
                 "one FMA chain per row (no AVX-512 here: slower than the default at 1-4 rows)")
    return (f"float32 linears run a fixed-order kernel; Q4_1 / Q8_0 linears {quantized}, "
            "prefill included; attention runs the per-token C++ kernel for every token, "
            "prefill chunks included (slower prefill than the default SDPA)")
