"""Issue 26.3 on a real `deepinfer serve --cache-isolation user`: the secret-guessing attack
(`usage.prompt_tokens_details.cached_tokens` as an oracle) works within one user, which shows
the oracle is real, and finds nothing across users: every guess, the right one included, reports
the same cached_tokens (0), so a secret in another user's prompt cannot be recovered.

Prompts are token ids so the secret fills exactly one 16-token block after a 32-token prefix:
a right guess hits 3 cached blocks, a wrong one 2 (without isolation).
"""

from __future__ import annotations

import httpx
import pytest

from tests.processes import ServerProcess, deepinfer

pytestmark = pytest.mark.slow

BLOCK = 16
PREFIX = list(range(1000, 1000 + 2 * BLOCK))          # e.g. a shared system prompt
DIGIT = [2000 + d for d in range(10)]                  # ten "digit" tokens
SECRET = 7


def secret_block(digit: int) -> list[int]:
    return [DIGIT[digit]] * BLOCK


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess("isolated", deepinfer(
        "serve", "--cache-isolation", "user", "--block-size", str(BLOCK), "--max-num-seqs", "4",
        "--log-level", "warning"), tmp_path_factory.mktemp("iso") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.kill()


def cached_tokens(server: ServerProcess, prompt: list[int], **fields) -> int:
    reply = httpx.post(server.url + "/v1/completions", timeout=120,
                       json={"prompt": prompt, "max_tokens": 1, "temperature": 0, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def guesses(server: ServerProcess, **fields) -> dict[int, int]:
    """cached_tokens for each guessed digit (a 1-token tail keeps the guess block full)."""
    return {d: cached_tokens(server, PREFIX + secret_block(d) + [3000], **fields)
            for d in range(10)}


def test_the_cache_oracle_finds_nothing_across_users(server):
    victim = PREFIX + secret_block(SECRET) + list(range(4000, 4008))
    cached_tokens(server, victim, user="alice")
    # another user, or none: the right guess looks like every wrong one (only the attacker's
    # own first guess warms the 2-block prefix, for the attacker alone)
    for fields in ({"user": "mallory"}, {}):
        seen = guesses(server, **fields)
        assert seen == {0: 0, **{d: 2 * BLOCK for d in range(1, 10)}}, (fields, seen)
    # the same user: the oracle exists (the test can see a leak when there is one)
    seen = guesses(server, user="alice")
    assert seen[SECRET] == 3 * BLOCK
    assert {d: c for d, c in seen.items() if d != SECRET} == {
        d: 2 * BLOCK for d in range(10) if d != SECRET}


def test_an_explicit_cache_salt_isolates_within_a_user(server):
    prompt = PREFIX + secret_block(3) + [3001]
    cached_tokens(server, prompt, user="bob", cache_salt="tenant-1")
    assert cached_tokens(server, prompt, user="bob", cache_salt="tenant-1") == 3 * BLOCK
    assert cached_tokens(server, prompt, user="bob", cache_salt="tenant-2") == 0
    assert cached_tokens(server, prompt, user="bob") == 0
