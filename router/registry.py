"""The replica registry: every worker the router knows, its role, health and load.

Health: every `health_interval_s` the router sends `GET /health` to each replica (timeout
`health_timeout_s`). A 200 admits the replica (re-admits an ejected one) and resets its failure
count; anything else counts a failure, and `max_failures` consecutive failures eject it. A
refused connection ejects at once, from a health check or from a proxied request. Replicas start
ejected and join at their first good check, so a worker still loading its model gets no traffic.

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


class Registry:
    """Replicas by role, with failure accounting and the periodic health check."""

    def __init__(self, replicas: Iterable[Replica], *, max_failures: int = 3,
                 on_eject: Callable[[Replica], None] | None = None) -> None:
        self.all = list(replicas)
        for replica in self.all:
            if replica.role not in ROLES:
                raise ValueError(f"replica {replica.url} has role {replica.role!r}; use one "
                                 f"of {ROLES}")
        self.max_failures = max_failures
        self.on_eject = on_eject

    def replicas(self, role: str) -> list[Replica]:
        """Replicas that can take `role` work: a role-`both` replica does any."""
        return [r for r in self.all if r.role == role or r.role == "both"]

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

    async def check(self, client: httpx.AsyncClient, replica: Replica, timeout_s: float) -> None:
        """One health check of `replica`: GET /health must answer 200 within `timeout_s`."""
        try:
            response = await client.get(replica.url + "/health", timeout=timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self.record_failure(replica, unreachable=True, reason=f"{type(exc).__name__}")
            return
        except httpx.HTTPError as exc:
            self.record_failure(replica, unreachable=False, reason=f"{type(exc).__name__}")
            return
        if response.status_code == 200:
            self.record_success(replica)
        else:
            self.record_failure(replica, unreachable=False,
                                reason=f"/health answered {response.status_code}")

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
