"""`deepinfer serve MODEL --device cuda`: the real server process on a GPU, end to end.

A small random Llama (word-level tokenizer "t0".."t511") is served in bf16 with CUDA graphs and
a profiled KV cache; a greedy completion over HTTP, streamed and not, must give the same text
as the offline engine (`LLM`) on the same GPU, weights and settings (same kernels, batch 1, so
bit-identical). Skipped without CUDA.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]
PROMPT, MAX_TOKENS = "t5 t6 t7 t8 t9", 12
ENGINE_FLAGS = ["--device", "cuda", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.1",
                "--kv-store", "none"]


def _model_dir(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=0.1,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="t1",
                            eos_token="t2").save_pretrained(path)
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _offline_text(model_dir: Path) -> str:
    from deepinfer.engine.config import EngineConfig
    from deepinfer.engine.llm import LLM
    from deepinfer.engine.sampling_params import SamplingParams

    config = EngineConfig().replace(
        model={"model": str(model_dir), "device": "cuda"}, scheduler={"max_num_seqs": 8},
        cache={"gpu_memory_utilization": 0.1}, kv_transfer={"kv_store": "none"})
    llm = LLM(config=config)
    text = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                               ignore_eos=True))[0].text
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return text


def _wait_ready(proc: subprocess.Popen, url: str, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log_path.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server not healthy:\n{log_path.read_text()}")


def test_serve_on_cuda_matches_offline_engine(tmp_path):
    import httpx

    model_dir = _model_dir(tmp_path / "model")
    expected = _offline_text(model_dir)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deepinfer.server.cli", "serve", str(model_dir), "--port", str(port),
             "--served-model-name", "gpu-e2e", *ENGINE_FLAGS], cwd=ROOT, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            _wait_ready(proc, url, log_path)
            body = {"model": "gpu-e2e", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                    "temperature": 0.0, "ignore_eos": True}
            reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            choice = reply.json()["choices"][0]
            streamed = []
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                              timeout=60) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        streamed += [c["text"] for c in json.loads(line[6:])["choices"]]
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    assert choice["text"] == expected and choice["finish_reason"] == "length"
    assert len(expected.split()) == MAX_TOKENS
    assert "".join(streamed) == expected
    assert "CUDA graphs: captured" in log_path.read_text()
