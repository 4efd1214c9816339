"""Replica-selection policies: pure functions, tested without sockets."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest

from deepinfer.router.config import RouterConfig
from deepinfer.router.policies import (PROMPT_PREFIX_CHARS, RequestFeatures, affinity_key,
                             least_outstanding, make_policy, prefix_affinity,
                             rendezvous_order, round_robin)


@dataclass
class R:
    url: str
    healthy: bool = True
    outstanding: int = 0


def replicas(n: int, **overrides) -> list[R]:
    return [R(f"http://w{i}:8000", **overrides) for i in range(n)]


def key(i: int) -> bytes:
    return affinity_key("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": f"conversation {i}"}]})


def test_round_robin_cycles_over_healthy_replicas():
    pool = replicas(3)
    pool[1].healthy = False
    picked = [round_robin(RequestFeatures(seq=s), pool).url for s in range(4)]
    assert picked == [pool[0].url, pool[2].url, pool[0].url, pool[2].url]
    assert round_robin(RequestFeatures(seq=0), replicas(2, healthy=False)) is None
    assert round_robin(RequestFeatures(seq=0), []) is None


def test_least_outstanding_picks_the_least_loaded_and_rotates_ties():
    pool = replicas(3)
    pool[0].outstanding, pool[1].outstanding, pool[2].outstanding = 3, 1, 1
    picked = {least_outstanding(RequestFeatures(seq=s), pool).url for s in range(4)}
    assert picked == {pool[1].url, pool[2].url}
    pool[2].healthy = False
    assert least_outstanding(RequestFeatures(seq=7), pool) is pool[1]


def test_prefix_affinity_is_sticky_and_spreads_keys():
    pool = replicas(3)
    chosen = [prefix_affinity(RequestFeatures(seq=s, affinity_key=key(i)), pool)
              for i in range(60) for s in range(2)]
    assert all(a is b for a, b in zip(chosen[::2], chosen[1::2]))  # seq does not matter
    load = Counter(r.url for r in chosen[::2])
    assert set(load) == {r.url for r in pool} and min(load.values()) >= 8


def test_prefix_affinity_moves_only_the_keys_of_an_ejected_replica():
    pool = replicas(4)
    before = {i: prefix_affinity(RequestFeatures(0, key(i)), pool) for i in range(80)}
    pool[2].healthy = False
    after = {i: prefix_affinity(RequestFeatures(0, key(i)), pool) for i in range(80)}
    moved = [i for i in before if before[i] is not after[i]]
    assert moved and all(before[i] is pool[2] for i in moved)
    assert all(after[i] is not pool[2] for i in after)


def test_prefix_affinity_load_guard_takes_the_keys_next_choice():
    pool = replicas(3)
    features = RequestFeatures(seq=0, affinity_key=key(1))
    first, second, third = rendezvous_order(features.affinity_key, pool)
    first.outstanding = 4  # at the guard: still preferred
    assert prefix_affinity(features, pool, max_imbalance=4) is first
    first.outstanding = 5  # above it: the key's second choice, not a random one
    assert prefix_affinity(features, pool, max_imbalance=4) is second
    second.outstanding = 6
    assert prefix_affinity(features, pool, max_imbalance=4) is third


def test_prefix_affinity_without_a_key_is_least_outstanding():
    pool = replicas(2)
    pool[0].outstanding = 2
    assert prefix_affinity(RequestFeatures(seq=0), pool) is pool[1]
    assert prefix_affinity(RequestFeatures(seq=0, affinity_key=key(0)),
                           replicas(2, healthy=False)) is None


def test_chat_turns_of_one_conversation_share_a_key():
    system = {"role": "system", "content": "You are terse."}
    turn1 = [system, {"role": "user", "content": "Name a fruit."}]
    turn2 = turn1 + [{"role": "assistant", "content": "Apple."},
                     {"role": "user", "content": "Another one."}]
    other = [system, {"role": "user", "content": "Name a colour."}]
    chat = "/v1/chat/completions"
    assert affinity_key(chat, {"messages": turn1}) == affinity_key(chat, {"messages": turn2})
    assert affinity_key(chat, {"messages": turn1}) != affinity_key(chat, {"messages": other})
    assert affinity_key(chat, {"messages": turn1, "model": "a"}) != \
        affinity_key(chat, {"messages": turn1, "model": "b"})
    assert len(affinity_key(chat, {"messages": turn1})) == 16


def test_completion_prompts_key_on_their_leading_characters():
    long = "x" * PROMPT_PREFIX_CHARS
    path = "/v1/completions"
    assert affinity_key(path, {"prompt": long + " turn 1"}) == \
        affinity_key(path, {"prompt": long + " turn 2, longer"})
    assert affinity_key(path, {"prompt": "short a"}) != affinity_key(path, {"prompt": "short b"})
    assert affinity_key(path, {"prompt": [[1, 2, 3]]}) == affinity_key(path, {"prompt": [1, 2, 3]})
    assert affinity_key(path, {"prompt": ["p", "q"]}) == affinity_key(path, {"prompt": "p"})


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", None), ("/v1/chat/completions", [1]),
    ("/v1/chat/completions", {"messages": []}), ("/v1/chat/completions", {"messages": "hi"}),
    ("/v1/completions", {"prompt": ""}), ("/v1/completions", {"prompt": []}),
    ("/v1/completions", {}),
])
def test_bodies_without_a_prefix_have_no_key(path, body):
    assert affinity_key(path, body) is None


def test_make_policy_and_config_refuse_unknown_names():
    assert make_policy("round_robin") is round_robin
    assert make_policy("prefix_affinity", max_imbalance=0).keywords == {"max_imbalance": 0}
    with pytest.raises(ValueError, match="policy 'random' is unknown"):
        make_policy("random")
    with pytest.raises(ValueError, match="policy='random' is unknown"):
        RouterConfig(backends=("http://a",), policy="random")


@pytest.mark.parametrize("kwargs, message", [
    ({}, "no workers"),
    ({"prefill": ("http://p",)}, "no workers"),
    ({"backends": ("http://a",), "decode": ("http://d",)}, "not both"),
    ({"backends": ("a:8000",)}, "must start with http"),
    ({"backends": ("http://a",), "max_failures": 0}, "max_failures=0 must be >= 1"),
    ({"backends": ("http://a",), "health_interval_s": 0}, "health_interval_s=0 must be > 0"),
])
def test_config_errors_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)
