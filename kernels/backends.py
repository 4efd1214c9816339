"""Backend choice shared by the public ops in kernels/ (STYLE.md #6).

Each op (paged attention, MLA attention, MoE experts) lists its backends as module paths; a
backend module is imported on first use only, so a CPU-only install never imports Triton.
`backend="auto"` asks the op's own rule which backend suits the tensors' device.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

# per-device tuning files that the sweeps in benchmarks/ write (configs/<kind>_<device>.json)
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


def device_config_path(kind: str, device_name: str) -> Path:
    """Where a sweep of `kind` ("skinny_linear", "blas_library") keeps its choices for
    `device_name` ("NVIDIA H200")."""
    return CONFIG_DIR / f"{kind}_{device_name.replace(' ', '_')}.json"


def config_entries(kind: str, device_name: str) -> list[dict]:
    """The `entries` of the `kind` file of `device_name` ("NVIDIA H200"); [] without one."""
    path = device_config_path(kind, device_name)
    return json.loads(path.read_text())["entries"] if path.exists() else []


def device_config_entries(kind: str, device: torch.device) -> list[dict]:
    """The `entries` of the `kind` file of CUDA `device`'s model name; [] without one."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return config_entries(kind, torch.cuda.get_device_name(index))


@functools.cache
def tuned_table(kind: str, device: torch.device, build: Callable[[list[dict]], dict]) -> dict:
    """`build(entries)` of the `kind` tuned-config file of CUDA `device`, looked up by the
    device's model name, built once per (kind, device, build).

    Lookup and fallback: the table is keyed by shape (each kind names its key, e.g. (row bucket,
    out_features, in_features)); a device without a file gets {} and a shape without an entry
    is simply absent, so the caller takes its fallback (cuBLAS, torch's default BLAS library,
    the unfused ops). A missing entry is never an error.
    """
    return build(device_config_entries(kind, device))


def write_device_config(kind: str, entries: list[dict], made_by: str) -> Path:
    """Write a sweep's `entries` as the `kind` file of the current CUDA device (with the
    device name, torch version and the command that made it); returns the path."""
    device = torch.cuda.get_device_name()
    path = device_config_path(kind, device)
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                "made_by": made_by, "entries": entries}, indent=1) + "\n")
    return path


def update_device_config(kind: str, entries: list[dict], made_by: str, key) -> Path:
    """`write_device_config` of `entries` plus the file's current entries whose key(entry)
    none of `entries` has (a sweep of some shapes or row buckets keeps the others), ordered
    by key; returns the path."""
    path = device_config_path(kind, torch.cuda.get_device_name())
    swept = {key(e) for e in entries}
    kept = [e for e in (json.loads(path.read_text())["entries"] if path.exists() else [])
            if key(e) not in swept]
    return write_device_config(kind, sorted(kept + entries, key=key), made_by)


@functools.cache
def triton_available() -> bool:
    """True if the `triton` package is importable (it is absent on CPU-only installs)."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def load_module(path: str) -> ModuleType:
    return importlib.import_module(path)


class Backends:
    """The backends of one op.

    Args:
        op: the op's name, for error messages ("paged attention").
        modules: backend name -> module path, e.g. {"torch": "deepinfer.kernels.paged_attention_torch"}.
        auto: device -> backend name that "auto" means there; default: always "torch".
    """

    def __init__(self, op: str, modules: dict[str, str],
                 auto: Callable[[torch.device], str] | None = None) -> None:
        self.op = op
        self.modules = dict(modules)
        self.names = tuple(modules)
        self._auto = auto or (lambda device: "torch")

    def load(self, name: str) -> ModuleType:
        return load_module(self.modules[name])

    def resolve(self, backend: str, device: torch.device) -> str:
        """The backend name that `backend` means on `device` ("auto" resolved).

        Raises:
            ValueError: `backend` is neither "auto" nor one of `names`.
        """
        if backend == "auto":
            backend = self._auto(device)
        if backend not in self.modules:
            raise ValueError(f"{self.op} backend={backend!r} is unknown; use 'auto' or one of "
                             f"{self.names}.")
        return backend

    def get(self, backend: str, device: torch.device) -> ModuleType:
        """The module of `backend` ("auto" resolved for `device`); raises as `resolve`."""
        return self.load(self.resolve(backend, device))


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index` (the Triton kernels size their
    grids by it: split-K decode attention)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


MAX_ARRIVAL_COUNTERS = 1 << 16   # per device: output tiles (or groups) one call may count in
_arrival_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """[MAX_ARRIVAL_COUNTERS] int32 zeros on `device`, shared by the Triton kernels whose
    programs count themselves in so that the last one to arrive finishes the work (split-K
    GEMM tiles, decode-attention splits). Each call's last programs leave their counters at
    zero, and calls on one stream run one after another, so every call may use them; the
    fused MoE router, which may run concurrently with split-K GEMMs on another stream, counts
    on the last one only (`moe_routing_triton.route_hidden`).

    Made on the first call for a device, which must not be inside a CUDA graph capture (the
    engine runs each graph's work eagerly before capturing it).

    Raises:
        RuntimeError: the first call for a CUDA device is inside a graph capture.
    """
    if device not in _arrival_counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a Triton kernel's arrival counters are first needed inside a "
                               "CUDA graph capture; run the work once eagerly before capturing")
        _arrival_counters[device] = torch.zeros(MAX_ARRIVAL_COUNTERS, dtype=torch.int32,
                                                device=device)
    return _arrival_counters[device]
