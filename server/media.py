"""OpenAI image content parts -> image bytes: data URLs and http(s) downloads.

`{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}` or an `http(s)://`
URL, fetched with httpx under the `MultiModalConfig` limits (as vLLM's media options: a size cap,
a timeout, an image content-type, remote fetching that can be turned off, an allow-list of
domains), refused by default for hosts that resolve to non-public addresses (SSRF). Anything
wrong is a 400 naming the part (`messages.i.content.j`), never a 500 or a hang.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import re
import socket
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from deepinfer.engine.config import MultiModalConfig
from deepinfer.server.errors import APIError
from deepinfer.server.protocol import ChatMessage

IMAGE_PART_TYPES = ("image_url", "input_image")
MAX_REDIRECTS = 5   # redirect hops followed per image URL (each one checked like the first)
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^,;]*)*),(?P<data>.*)",
                       re.DOTALL)


def _bad(where: str, message: str, code: str = "invalid_image") -> APIError:
    return APIError(f"{where}: {message}", param=where, code=code)


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(where, url) of every image part, in prompt order."""
    found = []
    for i, message in enumerate(messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            if part.type not in IMAGE_PART_TYPES:
                continue
            where = f"messages[{i}].content[{j}]"
            value = (part.model_extra or {}).get(part.type)
            url = value.get("url") if isinstance(value, dict) else value
            if not isinstance(url, str) or not url:
                raise _bad(where, f"an '{part.type}' part needs {{\"{part.type}\": {{\"url\": "
                                  "\"data:image/png;base64,...\" or \"https://...\"}}.")
            found.append((where, url))
    return found


def decode_data_url(where: str, url: str, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:image/...` URL (size-capped before decoding)."""
    match = _DATA_URL.fullmatch(url)
    if match is None or ";base64" not in (match["params"] or ""):
        raise _bad(where, "the data URL is malformed; send data:image/png;base64,<base64>.")
    if match["type"] and not match["type"].startswith("image/"):
        raise _bad(where, f"the data URL's type {match['type']!r} is not an image type.")
    data = match["data"]
    if len(data) * 3 // 4 > max_bytes:
        raise _bad(where, f"the image is larger than {max_bytes} bytes; send a smaller one.",
                   "image_too_large")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _bad(where, "the data URL's payload is not valid base64.") from None


def _allowed(host: str, domains: tuple[str, ...]) -> bool:
    host = host.lower().rstrip(".")
    return not domains or any(host == d or host.endswith("." + d) for d in domains)


def _refusal(ip: IPAddress) -> str | None:
    """Why a fetch must not reach `ip` (SSRF), or None for a public address."""
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "link_local", "multicast", "reserved", "unspecified", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-public"


async def _resolve(where: str, url: httpx.URL, config: MultiModalConfig) -> list[IPAddress]:
    """The addresses `url`'s host resolves to; refused (400) if any is not public, unless
    `allow_private_media_hosts`."""
    host = url.raw_host.decode("ascii")
    try:
        ips = [ipaddress.ip_address(host)]
    except ValueError:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, None,
                                                                 type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise _bad(where, f"the image host {host} could not be resolved ({exc}).",
                       "image_fetch_failed") from None
        ips = list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0])
                                 for info in infos))
    if not config.allow_private_media_hosts:
        for ip in ips:
            if (kind := _refusal(ip)) is not None:
                what = f"{host} resolves to {ip}" if host != str(ip) else host
                raise _bad(where, f"the image host {what}, a {kind} address, is refused; "
                                  "this server fetches images only from public addresses "
                                  "(an operator can allow private ones with "
                                  "--allow-private-media-hosts).", "image_host_not_public")
    return ips


async def _get_pinned(client: httpx.AsyncClient, url: httpx.URL, ips: list[IPAddress],
                      timeout: float) -> httpx.Response:
    """GET `url` from the addresses already checked (not a second DNS lookup that could answer
    differently: DNS rebinding); Host header and TLS SNI/certificate name stay `url`'s host."""
    error: Exception | None = None
    for ip in ips:
        request = client.build_request(
            "GET", url.copy_with(host=str(ip)), headers={"Host": url.netloc.decode("ascii")},
            extensions={"sni_hostname": url.raw_host.decode("ascii")}, timeout=timeout)
        try:
            return await client.send(request, stream=True, follow_redirects=False)
        except httpx.ConnectError as exc:
            error = exc   # another address of the same host may answer
    assert error is not None
    raise error


async def _read_image(where: str, url: str, response: httpx.Response,
                      config: MultiModalConfig) -> bytes:
    if response.status_code != 200:
        raise _bad(where, f"fetching {url} answered HTTP {response.status_code}.",
                   "image_fetch_failed")
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if not kind.startswith("image/"):
        raise _bad(where, f"{url} has content-type {kind or 'none'!r}, not image/*.")
    length = response.headers.get("content-length")
    if length and length.isdigit() and int(length) > config.max_image_bytes:
        raise _bad(where, f"{url} is {length} bytes, more than {config.max_image_bytes}.",
                   "image_too_large")
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > config.max_image_bytes:
            raise _bad(where, f"{url} is larger than {config.max_image_bytes} bytes.",
                       "image_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _check_url(where: str, url: str, config: MultiModalConfig) -> httpx.URL:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _bad(where, "the image URL must be a data: URL or an http(s):// URL.")
    if not _allowed(parts.hostname, config.domains):
        raise _bad(where, f"images from {parts.hostname} are not allowed; allowed domains: "
                          f"{', '.join(config.domains)}.", "domain_not_allowed")
    try:
        return httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise _bad(where, f"the image URL is invalid ({exc}).") from None


async def _fetch(where: str, url: str, config: MultiModalConfig,
                 client: httpx.AsyncClient) -> bytes:
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        target = _check_url(where, current, config)
        ips = await _resolve(where, target, config)
        response = await _get_pinned(client, target, ips, config.media_fetch_timeout_s)
        try:
            if not (response.is_redirect and response.headers.get("location")):
                return await _read_image(where, current, response, config)
            current = urljoin(current, response.headers["location"])
        finally:
            await response.aclose()
    raise _bad(where, f"fetching {url} redirected more than {MAX_REDIRECTS} times.",
               "image_fetch_failed")


async def fetch_url(where: str, url: str, config: MultiModalConfig,
                    client: httpx.AsyncClient) -> bytes:
    """Download an http(s) image under the config's limits.

    SSRF protection (as vLLM/SGLang deployments expect): every hop's host, the first URL and
    each redirect's `Location` (at most MAX_REDIRECTS), must be on the domain allow-list and
    resolve only to public addresses (not loopback, private, link-local, multicast, reserved,
    ...; see `ipaddress`) unless `allow_private_media_hosts`; the connection goes to the
    checked address. The whole fetch, DNS and redirects included, has
    `media_fetch_timeout_s`.
    """
    if not config.allow_remote_media:
        raise _bad(where, "this server does not fetch remote images (--no-allow-remote-media);"
                          " send the image inline as a data:image/...;base64 URL.",
                   "remote_media_disabled")
    try:
        async with asyncio.timeout(config.media_fetch_timeout_s):
            return await _fetch(where, url, config, client)
    except (httpx.TimeoutException, TimeoutError):
        raise _bad(where, f"fetching {url} took longer than {config.media_fetch_timeout_s} s.",
                   "image_fetch_timeout") from None
    except httpx.HTTPError as exc:
        raise _bad(where, f"fetching {url} failed ({type(exc).__name__}: {exc}).",
                   "image_fetch_failed") from None


async def load_images(messages: list[ChatMessage], config: MultiModalConfig,
                      client: httpx.AsyncClient | None = None) -> list[tuple[str, bytes]]:
    """(where, bytes) of every image part, in prompt order.

    Raises:
        APIError: too many images, a malformed or refused URL, a failed download (400).
    """
    parts = image_parts(messages)
    if len(parts) > config.max_images_per_request:
        raise APIError(f"the request has {len(parts)} images, more than the "
                       f"{config.max_images_per_request} allowed; send fewer.",
                       param="messages", code="too_many_images")
    images = []
    own = client is None and any(not url.startswith("data:") for _, url in parts)
    client = httpx.AsyncClient() if own else client
    try:
        for where, url in parts:
            if url.startswith("data:"):
                images.append((where, decode_data_url(where, url, config.max_image_bytes)))
            else:
                images.append((where, await fetch_url(where, url, config, client)))
    finally:
        if own:
            await client.aclose()
    return images


def process_images(processor: Any, images: list[tuple[str, bytes]]) -> list[Any]:
    """Run the model's HF processor on each image (`MultiModalProcessor.process_image`);
    an undecodable image is a 400 naming its part."""
    from deepinfer.engine.mm_processor import ImageError

    out = []
    for where, data in images:
        try:
            out.append(processor.process_image(data, where))
        except ImageError as exc:
            raise _bad(where, str(exc).removeprefix(f"{where} ").strip()) from None
    return out
