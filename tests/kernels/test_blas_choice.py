"""cuBLAS / cuBLASLt choice per decode linear shape (kernels/blas_choice.py).

The lookup is checked on CPU against a sweep file written in the test (a fake device name): the
row buckets, the shapes the file chose cuBLASLt for, the row cap, a missing file; and the context
that switches torch's preferred library restores it. On a GPU, a linear of a shape the file
chooses runs through cuBLASLt and matches cuBLAS's F.linear (bf16 tolerance), leaving torch's
preference as it was.
"""

import json

import pytest
import torch

from deepinfer.kernels import backends, blas_choice


def bf16(*shape):
    return torch.empty(*shape, device="meta", dtype=torch.bfloat16)


@pytest.mark.parametrize("rows, bucket", [(0, 1), (1, 1), (3, 4), (64, 64), (65, 128)])
def test_row_bucket(rows, bucket):
    assert blas_choice.row_bucket(rows) == bucket


@pytest.fixture
def sweep_file(tmp_path, monkeypatch):
    monkeypatch.setattr(backends, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    backends.tuned_table.cache_clear()
    entries = [{"shape": "down", "rows": 64, "out_features": 32, "in_features": 112,
                "cublas_us": 35.4, "cublaslt_us": 31.9, "library": "cublaslt"},
               {"shape": "down", "rows": 8, "out_features": 32, "in_features": 112,
                "cublas_us": 31.6, "cublaslt_us": 34.2, "library": "cublas"}]
    path = backends.device_config_path(blas_choice.CONFIG_KIND, "Fake GPU")
    path.write_text(json.dumps({"entries": entries}))
    yield path
    backends.tuned_table.cache_clear()


def test_chosen_shapes_get_cublaslt(sweep_file):
    weight = bf16(32, 112)
    assert sweep_file.name == "blas_library_Fake_GPU.json"
    assert blas_choice.preferred_library(64, weight) == "cublaslt"
    assert blas_choice.preferred_library(33, weight) == "cublaslt"   # bucket 64
    assert blas_choice.preferred_library(8, weight) is None           # cuBLAS was faster
    assert blas_choice.preferred_library(16, weight) is None          # not swept
    assert blas_choice.preferred_library(64, bf16(112, 32)) is None       # other shape
    assert blas_choice.preferred_library(64, torch.empty(32, 112, device="meta")) is None  # fp32


def test_rows_past_the_cap_keep_the_default(sweep_file):
    from deepinfer.kernels.settings import KernelConfig

    capped = KernelConfig(cublaslt_max_rows=32)
    assert blas_choice.preferred_library(64, bf16(32, 112), capped) is None
    assert blas_choice.preferred_library(64, bf16(32, 112), KernelConfig(cublaslt_max_rows=0)) is None


def test_no_sweep_file_means_no_choice(sweep_file):
    sweep_file.unlink()
    backends.tuned_table.cache_clear()
    assert blas_choice.preferred_library(64, bf16(32, 112)) is None


def test_preferring_restores_the_library(monkeypatch):
    state = ["cublas"]

    def preferred_blas_library(backend=None):   # CPU builds refuse cuBLASLt: a stand-in
        if backend is not None:
            state.append(backend)
        return state[-1]

    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", preferred_blas_library)
    with blas_choice.preferring("cublaslt"):
        assert state[-1] == "cublaslt"
    assert state[-1] == "cublas"
    with pytest.raises(ValueError), blas_choice.preferring("cublaslt"):
        raise ValueError("a failing GEMM")
    assert state[-1] == "cublas"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_chosen_shape_runs_on_cublaslt_on_the_gpu(tmp_path, monkeypatch):
    from deepinfer.kernels import linear as kernels_linear
    from deepinfer.kernels.settings import KernelConfig

    monkeypatch.setattr(backends, "CONFIG_DIR", tmp_path)
    backends.tuned_table.cache_clear()
    backends.device_config_path(blas_choice.CONFIG_KIND, torch.cuda.get_device_name()).write_text(json.dumps({"entries": [
        {"rows": 8, "out_features": 96, "in_features": 64, "library": "cublaslt"}]}))
    calls = []
    real = blas_choice.preferring
    monkeypatch.setattr(kernels_linear, "preferring",
                        lambda library: calls.append(library) or real(library))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen).to(torch.bfloat16).cuda()
    weight = torch.randn(96, 64, generator=gen).to(torch.bfloat16).cuda()
    before = torch.backends.cuda.preferred_blas_library()
    try:
        out = kernels_linear.linear(x, weight,   # cuBLAS(Lt), not Triton
                                    settings=KernelConfig(skinny_max_rows=0))
    finally:
        backends.tuned_table.cache_clear()
    assert calls == ["cublaslt"]
    assert torch.backends.cuda.preferred_blas_library() == before
    reference = torch.nn.functional.linear(x.double(), weight.double())
    assert float((out.double() - reference).norm() / reference.norm()) < 1e-2


def test_a_partial_sweep_keeps_the_file_s_other_entries(sweep_file):
    """`backends.update_device_config` (gemv / fused sweeps with --shapes or --buckets): the
    swept keys are replaced, the others kept, all ordered by key; device name and command
    recorded."""
    def key(entry):
        return entry["rows"], entry["shape"]

    new = [{"shape": "down", "rows": 64, "out_features": 32, "in_features": 112,
            "cublas_us": 30.0, "cublaslt_us": 33.0, "library": "cublas"},
           {"shape": "up", "rows": 1, "out_features": 8, "in_features": 8,
            "cublas_us": 1.0, "cublaslt_us": 2.0, "library": "cublas"}]
    path = backends.update_device_config(blas_choice.CONFIG_KIND, new, "a sweep", key)
    written = json.loads(path.read_text())
    assert (written["device"], written["made_by"]) == ("Fake GPU", "a sweep")
    assert [(e["rows"], e["shape"], e["cublas_us"]) for e in written["entries"]] == [
        (1, "up", 1.0), (8, "down", 31.6), (64, "down", 30.0)]
