"""Image content parts' bytes to pixels: data: URLs (and, when the operator allows, http(s) fetches) decoded
into ImageInput (runtime/request.py), each limit a 400 naming the field.

What bounds one image's work: its encoded bytes (--max-image-bytes) are checked before base64 decoding,
its width x height (--max-image-pixels) from the header before any pixel is decoded (Pillow opens lazily),
and only PNG, JPEG, WebP and GIF parsers ever see the bytes. Decoding and fetching run on worker threads
(limits.off_loop), one image of a request at a time, so a large image holds one thread, never the loop.
"""
from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import re
import time

import numpy as np
import xxhash
from PIL import Image, UnidentifiedImageError

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.request import ImageInput

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")   # Pillow's names; nothing else is parsed
MEDIA_TYPES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP",
               "image/gif": "GIF"}
DETAILS = ("auto", "low", "high")
_DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ImageLimits:
    """What one request's images may make the server do (ServerConfig's --max-image-bytes etc.)."""

    max_bytes: int = 20 << 20         # encoded bytes of one image (after base64)
    max_images: int = 16              # images per request, video frames included
    max_pixels: int = 33_177_600      # width x height of one image: 8K UHD (7680 x 4320), 100 MB as RGB
    max_video_frames: int = 32        # frames of one client video part
    allow_urls: bool = False          # fetch http(s) image URLs (off: a 400)
    fetch_timeout_s: float = 10.0     # connect + each read of one fetch


@dataclasses.dataclass(frozen=True)
class ImageSource:
    """Where one image's bytes are: a URL (data: or http(s)), or Anthropic's base64 `data` with its media type."""

    param: str                 # the field errors about the bytes name: ...image_url.url, ...source.data
    url: str | None = None
    data: str | None = None
    media_type: str | None = None


def image_bytes(src: ImageSource, limits: ImageLimits) -> bytes:
    """The encoded image `src` holds (base64-decoded or fetched); a 400 naming src.param for anything wrong."""
    if src.data is not None:
        check_media_type(src.media_type, src.param)
        return b64_bytes(src.data, src.param, limits)
    url = src.url or ""
    if url[:5].lower() == "data:":
        return data_url_bytes(url, src.param, limits)
    if url[:7].lower() == "http://" or url[:8].lower() == "https://":
        if not limits.allow_urls:
            raise InvalidRequestError(f"'{src.param}': this server does not fetch image URLs (the operator's "
                                      "--allow-image-urls); send the image inline as a base64 data: URL",
                                      param=src.param, code="image_urls_off")
        return fetch(url, src.param, limits)
    raise InvalidRequestError(f"'{src.param}' must be a data: URL (data:image/png;base64,...) or an http(s) URL",
                              param=src.param, code="invalid_image")


def check_media_type(media_type: str | None, param: str) -> None:
    """400 unless `media_type` is an image type this server decodes."""
    if media_type is None or media_type.lower() in MEDIA_TYPES:
        return
    what = "is not an image" if not media_type.lower().startswith("image/") else "is not a supported image type"
    raise InvalidRequestError(f"'{param}': media type {media_type[:64]!r} {what}; PNG, JPEG, WebP and GIF are",
                              param=param, code="invalid_image")


def data_url_bytes(url: str, param: str, limits: ImageLimits) -> bytes:
    """A `data:image/...;base64,...` URL's bytes."""
    m = _DATA_URL.match(url)
    if m is None:
        raise InvalidRequestError(f"'{param}' is not a well-formed data: URL (data:image/png;base64,...)",
                                  param=param, code="invalid_image")
    check_media_type(m.group(1) or None, param)
    if "base64" not in m.group(2).lower().split(";"):
        raise InvalidRequestError(f"'{param}': a data: URL image must be base64 (data:image/png;base64,...)",
                                  param=param, code="invalid_image")
    return b64_bytes(url[m.end():], param, limits)


def b64_bytes(text: str, param: str, limits: ImageLimits) -> bytes:
    """Base64 text decoded; its size is checked first, from its length, so a huge one is never decoded."""
    text = text.strip()
    if len(text) // 4 * 3 > limits.max_bytes + 2:
        too_large(len(text) // 4 * 3, param, limits)
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"'{param}' is not valid base64", param=param, code="invalid_image") from None
    if len(raw) > limits.max_bytes:
        too_large(len(raw), param, limits)
    return raw


def too_large(size: int, param: str, limits: ImageLimits) -> None:
    raise InvalidRequestError(f"'{param}' is an image of about {size} bytes; this server takes at most "
                              f"{limits.max_bytes} (--max-image-bytes)", param=param, code="image_too_large")


def fetch(url: str, param: str, limits: ImageLimits) -> bytes:
    """GET an http(s) image URL (blocking: run it off the loop): at most limits.max_bytes read, within about
    twice fetch_timeout_s in all; redirects are followed only to http(s) URLs (httpx refuses others), at most 3."""
    import httpx

    try:
        with httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=True, max_redirects=3) as client:
            with client.stream("GET", url, headers={"Accept": "image/*"}) as r:
                if r.status_code != 200:
                    raise InvalidRequestError(f"'{param}': fetching the image answered HTTP {r.status_code}",
                                              param=param, code="image_fetch_failed")
                kind = r.headers.get("content-type", "").split(";")[0].strip()
                if kind and kind.lower() != "application/octet-stream":
                    check_media_type(kind, param)
                body, deadline = bytearray(), time.monotonic() + limits.fetch_timeout_s
                for chunk in r.iter_bytes():
                    body += chunk
                    if len(body) > limits.max_bytes:
                        too_large(len(body), param, limits)
                    if time.monotonic() > deadline:   # a server dripping bytes under the read timeout
                        raise InvalidRequestError(f"'{param}': fetching the image took more than "
                                                  f"{limits.fetch_timeout_s:g} s", param=param,
                                                  code="image_fetch_failed")
                return bytes(body)
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, ValueError) as e:   # ValueError: URL parsing
        raise InvalidRequestError(f"'{param}': the image could not be fetched ({type(e).__name__})",
                                  param=param, code="image_fetch_failed") from None


def decode(raw: bytes, param: str, limits: ImageLimits, detail: str = "auto") -> ImageInput:
    """Encoded bytes as RGB pixels (a GIF's or animation's first frame) with their digest. The size is read
    from the header and checked before decoding; Pillow's own bomb check (DecompressionBombError, past
    ~179 MP) stays as a backstop."""
    try:
        with Image.open(io.BytesIO(raw), formats=FORMATS) as im:   # lazy: the header only
            width, height = im.size
            if width * height > limits.max_pixels:
                raise InvalidRequestError(f"'{param}' is a {width}x{height} image ({width * height} pixels); "
                                          f"this server takes at most {limits.max_pixels} (--max-image-pixels)",
                                          param=param, code="image_too_large")
            fmt = str(im.format)
            im.seek(0)
            pixels = np.asarray(over_white(im), dtype=np.uint8)
    except Image.DecompressionBombError:
        raise InvalidRequestError(f"'{param}' claims more pixels than this server decodes (at most "
                                  f"{limits.max_pixels}, --max-image-pixels)", param=param,
                                  code="image_too_large") from None
    except UnidentifiedImageError:
        raise InvalidRequestError(f"'{param}' is not a PNG, JPEG, WebP or GIF image", param=param,
                                  code="invalid_image") from None
    except (OSError, ValueError, SyntaxError, EOFError, IndexError) as e:   # Pillow's ways of saying "corrupt"
        raise InvalidRequestError(f"'{param}' is a corrupt or truncated image ({type(e).__name__})", param=param,
                                  code="invalid_image") from None
    return ImageInput(pixels, pixel_digest(pixels), fmt, raw, detail)


def over_white(im: Image.Image) -> Image.Image:
    """RGB, with any transparency (an alpha band, a palette's transparent index) composited over white: what
    the image processors of Idefics3, SmolVLM and Qwen2-VL do, where a bare RGB conversion would keep the
    colour under each transparent pixel."""
    if "A" not in im.getbands() and im.info.get("transparency") is None:
        return im.convert("RGB")
    rgba = im.convert("RGBA")
    return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")


def pixel_digest(pixels: np.ndarray) -> bytes:
    """xxh3_128 of the shape and the pixels: what the prefix cache keys an image's tokens on."""
    h = xxhash.xxh3_128(np.asarray(pixels.shape, dtype=np.int64).tobytes())
    h.update(np.ascontiguousarray(pixels).data)
    return h.digest()
