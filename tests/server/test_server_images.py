"""OpenAI image parts on a tiny random Idefics3 (AsyncLLM in-process, httpx ASGI transport):
data URLs and http(s) URLs (a local HTTP server), the encoder cache seen through /metrics, and
every bad image as a 400 that names its part."""

import asyncio
import base64
import http.server
import threading
import time

import httpx
import pytest

from deepinfer.engine.config import EngineConfig, MultiModalConfig
from deepinfer.server.app import build_app
from deepinfer.server.errors import APIError
from deepinfer.server.media import load_images
from deepinfer.server.prompts import chat_prompt_ids
from deepinfer.server.protocol import ChatMessage
from tests.tiny_models import png_bytes, save_tiny_idefics3

PNG = png_bytes(90, 60, seed=11)
SMALL = png_bytes(8, 8, seed=12)


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


def image_message(*urls: str, text: str = "What is this?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(1.0)
        if self.path in ("/redirect", "/loop"):   # one hop to the image; a redirect cycle
            self.send_response(302)
            self.send_header("Location", "/a.png" if self.path == "/redirect" else "/loop")
            self.end_headers()
            return
        body, kind = {"/text": (b"hello", "text/plain")}.get(self.path, (PNG, "image/png"))
        if self.path == "/missing.png":
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass   # the client that timed out closed its connection: expected here


@pytest.fixture(scope="module")
def media_server():
    server = _QuietServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, smollm2_tokenizer):
    from deepinfer.engine.async_llm import AsyncLLM

    model_dir = save_tiny_idefics3(tmp_path_factory.mktemp("vlm"), smollm2_tokenizer)
    config = EngineConfig().replace(model={"model": str(model_dir), "device": "cpu",
                                           "dtype": "float32"},
                                    cache={"num_blocks": 128},
                                    scheduler={"max_num_batched_tokens": 32})
    llm = AsyncLLM(config)
    yield llm
    llm.shutdown()


LOCAL = MultiModalConfig(allow_private_media_hosts=True)   # the test server is on 127.0.0.1


def call(engine, *bodies, media=LOCAL, path="/v1/chat/completions"):
    async def run():
        app = build_app(engine, media=media)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=60) as client:
            out = [await client.post(path, json=b) for b in bodies]
            return out, (await client.get("/metrics")).text

    return asyncio.run(run())


def metric(text: str, name: str) -> float:
    line = next(l for l in text.splitlines() if l.startswith(name + "{") or
                l.startswith(name + "_total{"))
    return float(line.rsplit(" ", 1)[1])


def test_data_url_and_http_url_images_answer_and_same_image_is_encoded_once(engine,
                                                                             media_server):
    body = {"messages": image_message(data_url(PNG)), "max_tokens": 4, "temperature": 0}
    by_url = {"messages": image_message(f"{media_server}/a.png"), "max_tokens": 4,
              "temperature": 0}
    (first, second, third), metrics = call(engine, body, body, by_url)
    assert [r.status_code for r in (first, second, third)] == [200, 200, 200]
    texts = [r.json()["choices"][0]["message"]["content"] for r in (first, second, third)]
    assert texts[0] == texts[1] == texts[2]   # the same picture, inline or downloaded
    assert first.json()["usage"]["prompt_tokens"] > 20   # image tokens were expanded
    assert metric(metrics, "deepinfer:mm_encoder_images_encoded") == 1
    assert metric(metrics, "deepinfer:mm_encoder_cache_hits") >= 2
    stream = dict(body, stream=True)
    (streamed,), _ = call(engine, stream)
    pieces = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    import json
    joined = "".join(json.loads(p[6:])["choices"][0]["delta"].get("content") or ""
                     for p in pieces if json.loads(p[6:])["choices"])
    assert joined == texts[0]


def test_two_images_in_one_message(engine):
    body = {"messages": image_message(data_url(PNG), data_url(png_bytes(30, 50, seed=4))),
            "max_tokens": 3}
    (response,), _ = call(engine, body)
    assert response.status_code == 200, response.text


BAD = {
    "not an image": (lambda s: data_url(b"plain text, not a picture"), "not an image"),
    "truncated": (lambda s: data_url(PNG[:len(PNG) // 2]), "truncated"),
    "not base64": (lambda s: "data:image/png;base64,@@@", "base64"),
    "too large": (lambda s: data_url(PNG), "larger than"),
    "http 404": (lambda s: f"{s}/missing.png", "HTTP 404"),
    "wrong content type": (lambda s: f"{s}/text", "content-type"),
    "timeout": (lambda s: f"{s}/slow.png", "longer than"),
    "unreachable": (lambda s: "http://127.0.0.1:9/x.png", "failed"),
    "remote off": (lambda s: f"{s}/a.png", "does not fetch remote images"),
    "domain not allowed": (lambda s: f"{s}/a.png", "not allowed"),
    "redirect cycle": (lambda s: f"{s}/loop", "redirected more than 5"),
    # SSRF (the default config): IP literals and names resolving to non-public addresses
    "loopback server": (lambda s: f"{s}/a.png", "127.0.0.1, a loopback address"),
    "localhost name": (lambda s: s.replace("127.0.0.1", "localhost") + "/a.png",
                       "localhost resolves to"),
    "private IP": (lambda s: "http://10.1.2.3/a.png", "10.1.2.3, a private address, is refused"),
    "metadata IP": (lambda s: "http://169.254.169.254/latest", "a link-local address"),
    "IPv6 loopback": (lambda s: "http://[::1]:9/a.png", "a loopback address"),
    "mapped IPv6": (lambda s: "http://[::ffff:10.0.0.1]/a.png", "a private address"),
    "multicast": (lambda s: "http://224.0.0.251/a.png", "a multicast address"),
    "reserved": (lambda s: "http://240.0.0.1/a.png", "a reserved address"),
}
MEDIA = {"too large": MultiModalConfig(max_image_bytes=len(PNG) // 2,
                                       allow_private_media_hosts=True),
         "timeout": MultiModalConfig(media_fetch_timeout_s=0.3, allow_private_media_hosts=True),
         "remote off": MultiModalConfig(allow_remote_media=False),
         "domain not allowed": MultiModalConfig(allowed_media_domains="example.com")}
SSRF = ("loopback server", "localhost name", "private IP", "metadata IP", "IPv6 loopback",
        "mapped IPv6", "multicast", "reserved")


def test_bad_images_are_400s_naming_the_part(engine, media_server):
    for case, (url, words) in BAD.items():
        body = {"messages": image_message(data_url(SMALL), url(media_server)),
                "max_tokens": 2}
        default = MultiModalConfig() if case in SSRF else LOCAL
        (response,), _ = call(engine, body, media=MEDIA.get(case, default))
        error = response.json()["error"]
        assert response.status_code == 400, (case, response.text)
        assert error["param"] == "messages[0].content[1]", (case, error)
        assert words in error["message"], (case, error)
        if case in SSRF:
            assert "--allow-private-media-hosts" in error["message"], error
    too_many = {"messages": image_message(*[data_url(PNG)] * 3), "max_tokens": 2}
    (response,), _ = call(engine, too_many, media=MultiModalConfig(max_images_per_request=2))
    assert response.status_code == 400 and "more than the 2" in response.json()["error"]["message"]
    typed = {"messages": [{"role": "user", "content": "look <image> here"}], "max_tokens": 2}
    (response,), _ = call(engine, typed)
    assert response.status_code == 400 and "<image>" in response.json()["error"]["message"]


def test_text_only_model_refuses_image_parts(smollm2_tokenizer):
    message = ChatMessage(**image_message(data_url(PNG))[0])
    with pytest.raises(APIError, match="accepts text only") as caught:
        chat_prompt_ids(smollm2_tokenizer, [message], 512)
    assert caught.value.param == "messages[0].content[0]"


def fetch(url: str, media: MultiModalConfig, client: httpx.AsyncClient | None = None) -> bytes:
    messages = [ChatMessage(**image_message(url)[0])]
    return asyncio.run(load_images(messages, media, client))[0][1]


def test_redirects_are_followed_and_every_hop_is_checked(media_server):
    # allowed: a private host when the operator turns the option on, through a redirect and by
    # name (localhost may resolve to ::1 first: the next checked address is tried)
    assert fetch(f"{media_server}/redirect", LOCAL) == PNG
    assert fetch(media_server.replace("127.0.0.1", "localhost") + "/a.png", LOCAL) == PNG
    # a public first hop (an IP literal, no DNS here) that redirects to the private server:
    # the second hop is refused before any connection is made to it
    seen = []

    def internet(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers["host"]))
        if request.url.host == "93.184.215.14":
            return httpx.Response(302, headers={"Location": f"{media_server}/a.png"})
        return httpx.Response(200, headers={"Content-Type": "image/png"}, content=PNG)

    async def run(media):
        async with httpx.AsyncClient(transport=httpx.MockTransport(internet)) as client:
            messages = [ChatMessage(**image_message("http://93.184.215.14/cat.png")[0])]
            return await load_images(messages, media, client)

    with pytest.raises(APIError, match="127.0.0.1, a loopback address") as caught:
        asyncio.run(run(MultiModalConfig()))
    assert caught.value.param == "messages[0].content[0]"
    assert seen == [("http://93.184.215.14/cat.png", "93.184.215.14")]
    # the same chain with private hosts allowed: followed, the connection pinned to the address
    seen.clear()
    assert asyncio.run(run(LOCAL))[0][1] == PNG
    host = media_server.removeprefix("http://")
    assert seen[1] == (f"{media_server}/a.png", host)
