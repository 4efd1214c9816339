"""DNS service discovery: a worker pool behind one name that resolves to every pod.

In Kubernetes a pool of workers (a Deployment scaled by an HPA) has a headless Service
(`clusterIP: None`) whose DNS name answers one A/AAAA record per ready pod. With `--discovery
dns` each --backend/--prefill/--decode URL names such a pool: every `discovery_interval_s`
seconds its host is resolved, and each address becomes a replica `scheme://IP:PORT[/path]`
(IPv6 in brackets) with the pool's role. `Registry.sync` adds the new addresses (ejected until
their first good health check, which runs at once here) and drains the ones that left: they
take no new request and are forgotten when their last one finishes.

A resolution that fails (NXDOMAIN, no answer within `timeout_s`, any error) or answers no
address keeps the pool's last known replicas and logs a warning: a transient DNS error never
empties a pool, and replicas that really died are ejected by their health checks. Resolution
runs in the event loop's resolver thread (`loop.getaddrinfo`), so it never blocks requests; the
resolver is injectable (`Resolver`), so tests need no DNS.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Awaitable, Callable, Sequence
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import httpx

    from deepinfer.router.registry import Registry, Replica

logger = logging.getLogger("deepinfer.router")

# (host, port) -> the IP addresses the host resolves to; raises when it does not resolve
Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every IPv4 and IPv6 address of `host` (its A and AAAA records, deduplicated, in the
    system resolver's order), looked up off the event loop. Raises socket.gaierror (an
    OSError) when the name does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Service:
    """A pool named by `url` (`scheme://host[:port][/path]`) whose replicas have `role`."""

    url: str
    role: str
    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def from_url(cls, url: str, role: str) -> "Service":
        """The pool `url` names. Raises ValueError when it has no host or a bad port."""
        url = url.rstrip("/")
        parts = urlsplit(url)
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"worker URL {url!r} has an invalid port; write it as "
                             "http://NAME:PORT") from None
        if not parts.hostname:
            raise ValueError(f"worker URL {url!r} has no host name to resolve; write it as "
                             "http://NAME:PORT")
        if parts.query or parts.fragment or parts.username:
            raise ValueError(f"worker URL {url!r} has a query, fragment or user name; give "
                             "only http://NAME:PORT[/path]")
        return cls(url, role, parts.scheme, parts.hostname, port, parts.path)

    def replica_url(self, address: str) -> str:
        """The base URL of the replica at IP `address` (IPv6 bracketed, zone id escaped)."""
        host = f"[{address.replace('%', '%25')}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}{self.path}"


class ServiceDiscovery:
    """Keeps the registry's replicas of each service equal to what its name resolves to.

    Args:
        registry: where the replicas live (`Registry.sync` per service).
        services: the pools to resolve.
        resolve: the resolver (`resolve_dns` unless a test gives its own).
        timeout_s: a resolution slower than this fails (the pool is kept).
        on_failure: called with the service URL on each failed resolution (metrics).
    """

    def __init__(self, registry: "Registry", services: Sequence[Service], *,
                 resolve: Resolver = resolve_dns, timeout_s: float = 5.0,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.registry = registry
        self.services = list(services)
        self.resolve = resolve
        self.timeout_s = timeout_s
        self.on_failure = on_failure
        self._failing: set[str] = set()  # services whose last resolution failed

    async def refresh(self) -> list["Replica"]:
        """Resolve every service once and sync the registry; returns the replicas added."""
        answers = await asyncio.gather(*(self._addresses(s) for s in self.services))
        added: list[Replica] = []
        for service, addresses in zip(self.services, answers):
            if addresses is not None:
                added += self.registry.sync(service.url, service.role,
                                            [service.replica_url(a) for a in addresses])
        return added

    async def _addresses(self, service: Service) -> list[str] | None:
        """The service's addresses, or None (logged, counted) when resolution failed."""
        try:
            addresses = await asyncio.wait_for(self.resolve(service.host, service.port),
                                               self.timeout_s)
            reason = None if addresses else "no address"
        except Exception as exc:  # any resolver error keeps the pool: never crash the router
            addresses, reason = [], repr(exc)
        if reason is None:
            if service.url in self._failing:
                self._failing.discard(service.url)
                logger.info("%s resolves again (%d addresses)", service.url, len(addresses))
            return list(addresses)
        log = logger.debug if service.url in self._failing else logger.warning
        log("resolving %s failed (%s); keeping its %d known replicas", service.url, reason,
            sum(r.source == service.url for r in self.registry.all))
        self._failing.add(service.url)
        if self.on_failure is not None:
            self.on_failure(service.url)
        return None

    async def run(self, client: "httpx.AsyncClient", *, interval_s: float,
                  health_timeout_s: float) -> None:
        """Refresh every `interval_s` seconds until cancelled; new replicas are health-checked
        at once, so they take traffic without waiting for the next round of checks."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                added = await self.refresh()
                await asyncio.gather(*(self.registry.check(client, r, health_timeout_s)
                                       for r in added))
            except Exception:  # a bug here must not stop discovery for good
                logger.exception("discovery round failed")
