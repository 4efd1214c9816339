"""`deepinfer serve /path/to/a-tiny-deepseek-checkpoint` as a real process: a chat completion
over HTTP through the same server and engine path (MLA latent cache, MoE, YaRN). The weights
are random, so the text is meaningless; the protocol, the token counts and the start-up KV log
line are what is checked."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.processes import ServerProcess, deepinfer

pytestmark = pytest.mark.slow
STARTUP_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def tiny_deepseek_checkpoint(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A 3-layer random DeepSeek-V3 (q_lora, noaux_tc MoE, YaRN) with the SmolLM2 tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.engine.deepseek_configs import randomize_router_bias, tiny_deepseek_config

    path = tmp_path_factory.mktemp("tiny-deepseek")
    tokenizer = smollm2_tokenizer
    config = tiny_deepseek_config("v3_qlora_noaux_tc_yarn", vocab_size=len(tokenizer),
                                  bos_token_id=tokenizer.bos_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_router_bias(model)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(tiny_deepseek_checkpoint, tmp_path_factory):
    proc = ServerProcess("server", deepinfer(
        "serve", str(tiny_deepseek_checkpoint), "--served-model-name", "tiny-deepseek",
        "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "256", "--log-level", "info"),
        tmp_path_factory.mktemp("ds-e2e") / "server.log")
    try:
        proc.wait_ready(STARTUP_TIMEOUT_S)
        yield proc.url, proc.log_path
    finally:
        proc.kill()


def test_chat_completion_from_a_tiny_deepseek(server):
    url, log_path = server
    response = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-deepseek", "max_tokens": 12, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello, who are you?"}]})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny-deepseek"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= 12 and usage["prompt_tokens"] > 5
    # start-up log: the MLA layout, 3 layers x (32 + 16) latent values x 4 bytes
    assert "MLAAttentionSpec, 576 bytes/token" in log_path.read_text()


def test_streamed_and_unstreamed_greedy_agree(server):
    url, _ = server
    request = {"model": "tiny-deepseek", "max_tokens": 8, "temperature": 0,
               "messages": [{"role": "user", "content": "Count to three."}]}
    plain = httpx.post(url + "/v1/chat/completions", json=request, timeout=120).json()
    with httpx.stream("POST", url + "/v1/chat/completions", json={**request, "stream": True},
                      timeout=120) as response:
        assert response.status_code == 200
        chunks = [line.removeprefix("data: ") for line in response.iter_lines()
                  if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    import json

    streamed = "".join(json.loads(c)["choices"][0]["delta"].get("content") or ""
                       for c in chunks[:-1] if json.loads(c)["choices"])
    assert streamed == plain["choices"][0]["message"]["content"]
