"""The replica registry: every worker the router knows, its role, health and load.

Health: every `health_interval_s` the router sends `GET /health` to each replica (timeout
`health_timeout_s`). A 200 admits the replica (re-admits an ejected one) and resets its failure
count; anything else counts a failure, and `max_failures` consecutive failures eject it. A
refused connection ejects at once, from a health check or from a proxied request. Replicas start
ejected and join at their first good check, so a worker still loading its model gets no traffic.
A worker shutting down answers 503 `{"status": "draining"}` while it finishes its requests: it
is marked `stopping` (no new request goes to it) but stays admitted, so the requests it holds
are neither cancelled nor retried; its next 200 clears the mark.

Membership: static replicas stay for the router's life. Discovered ones (`router.discovery`)
come and go through `sync(source, role, urls)`: a new URL joins ejected; a URL that left is
dropped from selection and health checks at once (moved to `draining`) and forgotten when its
last outstanding request is released (`release`), so no request in flight is lost; a draining
URL that comes back rejoins with its count intact. `on_forget` runs when a replica is forgotten.

The registry is the single owner of replica state; it runs in the router's one event loop, so
the proxy's `outstanding` increments and the checks never race.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import httpx

logger = logging.getLogger("deepinfer.router")

ROLES = ("both", "prefill", "decode")


@dataclass(eq=False)
class Replica:
    """One worker. `url` is its base URL; `role` is both|prefill|decode; `outstanding` counts the
    router's requests in flight on it; `consecutive_failures` resets on any success."""

    url: str
    role: str = "both"
    healthy: bool = False
    outstanding: int = 0
    consecutive_failures: int = 0
    # the discovered service URL this replica is an address of; None for a static replica
    source: str | None = None
    # left the pool while requests were in flight: not selected, not checked, forgotten at 0
    draining: bool = False
    # the worker said it is shutting down ("draining" health): finishing, taking nothing new
    stopping: bool = False


def _says_draining(response: httpx.Response) -> bool:
    try:
        return response.json().get("status") == "draining"
    except (ValueError, AttributeError):
        return False


class Registry:
    """Replicas by role, with failure accounting and the periodic health check."""

    def __init__(self, replicas: Iterable[Replica], *, max_failures: int = 3,
                 on_eject: Callable[[Replica], None] | None = None,
                 on_forget: Callable[[Replica], None] | None = None) -> None:
        self.all = list(replicas)
        self.draining: list[Replica] = []
        for replica in self.all:
            if replica.role not in ROLES:
                raise ValueError(f"replica {replica.url} has role {replica.role!r}; use one "
                                 f"of {ROLES}")
        self.max_failures = max_failures
        self.on_eject = on_eject
        self.on_forget = on_forget

    def known(self) -> list[Replica]:
        """Every replica with state worth reporting: the pool and those still draining."""
        return self.all + self.draining

    def replicas(self, role: str) -> list[Replica]:
        """Replicas that can take new `role` work: a role-`both` replica does any; a stopping
        one none."""
        return [r for r in self.all if (r.role == role or r.role == "both") and not r.stopping]

    def serving(self) -> list[Replica]:
        """Replicas that answer whole requests (decode or both)."""
        return [r for r in self.all if r.role != "prefill"]

    def record_success(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        if not replica.healthy:
            replica.healthy = True
            logger.info("replica %s (%s) admitted", replica.url, replica.role)

    def record_failure(self, replica: Replica, *, unreachable: bool, reason: str) -> None:
        """One failure; eject at `max_failures` in a row, or at once if `unreachable`."""
        replica.consecutive_failures += 1
        if replica.healthy and (unreachable
                                or replica.consecutive_failures >= self.max_failures):
            replica.healthy = False
            logger.warning("replica %s (%s) ejected after %d failure(s): %s", replica.url,
                           replica.role, replica.consecutive_failures, reason)
            if self.on_eject is not None:
                self.on_eject(replica)

    def release(self, replica: Replica) -> None:
        """One request of `replica` finished; a draining replica is forgotten at zero."""
        replica.outstanding -= 1
        if replica.draining and replica.outstanding <= 0:
            self.draining.remove(replica)
            self._forget(replica)

    def sync(self, source: str, role: str, urls: Iterable[str]) -> list[Replica]:
        """Make the replicas discovered from `source` (with `role`) exactly `urls`; returns
        the replicas added (ejected until their first good health check). A URL another
        source already holds is skipped (one replica per URL keeps metrics labels unique)."""
        wanted = list(dict.fromkeys(urls))
        for replica in [r for r in self.all if r.source == source and r.url not in wanted]:
            self.all.remove(replica)
            logger.info("replica %s (%s) left %s", replica.url, replica.role, source)
            if replica.outstanding > 0:
                replica.draining = True
                self.draining.append(replica)
            else:
                self._forget(replica)
        held = {r.url: r for r in self.all}
        added = []
        for url in wanted:
            if url in held:
                if held[url].source != source:
                    logger.warning("%s from %s is already a replica (%s); skipped", url,
                                   source, held[url].source or "static")
                continue
            replica = next((r for r in self.draining if r.url == url), None)
            if replica is not None:  # came back before its last request finished
                self.draining.remove(replica)
                replica.draining, replica.source, replica.role = False, source, role
            else:
                replica = Replica(url, role, source=source)
            self.all.append(replica)
            added.append(replica)
            logger.info("replica %s (%s) found in %s", url, role, source)
        return added

    def _forget(self, replica: Replica) -> None:
        replica.healthy = False
        if self.on_forget is not None:
            self.on_forget(replica)

    async def check(self, client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> None:
        """One health check of `replica`: GET /health must answer 200 within `timeout_s`.
        A replica that left the pool meanwhile is not updated."""
        reason, unreachable, stopping = None, False, False
        try:
            response = await client.get(replica.url + "/health", timeout=timeout_s)
            stopping = response.status_code == 503 and _says_draining(response)
            if response.status_code != 200 and not stopping:
                reason = f"/health answered {response.status_code}"
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            reason, unreachable = type(exc).__name__, True
        except httpx.HTTPError as exc:
            reason = type(exc).__name__
        if replica not in self.all:  # discovery removed it during the check
            return
        if stopping != replica.stopping:
            logger.info("replica %s (%s) %s", replica.url, replica.role,
                        "is draining: no new requests" if stopping else "serves again")
            replica.stopping = stopping
        if stopping:
            return   # neither a success (no new work) nor a failure (keep what it runs)
        if reason is None:
            self.record_success(replica)
        else:
            self.record_failure(replica, unreachable=unreachable, reason=reason)

    async def check_all(self, client: httpx.AsyncClient, timeout_s: float) -> None:
        await asyncio.gather(*(self.check(client, r, timeout_s) for r in self.all))

    async def run_health_checks(self, client: httpx.AsyncClient, *, interval_s: float,
                                timeout_s: float) -> None:
        """Check every replica every `interval_s` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.check_all(client, timeout_s)
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("health check round failed")
