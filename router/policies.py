"""Replica-selection policies: pure functions of (request features, replica states).

A policy takes the `RequestFeatures` of one request and the states of the candidate replicas
(the caller leaves out those already tried for this request) and returns the chosen replica,
or None when no candidate is healthy. Policies read state and never change it, so they are
tested without sockets, clocks or an event loop.

- `round_robin`: the request's sequence number modulo the healthy replicas.
- `least_outstanding`: the healthy replica with the fewest requests in flight (ties rotate by
  sequence number, so equal loads spread evenly).
- `prefix_affinity`: rendezvous (highest-random-weight) hashing of the request's conversation
  key over the healthy replicas, so that the same conversation lands on the replica whose
  prefix cache holds it, and a replica that leaves or joins moves only its own share of keys
  (Thaler & Ravishankar, "Using name-based mappings to increase hit rates", 1998). Load guard:
  a replica more than `max_imbalance` requests above the least-loaded one is skipped for the
  key's next choice, so one hot prefix cannot pile onto one replica.

The conversation key (`affinity_key`) is a digest of what stays the same across the turns of
one conversation: for chat, the model, the tools and the messages up to and including the first
user message (later turns append to them); for completions, the first `PROMPT_PREFIX_CHARS`
characters (or `PROMPT_PREFIX_TOKENS` token ids) of the prompt. It is blake2b, never Python's
`hash()`, so every router process maps a conversation the same way.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, TypeVar

PROMPT_PREFIX_CHARS = 256
PROMPT_PREFIX_TOKENS = 64


class ReplicaState(Protocol):
    """What a policy may read of a replica (`router.registry.Replica` has these)."""

    @property
    def url(self) -> str: ...

    @property
    def healthy(self) -> bool: ...

    @property
    def outstanding(self) -> int: ...


R = TypeVar("R", bound=ReplicaState)
Policy = Callable[["RequestFeatures", Sequence[R]], "R | None"]


@dataclass(frozen=True)
class RequestFeatures:
    """What the policies know of a request.

    seq: the router's running request number (round robin, tie-breaks).
    affinity_key: 16-byte digest of the conversation prefix, or None when the body has none
        (prefix_affinity then acts as least_outstanding).
    """

    seq: int
    affinity_key: bytes | None = None


def _digest(value: Any) -> bytes:
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def affinity_key(path: str, body: Any) -> bytes | None:
    """The conversation key of an OpenAI request body (parsed JSON) sent to `path`."""
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        first_user = next((i for i, m in enumerate(messages)
                           if isinstance(m, dict) and m.get("role") == "user"), len(messages) - 1)
        return _digest(["chat", body.get("model"), body.get("tools"),
                        messages[:first_user + 1]])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of prompts: key on the first
    if isinstance(prompt, str) and prompt:
        return _digest(["text", body.get("model"), prompt[:PROMPT_PREFIX_CHARS]])
    if isinstance(prompt, list) and prompt:
        return _digest(["tokens", body.get("model"), prompt[:PROMPT_PREFIX_TOKENS]])
    return None


def request_features(seq: int, path: str, body: Any) -> RequestFeatures:
    return RequestFeatures(seq=seq, affinity_key=affinity_key(path, body))


def round_robin(features: RequestFeatures, replicas: Sequence[R]) -> R | None:
    healthy = [r for r in replicas if r.healthy]
    return healthy[features.seq % len(healthy)] if healthy else None


def least_outstanding(features: RequestFeatures, replicas: Sequence[R]) -> R | None:
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        return None
    fewest = min(r.outstanding for r in healthy)
    tied = [r for r in healthy if r.outstanding == fewest]
    return tied[features.seq % len(tied)]


def rendezvous_order(key: bytes, replicas: Sequence[R]) -> list[R]:
    """`replicas` by decreasing rendezvous weight blake2b(key || url) for `key`."""
    def weight(replica: R) -> bytes:
        return hashlib.blake2b(key + replica.url.encode(), digest_size=8).digest()
    return sorted(replicas, key=weight, reverse=True)


def prefix_affinity(features: RequestFeatures, replicas: Sequence[R], *,
                    max_imbalance: int = 4) -> R | None:
    healthy = [r for r in replicas if r.healthy]
    if not healthy or features.affinity_key is None:
        return least_outstanding(features, healthy)
    fewest = min(r.outstanding for r in healthy)
    for replica in rendezvous_order(features.affinity_key, healthy):
        if replica.outstanding - fewest <= max_imbalance:
            return replica
    raise AssertionError("unreachable: the least-loaded replica always passes the guard")


def make_policy(name: str, *, max_imbalance: int = 4) -> Policy:
    """The policy called `name` (one of `router.config.POLICY_NAMES`)."""
    if name == "round_robin":
        return round_robin
    if name == "least_outstanding":
        return least_outstanding
    if name == "prefix_affinity":
        return functools.partial(prefix_affinity, max_imbalance=max_imbalance)
    raise ValueError(f"policy {name!r} is unknown; use round_robin, least_outstanding or "
                     "prefix_affinity")
