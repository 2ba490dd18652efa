"""Image and video content parts on the wire (issue 37): decoding, limits, bombs, URL fetches, and each
dialect's 400 naming the part, in its own envelope, on a server whose model has no vision encoder."""
from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image
from support.servers import FakeEngine, anthropic_for, app_in_thread, fake_tokenizer, openai_for, wait_for

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import GenerationRequest, ImageInput
from imp_jax.server.app import create_app
from imp_jax.server.config import ServerConfig
from imp_jax.server.image_parts import ImageRef, check_counts, video_frames
from imp_jax.server.images import ImageLimits, ImageSource, decode, image_bytes

LIMITS = ImageLimits()


def encoded(fmt: str, size: tuple[int, int] = (8, 6), color: tuple[int, int, int] = (200, 30, 60), **kw: Any) -> bytes:
    """A tiny image made here: a colour with one odd pixel."""
    im = Image.new("RGB", size, color)
    im.putpixel((1, 1), (0, 255, 0))
    buf = io.BytesIO()
    im.save(buf, fmt, **kw)
    return buf.getvalue()


def gif_two_frames() -> bytes:
    """A 2-frame GIF: red, then blue."""
    frames = [Image.new("RGB", (4, 4), c).convert("P") for c in ((255, 0, 0), (0, 0, 255))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG with a valid IHDR claiming width x height and a few bytes of pixel data: a decompression bomb's header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def refused(fn: Any, *args: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        fn(*args)
    return info.value


# --------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_decodes_each_format_to_rgb_pixels(fmt: str) -> None:
    img = decode(encoded(fmt), "p", LIMITS)
    assert img.pixels.dtype == np.uint8 and img.pixels.shape == (6, 8, 3) and img.size == (8, 6)
    assert img.format == fmt and img.encoded_bytes == len(encoded(fmt)) and len(img.digest) == 16


def test_gif_gives_its_first_frame() -> None:
    img = decode(gif_two_frames(), "p", LIMITS)
    assert img.format == "GIF" and img.pixels.shape == (4, 4, 3)
    assert tuple(img.pixels[0, 0]) == (255, 0, 0)


def test_transparency_is_composited_over_white_as_the_processors_do() -> None:
    rgba = Image.new("RGBA", (4, 2), (10, 20, 30, 0))   # invisible dark pixels
    rgba.putpixel((0, 0), (200, 0, 0, 255))
    rgba.putpixel((1, 0), (0, 0, 200, 128))
    buf = io.BytesIO()
    rgba.save(buf, "PNG")
    px = decode(buf.getvalue(), "p", LIMITS).pixels
    assert tuple(px[1, 3]) == (255, 255, 255) and tuple(px[0, 0]) == (200, 0, 0)
    assert tuple(px[0, 1]) == (127, 127, 227)   # half blue over white
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 9, 9, 9])
    pal.putpixel((1, 0), 1)
    buf = io.BytesIO()
    pal.save(buf, "GIF", transparency=0)   # palette index 0 transparent
    assert decode(buf.getvalue(), "p", LIMITS).pixels.tolist() == [[[255, 255, 255], [9, 9, 9]]]


def test_digest_keys_pixels_not_encoding() -> None:
    png, webp = decode(encoded("PNG"), "p", LIMITS), decode(encoded("WEBP", lossless=True), "p", LIMITS)
    assert np.array_equal(png.pixels, webp.pixels) and png.digest == webp.digest
    other = decode(encoded("PNG", color=(1, 2, 3)), "p", LIMITS)
    assert other.digest != png.digest
    transposed = decode(encoded("PNG", size=(6, 8)), "p", LIMITS)   # same bytes count, other shape
    assert transposed.digest != png.digest


def test_bomb_is_refused_from_its_header_without_decoding() -> None:
    for w, h in ((100_000, 100_000), (6000, 6000)):   # past Pillow's own bomb check; past ours only
        start = time.monotonic()
        err = refused(decode, png_header(w, h), "messages[0].content[0].image_url.url", LIMITS)
        assert err.code == "image_too_large" and err.param == "messages[0].content[0].image_url.url"
        assert time.monotonic() - start < 0.5
    assert "6000x6000" in refused(decode, png_header(6000, 6000), "p", LIMITS).message


@pytest.mark.parametrize("raw", [b"not an image at all", encoded("PNG")[:40], b"GIF89a" + b"\0" * 20,
                                 encoded("BMP")], ids=["text", "truncated_png", "bad_gif", "bmp"])
def test_corrupt_or_unsupported_bytes_are_a_400(raw: bytes) -> None:
    err = refused(decode, raw, "p", LIMITS)
    assert err.status == 400 and err.code == "invalid_image" and err.param == "p"


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@notbase64", "not valid base64"),
    (data_url(b"hello", "text/plain"), "is not an image"),
    (data_url(b"x", "image/tiff"), "not a supported image type"),
    ("data:image/png,rawbytes", "must be base64"),
    ("data:image/png;base64", "not a well-formed data: URL"),
    ("file:///etc/passwd", "data: URL"),
    ("ftp://example.com/a.png", "data: URL"),
    ("http://127.0.0.1:1/a.png", "--allow-image-urls"),
])
def test_bad_sources_are_a_400_naming_the_field(url: str, words: str) -> None:
    err = refused(image_bytes, ImageSource("messages[0].content[1].image_url.url", url=url), LIMITS)
    assert err.status == 400 and err.param == "messages[0].content[1].image_url.url" and words in err.message


def test_byte_limit_is_checked_before_base64_decoding() -> None:
    small = ImageLimits(max_bytes=100)
    err = refused(image_bytes, ImageSource("p", url="data:image/png;base64," + "A" * 10_000), small)
    assert err.code == "image_too_large" and "--max-image-bytes" in err.message
    assert image_bytes(ImageSource("p", url=data_url(b"x" * 100)), small) == b"x" * 100


def test_counts_are_checked_before_any_decoding() -> None:
    refs = [ImageRef(f"messages[0].content[{j}]", ImageSource("u", url="data:,")) for j in range(3)]
    err = refused(check_counts, refs, ImageLimits(max_images=2))
    assert err.param == "messages[0].content[2]" and "--max-images-per-request" in err.message
    frames = video_frames(["data:,"] * 3, "messages[1].content[0]")
    err = refused(check_counts, frames, ImageLimits(max_video_frames=2))
    assert err.param == "messages[1].content[0].video" and "--max-video-frames" in err.message


# --------------------------------------------------------------------------- URL fetches on loopback
class _Images(http.server.BaseHTTPRequestHandler):
    ROUTES: dict[str, tuple[int, str, bytes]] = {
        "/a.png": (200, "image/png", encoded("PNG")), "/a.txt": (200, "text/plain", b"hello"),
        "/big.png": (200, "image/png", b"\x89PNG" + b"\0" * 5000), "/gone.png": (404, "text/plain", b"no"),
    }

    def do_GET(self) -> None:
        if self.path == "/drip":   # a byte every 0.2 s: each read is quick, the whole is slow
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(20):
                    self.wfile.write(b"\0")
                    self.wfile.flush()
                    time.sleep(0.2)
            except OSError:   # the client gave up, as it should
                pass
            return
        if self.path == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
            return
        status, kind, body = self.ROUTES.get(self.path, (404, "text/plain", b""))
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_url_fetch_when_allowed(image_host: str) -> None:
    allowed = ImageLimits(allow_urls=True, max_bytes=1000, fetch_timeout_s=5)
    raw = image_bytes(ImageSource("p", url=image_host + "/a.png"), allowed)
    assert decode(raw, "p", allowed).size == (8, 6)
    for path, code, words in (("/a.txt", "invalid_image", "is not an image"), ("/gone.png", "image_fetch_failed",
                              "HTTP 404"), ("/big.png", "image_too_large", "--max-image-bytes"),
                              ("/to-file", "image_fetch_failed", "could not be fetched")):
        err = refused(image_bytes, ImageSource("p", url=image_host + path), allowed)
        assert (err.code, err.param) == (code, "p") and words in err.message, (path, err.message)
    start = time.monotonic()
    err = refused(image_bytes, ImageSource("p", url=image_host + "/drip"), ImageLimits(allow_urls=True,
                                                                                      fetch_timeout_s=0.5))
    assert err.code == "image_fetch_failed" and time.monotonic() - start < 2


# --------------------------------------------------------------------------- the dialects, on a live app
PNG_URL = data_url(encoded("PNG"))


class VisionEngine(FakeEngine):
    """FakeEngine with vision, recording what reaches it. Why a fake: these tests check where the server puts
    each image's text and the order of GenerationRequest.images on every dialect; the layout of an image's
    text is the engine's (tests/test_vision_engine.py serves a real one)."""

    vision = True

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.seen: list[GenerationRequest] = []

    def image_prompt(self, image: ImageInput) -> str:
        return f"[image {image.size[0]}x{image.size[1]}]"

    def generate(self, req: GenerationRequest, limits: Any = None, on_stall: Any = None) -> Any:
        self.seen.append(req)
        return super().generate(req, limits, on_stall)


@pytest.fixture(scope="module")
def servers(image_host: str) -> Iterator[dict[str, str]]:
    """Three in-process apps over FakeEngine: default flags; small limits with URL fetches on; a vision model."""
    tuned = ServerConfig(max_images_per_request=3, max_video_frames=2, max_image_bytes=4096, allow_image_urls=True)
    engines = [FakeEngine(fake_tokenizer()), FakeEngine(fake_tokenizer()), VisionEngine(fake_tokenizer())]
    for e in engines:
        e.start()
    with app_in_thread(create_app(engines[0], ServerConfig())) as plain, \
            app_in_thread(create_app(engines[1], tuned)) as small, \
            app_in_thread(create_app(engines[2], ServerConfig())) as vision:
        for url in (plain, small, vision):
            wait_for(url + "/ready", 200, timeout=30)
        yield {"plain": plain, "small": small, "vision": vision, "host": image_host, "vision_engine": engines[2]}


def chat(*parts: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/chat/completions", {"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "text", "text": "see"},
                                                                               *parts]}], "max_tokens": 2}


def messages(*blocks: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/messages", {"model": "fake-model", "max_tokens": 2,
                            "messages": [{"role": "user", "content": [{"type": "text", "text": "see"}, *blocks]}]}


def responses(*parts: Any) -> tuple[str, dict[str, Any]]:
    return "/v1/responses", {"model": "fake-model", "input": [{"role": "user", "content": [{"type": "input_text", "text": "see"}, *parts]}],
                             "max_output_tokens": 2}


def image_url(url: str, **kw: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **kw}}


def anthropic_b64(raw: bytes, media: str = "image/png") -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": media, "data": base64.b64encode(raw).decode()}}


def error_of(url: str, path: str, body: dict[str, Any]) -> tuple[str | None, str | None, str]:
    """(param, code, message) of a 400 in the route's envelope (Anthropic's has no param: read it from the message)."""
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    data = r.json()
    if path.startswith("/v1/messages"):
        assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error", data
        return None, None, data["error"]["message"]
    err = data["error"]
    assert err["type"] == "invalid_request_error", data
    return err["param"], err["code"], err["message"]


NO_VISION = [
    (chat(image_url(PNG_URL)), "messages[0].content[1]"),
    (chat(image_url(PNG_URL, detail="low")), "messages[0].content[1]"),
    (chat({"type": "image_url", "image_url": PNG_URL}), "messages[0].content[1]"),
    (chat({"type": "video", "video": [PNG_URL, data_url(encoded("JPEG"), "image/jpeg")]}), "messages[0].content[1]"),
    (messages(anthropic_b64(encoded("PNG"))), "messages[0].content[1]"),
    (messages(anthropic_b64(encoded("WEBP"), "image/webp")), "messages[0].content[1]"),
    (messages({"type": "tool_result", "tool_use_id": "t1", "content": [anthropic_b64(gif_two_frames(), "image/gif")]}),
     "messages[0].content[1].content[0]"),
    (responses({"type": "input_image", "image_url": PNG_URL, "detail": "high"}), "input[0].content[1]"),
]


@pytest.mark.parametrize("case, part", NO_VISION, ids=range(len(NO_VISION)))
def test_images_on_a_model_without_vision_name_the_part(servers: dict[str, str], case: Any, part: str) -> None:
    path, body = case
    param, code, message = error_of(servers["plain"], path, body)
    assert f"'{part}'" in message and "no vision encoder" in message and "fake-model" in message
    if param is not None:
        assert (param, code) == (part, "model_not_multimodal")


def test_anthropic_tool_result_image_names_its_own_path(servers: dict[str, str]) -> None:
    path, body = messages({"type": "tool_result", "tool_use_id": "t1",
                           "content": [{"type": "text", "text": "x"}, anthropic_b64(b"junk")]})
    _, _, message = error_of(servers["plain"], path, body)
    assert "'messages[0].content[1].content[1].source.data'" in message and "PNG, JPEG" in message


def test_count_tokens_takes_images_like_messages(servers: dict[str, str]) -> None:
    _, body = messages(anthropic_b64(encoded("PNG")))
    _, _, message = error_of(servers["plain"], "/v1/messages/count_tokens", body)
    assert "no vision encoder" in message


def sent(servers: dict[str, str], path: str, body: dict[str, Any]) -> tuple[str, list[tuple[int, int]]]:
    """What a request made the vision engine see: its prompt as text and its images' sizes, in order."""
    engine = servers["vision_engine"]
    engine.seen.clear()
    r = httpx.post(servers["vision"] + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    (req,) = engine.seen
    return engine.tokenizer.decode(req.prompt_ids, skip_special_tokens=False), [im.size for im in req.images]


def test_chat_images_and_video_frames_reach_the_engine_in_prompt_order(servers: dict[str, str]) -> None:
    small, wide = data_url(encoded("PNG", (3, 2))), data_url(encoded("JPEG", (9, 4)))
    path, body = chat(image_url(small), {"type": "text", "text": " and "}, {"type": "video", "video": [wide, small]})
    prompt, sizes = sent(servers, path, body)
    assert "see[image 3x2] and [image 9x4][image 3x2]" in prompt and sizes == [(3, 2), (9, 4), (3, 2)]


def test_anthropic_images_follow_the_template_order_not_the_body_order(servers: dict[str, str]) -> None:
    # a tool_result renders as a tool message before its turn's text, so its image comes first in the prompt
    first = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]}
    path, body = messages(anthropic_b64(encoded("PNG", (5, 5))),
                          {"type": "tool_result", "tool_use_id": "t1",
                           "content": [{"type": "text", "text": "shot"}, anthropic_b64(encoded("PNG", (7, 3)))]})
    body["messages"] = [{"role": "user", "content": "go"}, first, *body["messages"]]
    prompt, sizes = sent(servers, path, body)
    assert sizes == [(7, 3), (5, 5)] and prompt.index("[image 7x3]") < prompt.index("see") < prompt.index("[image 5x5]")
    r = httpx.post(servers["vision"] + "/v1/messages/count_tokens", json=body, timeout=30)
    assert r.json()["input_tokens"] == len(servers["vision_engine"].tokenizer.encode_chat(prompt))


def test_responses_keep_an_earlier_turns_image_for_previous_response_id(servers: dict[str, str]) -> None:
    path, body = responses({"type": "input_image", "image_url": data_url(encoded("PNG", (4, 4)))})
    prompt, sizes = sent(servers, path, body)
    assert "see\n[image 4x4]" in prompt and sizes == [(4, 4)]
    rid = httpx.post(servers["vision"] + path, json=body, timeout=30).json()["id"]
    follow = {"model": "fake-model", "previous_response_id": rid, "input": "and now?", "max_output_tokens": 2}
    prompt, sizes = sent(servers, path, follow)
    assert sizes == [(4, 4)] and prompt.index("[image 4x4]") < prompt.index("and now?")


def test_cfg_scale_takes_no_images(servers: dict[str, str]) -> None:
    path, body = chat(image_url(PNG_URL))
    body = {**body, "cfg_scale": 2.0, "messages": [{"role": "system", "content": "be brief"}, *body["messages"]]}
    param, _, message = error_of(servers["vision"], path, body)
    assert param == "cfg_scale" and "image" in message


BAD = [   # (case, the field named, code)
    (chat(image_url("data:image/png;base64,!!!")), "messages[0].content[1].image_url.url", "invalid_image"),
    (chat(image_url(data_url(b"hi", "text/plain"))), "messages[0].content[1].image_url.url", "invalid_image"),
    (chat(image_url(data_url(png_header(100_000, 100_000)))), "messages[0].content[1].image_url.url",
     "image_too_large"),
    (chat(image_url(PNG_URL, detail="ultra")), "messages[0].content[1].image_url.detail", "invalid_image"),
    (chat({"type": "image_url", "image_url": {"detail": "low"}}), "messages[0].content[1].image_url",
     "invalid_image"),
    (chat({"type": "video", "video": []}), "messages[0].content[1].video", "invalid_image"),
    (chat({"type": "video", "video": [PNG_URL, 3]}), "messages[0].content[1].video[1]", "invalid_image"),
    (chat(image_url("http://127.0.0.1:9/x.png")), "messages[0].content[1].image_url.url", "image_urls_off"),
    (responses({"type": "input_image", "image_url": data_url(encoded("PNG")[:30])}),
     "input[0].content[1].image_url", "invalid_image"),
    (responses({"type": "input_image", "file_id": "file-1"}), "input[0].content[1].file_id", "not_supported"),
    (responses({"type": "input_image"}), "input[0].content[1].image_url", "invalid_image"),
]


@pytest.mark.parametrize("case, param, code", BAD, ids=range(len(BAD)))
def test_malformed_images_get_their_precise_400_first(servers: dict[str, str], case: Any, param: str,
                                                      code: str) -> None:
    got, got_code, message = error_of(servers["plain"], *case)
    assert (got, got_code) == (param, code), message


@pytest.mark.parametrize("case, field", [
    (chat({"type": "video_url", "video_url": {"url": "https://x/v.mp4"}}), "client-extracted frames"),
    (chat({"type": "input_audio", "input_audio": {}}), "'image_url' and 'video' parts are"),
    (responses({"type": "input_file", "file_id": "f"}), "'input_image' are"),
], ids=["video_url", "audio", "input_file"])
def test_other_part_types_are_refused_naming_the_type(servers: dict[str, str], case: Any, field: str) -> None:
    param, _, message = error_of(servers["plain"], *case)
    assert param.endswith("content[1].type") and field in message


def test_anthropic_sources(servers: dict[str, str]) -> None:
    cases = [({"type": "image", "source": {"type": "url", "url": "https://x.example/a.png"}},
              "messages[0].content[1].source.url", "--allow-image-urls"),
             ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "messages[0].content[1].source.type",
              "'base64' or 'url'"),
             ({"type": "image", "source": {"type": "base64", "data": "AAAA"}},
              "messages[0].content[1].source.media_type", "is required"),
             (anthropic_b64(encoded("PNG"), "text/plain"), "messages[0].content[1].source.data", "not an image"),
             ({"type": "image"}, "messages[0].content[1].source", "is required"),
             ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]},
              "messages[0].content[1].content[0].text", "is required"),
             ({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]},
              "messages[0].content[1].content[0].source", "is required")]
    for block, field, words in cases:
        _, _, message = error_of(servers["plain"], *messages(block))
        assert f"'{field}'" in message and words in message, message


def test_limits_name_the_field_in_each_dialect(servers: dict[str, str]) -> None:
    small = servers["small"]
    four = [image_url(PNG_URL)] * 4
    assert error_of(small, *chat(*four))[:2] == ("messages[0].content[4]", "too_many_images")
    video = {"type": "video", "video": [PNG_URL] * 3}
    assert error_of(small, *chat(video))[:2] == ("messages[0].content[1].video", "too_many_images")
    two_frames = {"type": "video", "video": [PNG_URL] * 2}   # 2 frames + 2 images = 4 images
    assert error_of(small, *chat(two_frames, image_url(PNG_URL), image_url(PNG_URL)))[0] == "messages[0].content[3]"
    big = data_url(encoded("PNG", size=(200, 200), compress_level=0))
    assert error_of(small, *chat(image_url(big)))[:2] == ("messages[0].content[1].image_url.url", "image_too_large")
    assert error_of(small, *responses({"type": "input_image", "image_url": big}))[:2] == (
        "input[0].content[1].image_url", "image_too_large")
    _, _, message = error_of(small, *messages(*[anthropic_b64(encoded("PNG"))] * 4))
    assert "'messages[0].content[4]'" in message and "--max-images-per-request" in message
    _, _, message = error_of(small, *messages(anthropic_b64(encoded("PNG", size=(200, 200), compress_level=0))))
    assert "'messages[0].content[1].source.data'" in message and "--max-image-bytes" in message


def test_url_images_are_fetched_when_allowed(servers: dict[str, str]) -> None:
    host = servers["host"]
    _, code, message = error_of(servers["small"], *chat(image_url(host + "/a.png")))
    assert code == "model_not_multimodal"   # fetched and decoded: only the missing encoder is left
    assert error_of(servers["small"], *chat(image_url(host + "/a.txt")))[:2] == (
        "messages[0].content[1].image_url.url", "invalid_image")
    _, _, message = error_of(servers["small"], *messages({"type": "image", "source": {"type": "url",
                                                                                      "url": host + "/a.png"}}))
    assert "no vision encoder" in message


def test_text_only_routes_refuse_image_parts(servers: dict[str, str]) -> None:
    r = httpx.post(servers["plain"] + "/tokenize", json={"messages": chat(image_url(PNG_URL))[1]["messages"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[1]"


def test_text_parts_still_serve(servers: dict[str, str]) -> None:
    path, body = chat()
    r = httpx.post(servers["plain"] + path, json=body, timeout=30)
    assert r.status_code == 200, r.text


# --------------------------------------------------------------------------- the official clients
def test_openai_client_sends_image_parts(servers: dict[str, str]) -> None:
    import openai
    client = openai_for(servers["plain"])
    content = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": PNG_URL}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": content}])
    assert info.value.status_code == 400 and info.value.body["param"] == "messages[0].content[1]"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="fake-model", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "what?"}, {"type": "input_image", "image_url": PNG_URL, "detail": "auto"}]}])
    assert info.value.body["param"] == "input[0].content[1]"


def test_anthropic_client_sends_image_blocks(servers: dict[str, str]) -> None:
    import anthropic
    client = anthropic_for(servers["plain"])
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="fake-model", max_tokens=4, messages=[{"role": "user", "content": [
            anthropic_b64(encoded("JPEG"), "image/jpeg"), {"type": "text", "text": "what is this?"}]}])
    assert info.value.status_code == 400 and "'messages[0].content[0]'" in str(info.value)
    assert "no vision encoder" in str(info.value)
