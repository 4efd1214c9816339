"""`RouterConfig`: the router's settings in one frozen dataclass, range-checked on creation."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from deepinfer.router.discovery import Service

POLICY_NAMES = ("round_robin", "least_outstanding", "prefix_affinity")
DISCOVERY_MODES = ("static", "dns")


@dataclass(frozen=True)
class RouterConfig:
    """What `deepinfer router` was asked to do.

    Either `backends` (data-parallel replicas that each serve whole requests) or both `prefill`
    and `decode` (disaggregated: a prefill worker computes the prompt's KV blocks into the
    shared store, a decode worker loads them and generates) must be given, as base URLs such
    as `http://10.0.0.5:8000`.

    `discovery` says what a URL is: `static`, one worker; `dns`, a pool of workers behind one
    name (a Kubernetes headless Service) whose host is re-resolved every
    `discovery_interval_s` seconds, each A/AAAA address one replica (`router.discovery`).
    """

    backends: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    # vision-encoder workers (`--role encoder`): a request with image parts is first sent to
    # one (round robin) to put its image embeddings into the shared store; any failure there
    # only means the prefill / both worker encodes itself
    encoders: tuple[str, ...] = ()
    encoder_timeout_s: float = 30.0
    policy: str = "least_outstanding"
    # prefix_affinity's load guard: leave the preferred replica when it has more than this many
    # outstanding requests above the least-loaded one.
    max_imbalance: int = 4
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    # consecutive failed health checks before a replica is ejected (a refused connection
    # ejects at once)
    max_failures: int = 3
    # client requests in flight at the router before new ones get HTTP 429
    max_concurrent_requests: int = 512
    connect_timeout_s: float = 5.0
    # longest wait for a worker's next byte (a long non-streamed generation included)
    request_timeout_s: float = 600.0
    # a relayed stream with no byte from its worker for this long is ended with an error event
    stream_stall_timeout_s: float = 60.0
    # replicas tried per request when connections fail before the first byte
    max_attempts: int = 3
    discovery: str = "static"
    # seconds between DNS resolutions of each pool (discovery="dns")
    discovery_interval_s: float = 5.0

    def __post_init__(self) -> None:
        if self.backends and (self.prefill or self.decode):
            raise ValueError("give either --backend URLs or --prefill and --decode URLs, not "
                             "both; disaggregated mode routes every request through a prefill "
                             "and a decode worker")
        if not self.backends and not (self.prefill and self.decode):
            raise ValueError("no workers: give one or more --backend URLs, or at least one "
                             "--prefill and one --decode URL")
        for url in (*self.backends, *self.prefill, *self.decode):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"worker URL {url!r} must start with http:// or https://")
            parts = urlsplit(url)
            if not parts.hostname:
                raise ValueError(f"worker URL {url!r} has no host; give the worker's address, "
                                 "e.g. http://10.0.0.5:8000")
            try:
                port_ok = parts.port != 0   # raises ValueError on a non-number or > 65535
            except ValueError:
                port_ok = False
            if not port_ok:
                raise ValueError(f"worker URL {url!r} has an invalid port; write it as "
                                 "http://host:8000 (a port from 1 to 65535)")
            path = parts.path.rstrip("/")
            if path.lower().endswith("/v1"):
                base = f"{parts.scheme}://{parts.netloc}{path[:-3]}"
                raise ValueError(f"worker URL {url!r} ends in /v1; give the worker's base URL "
                                 f"({base}): the router adds /v1/... and /health itself")
        for flag, urls in (("--backend", self.backends), ("--prefill", self.prefill),
                           ("--decode", self.decode)):
            seen = [url.rstrip("/") for url in urls]
            duplicate = next((url for i, url in enumerate(seen) if url in seen[:i]), None)
            if duplicate is not None:
                raise ValueError(f"{flag} {duplicate} is given twice; list each worker once")
        if self.discovery not in DISCOVERY_MODES:
            raise ValueError(f"discovery={self.discovery!r} is unknown; use static (each URL "
                             "is one worker) or dns (each URL names a pool, resolved to all "
                             "its addresses)")
        if self.discovery == "dns":
            for url in (*self.backends, *self.prefill, *self.decode):
                Service.from_url(url, "both")  # raises ValueError with the fix
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy={self.policy!r} is unknown; use one of "
                             f"{', '.join(POLICY_NAMES)}")
        for name in ("max_failures", "max_concurrent_requests", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance={self.max_imbalance} must be >= 0")
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s",
                     "request_timeout_s", "discovery_interval_s", "stream_stall_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds")

    @property
    def disaggregated(self) -> bool:
        return bool(self.prefill)
