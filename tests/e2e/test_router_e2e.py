"""`deepinfer router` in front of real `deepinfer serve` workers (embedded SmolLM2), as processes.

One module, processes shared by all its tests and started in parallel at the first test:
- `w1`, `w2`: plain workers (`--role both`, the embedded store). `w1` is also the monolithic
  reference every routed answer is compared with, token for token (greedy).
- `prefill`, `decode`: `--role prefill|decode` workers sharing a private `redis-server`.
- routers: `dp` (prefix_affinity over w1, w2), `pd` (prefill -> decode); the last test starts
  its own round-robin router and kills `w2` under it, so it must stay last.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import RedisServer
from tests.processes import ServerProcess, deepinfer, metric
from tests.router.router_fakes import wait_for

pytestmark = pytest.mark.slow

MODEL = "smollm2-router-e2e"
STARTUP_TIMEOUT_S = 900  # the first run on a machine converts the GGUF model into the cache
BLOCK_SIZE = 16


def start(name: str, args: list[str], tmp: Path) -> ServerProcess:
    return ServerProcess(name, deepinfer(*args), tmp / f"{name}.log",
                         env={"OMP_NUM_THREADS": "1"})   # four workers share two cores


def worker_args(*extra: str) -> list[str]:
    return ["serve", "--served-model-name", MODEL, "--max-num-seqs", "8",
            "--num-kv-blocks", "256", "--block-size", str(BLOCK_SIZE), *extra]


def router_args(*extra: str) -> list[str]:
    return ["router", "--health-interval-s", "0.5", "--health-timeout-s", "5",
            "--log-level", "warning", *extra]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """All worker processes, launched together (the slow part is each one's start-up)."""
    tmp = tmp_path_factory.mktemp("router-e2e")
    procs: dict[str, ServerProcess] = {}
    redis = None
    try:
        procs["w1"] = start("w1", worker_args(), tmp)
        procs["w2"] = start("w2", worker_args(), tmp)
        redis = RedisServer().start()
        for role in ("prefill", "decode"):
            procs[role] = start(role, worker_args("--role", role, "--kv-store", redis.url), tmp)
        for proc in procs.values():
            proc.wait_ready(STARTUP_TIMEOUT_S)
        procs["dp"] = start("dp", router_args("--backend", procs["w1"].url, "--backend",
                                             procs["w2"].url, "--policy", "prefix_affinity"),
                           tmp).wait_ready(60)
        procs["pd"] = start("pd", router_args("--prefill", procs["prefill"].url,
                                             "--decode", procs["decode"].url),
                           tmp).wait_ready(60)
        yield {**procs, "redis": redis, "tmp": tmp}
    finally:
        for proc in procs.values():
            proc.kill()
        if redis is not None:
            redis.stop()


@pytest.fixture(scope="module")
def disagg(cluster):
    return cluster


def post(base: str, path: str, body: dict) -> dict:
    reply = httpx.post(base + path, json={"model": MODEL, "temperature": 0, **body},
                       timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def stream(base: str, path: str, body: dict) -> tuple[str, list[dict]]:
    """The streamed text and every event (the `[DONE]` terminator checked and dropped)."""
    events = []
    with httpx.stream("POST", base + path, timeout=300, json={
            "model": MODEL, "temperature": 0, "stream": True, **body}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line:
                events.append(line)
    assert events[-1] == "data: [DONE]", events[-3:]
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    text = "".join(c["choices"][0].get("text") or c["choices"][0].get("delta", {})
                   .get("content") or "" for c in chunks if c["choices"])
    return text, chunks


def answer(reply: dict) -> str:
    choice = reply["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer in one short sentence."},
          {"role": "user", "content": "Why is the sky blue?"}]]


def test_greedy_answers_through_the_router_equal_direct_ones(cluster):
    w1, dp = cluster["w1"].url, cluster["dp"].url
    for messages in CHATS:
        body = {"messages": messages, "max_tokens": 12}
        direct = post(w1, "/v1/chat/completions", body)
        routed = post(dp, "/v1/chat/completions", body)
        assert answer(routed) == answer(direct) and answer(direct)
        assert routed["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"]
        assert stream(dp, "/v1/chat/completions", body)[0] == answer(direct)
    body = {"prompt": "The three primary colours are", "max_tokens": 10}
    direct = answer(post(w1, "/v1/completions", body))
    assert answer(post(dp, "/v1/completions", body)) == direct
    assert stream(dp, "/v1/completions", body)[0] == direct
    models = httpx.get(dp + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]


def test_prefix_affinity_sends_a_conversation_back_to_its_replica(cluster):
    """Each later turn finds the earlier turns' blocks in its replica's prefix cache, which
    only the replica that served them holds (the workers share no store)."""
    dp = cluster["dp"].url
    topic = ("Here is a long description of a garden with roses, tulips, daisies, a small "
             "pond with goldfish, an old oak tree and a wooden bench under it. ")
    served_before = {w: metric(dp, "deepinfer_router:requests_total", backend=cluster[w].url)
                     for w in ("w1", "w2")}
    for conversation in range(4):
        messages = [{"role": "user", "content": f"Conversation {conversation}. {topic}"
                                                "Name one flower in it."}]
        previous_prompt_tokens = 0
        for turn in range(3):
            reply = post(dp, "/v1/chat/completions", {"messages": messages, "max_tokens": 4})
            usage = reply["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert cached >= previous_prompt_tokens // BLOCK_SIZE * BLOCK_SIZE, (turn, usage)
            previous_prompt_tokens = usage["prompt_tokens"]
            messages = messages + [{"role": "assistant", "content": answer(reply)},
                                   {"role": "user", "content": f"And another, {turn}?"}]
    served = {w: metric(dp, "deepinfer_router:requests_total", backend=cluster[w].url)
              - served_before[w] for w in ("w1", "w2")}
    assert sum(served.values()) == 12 and all(n % 3 == 0 for n in served.values()), served


def test_client_disconnect_through_the_router_aborts_the_worker(cluster):
    workers = [cluster["w1"].url, cluster["w2"].url]

    def total(name: str, **labels: str) -> float:
        return sum(metric(url, name, **labels) for url in workers)

    aborts = total("deepinfer:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "messages": CHATS[0], "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", cluster["dp"].url + "/v1/chat/completions", json=body,
                      timeout=300) as reply:
        lines = (line for line in reply.iter_lines() if line)
        for _ in range(3):
            assert next(lines).startswith("data: {")
        assert total("deepinfer:num_requests_running") == 1
    assert wait_for(lambda: total("deepinfer:num_requests_running") == 0
                    and total("deepinfer:kv_cache_usage_perc") == 0, 30)
    assert total("deepinfer:request_success_total", finished_reason="abort") == aborts + 1


def disagg_prompts(tokenizer, offset: int = 0) -> list[list[int]]:
    """Token-id prompts from a few tokens to many blocks with a partial last block; another
    `offset` gives prompts no worker has seen (nothing in any prefix cache)."""
    text = " ".join(f"Sentence number {i} talks about the weather, rivers and mountains."
                    for i in range(40))
    ids = tokenizer.encode(text)[offset:]
    lengths = [3, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 7, 12 * BLOCK_SIZE + 5]
    assert len(ids) > lengths[-1]
    return [ids[:n] for n in lengths]


def test_disaggregated_is_token_identical_to_monolithic(disagg, smollm2_tokenizer):
    w1, pd, decode = disagg["w1"].url, disagg["pd"].url, disagg["decode"].url
    for prompt in disagg_prompts(smollm2_tokenizer):
        body = {"prompt": prompt, "max_tokens": 8, "logprobs": 0}
        direct = post(w1, "/v1/completions", body)
        routed = post(pd, "/v1/completions", body)
        tokens = direct["choices"][0]["logprobs"]["tokens"]
        assert routed["choices"][0]["logprobs"]["tokens"] == tokens, len(prompt)
        assert answer(routed) == answer(direct)
        assert routed["usage"]["prompt_tokens"] == len(prompt)
        assert stream(pd, "/v1/completions", body)[0] == answer(direct)
    messages = CHATS[1]
    body = {"messages": messages, "max_tokens": 12}
    direct = answer(post(w1, "/v1/chat/completions", body))
    assert answer(post(pd, "/v1/chat/completions", body)) == direct
    assert stream(pd, "/v1/chat/completions", body)[0] == direct
    assert metric(pd, "deepinfer_router:disagg_fallbacks_total") == 0
    # the decode worker loaded the prefill worker's blocks instead of recomputing them
    assert store_hits(decode) > 0
    long_prompt = disagg_prompts(smollm2_tokenizer)[-1]
    handoff = post(disagg["prefill"].url, "/v1/completions", {
        "prompt": long_prompt, "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
    assert handoff["do_remote_prefill"] and handoff["block_size"] == BLOCK_SIZE
    assert 0 < handoff["num_stored_tokens"] <= len(long_prompt)
    assert handoff["num_stored_tokens"] % BLOCK_SIZE == 0


def store_hits(url: str) -> float:
    """Blocks the worker loaded from the KV store (its `deepinfer:kv_store*hits*` counter)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    found = [s.value for f in text_string_to_metric_families(text) for s in f.samples
             if re.fullmatch(r"deepinfer:kv_?store\w*hits(_total)?", s.name)]
    assert found, "the worker exports no deepinfer:kv_store...hits counter"
    return sum(found)


def test_redis_down_mid_run_still_answers_the_same(disagg, smollm2_tokenizer):
    w1, pd, redis = disagg["w1"].url, disagg["pd"].url, disagg["redis"]
    prompts = disagg_prompts(smollm2_tokenizer, offset=5)[2:]
    expected = [answer(post(w1, "/v1/completions", {"prompt": p, "max_tokens": 8}))
                for p in prompts]
    hits = store_hits(disagg["decode"].url)
    redis.stop()
    try:
        for prompt, want in zip(prompts, expected):
            assert answer(post(pd, "/v1/completions", {"prompt": prompt, "max_tokens": 8})) \
                == want
        text, _ = stream(pd, "/v1/completions", {"prompt": prompts[-1], "max_tokens": 8})
        assert text == expected[-1]
        assert store_hits(disagg["decode"].url) == hits  # all recomputed
    finally:
        redis.start()


def test_killed_worker_is_ejected_and_later_requests_succeed(cluster):
    """Must stay last: it kills w2."""
    w1, w2 = cluster["w1"], cluster["w2"]
    router = start("rr", router_args("--backend", w2.url, "--backend", w1.url, "--policy",
                                    "round_robin"), cluster["tmp"])
    try:
        router.wait_ready(60)
        assert wait_for(lambda: httpx.get(router.url + "/health").json()
                        .get("healthy_replicas") == 2)
        body = {"model": MODEL, "messages": CHATS[0], "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", router.url + "/v1/chat/completions", json=body,
                          timeout=300) as reply:  # round robin: the first request goes to w2
            lines = (line for line in reply.iter_lines() if line)
            for _ in range(3):
                assert next(lines).startswith("data: {")
            assert metric(w2.url, "deepinfer:num_requests_running") == 1
            w2.kill()
            rest = list(lines)
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][len("data: "):])["error"]["code"] == "worker_failed"
        expected = answer(post(w1.url, "/v1/chat/completions",
                               {"messages": CHATS[1], "max_tokens": 6}))
        for _ in range(4):
            got = post(router.url, "/v1/chat/completions", {"messages": CHATS[1],
                                                             "max_tokens": 6})
            assert answer(got) == expected
        assert wait_for(lambda: metric(router.url, "deepinfer_router:backend_healthy",
                                       backend=w2.url) == 0)
        assert metric(router.url, "deepinfer_router:ejections_total", backend=w2.url) == 1
        assert httpx.get(router.url + "/health").json()["healthy_replicas"] == 1
    finally:
        router.kill()
