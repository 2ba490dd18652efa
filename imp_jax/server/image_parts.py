"""Image content parts as each dialect spells them, as ImageRefs in body order; their count limits; and the
request's gate: decode them all (images.py), then refuse them unless the served model has vision.

Dialects keep their parts in order; `image_refs()` on each request model walks messages and parts in body
order, so the n-th ref (and the n-th decoded ImageInput) is the n-th image a prompt renderer meets.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.request import ImageInput
from imp_jax.server.images import DETAILS, ImageLimits, ImageSource, decode, image_bytes
from imp_jax.server.limits import off_loop

VIDEO_URL_REFUSED = ("'video_url' parts are not fetched: send video as client-extracted frames, "
                     "{\"type\": \"video\", \"video\": [\"data:image/jpeg;base64,...\", ...]}")


@dataclasses.dataclass(frozen=True)
class ImageRef:
    """One image part (or one frame of a client video part) as sent: its path, its bytes' source, its detail."""

    param: str                 # the part: messages[0].content[1] (a frame: ...content[1].video[2])
    source: ImageSource
    detail: str = "auto"
    video: str | None = None   # a frame's video part: messages[0].content[1]


def _error(param: str, message: str) -> InvalidRequestError:
    return InvalidRequestError(f"'{param}' {message}", param=param, code="invalid_image")


def _detail(value: Any, param: str) -> str:
    if value is None:
        return "auto"
    if value not in DETAILS:
        raise _error(param, f"must be one of {', '.join(DETAILS)}")
    return value


def openai_image(image_url: Any, param: str) -> ImageRef:
    """Chat's `{"type": "image_url", "image_url": {"url": ..., "detail": ...}}` (a bare URL string is taken too)."""
    if isinstance(image_url, str):
        return ImageRef(param, ImageSource(f"{param}.image_url", url=image_url))
    if not isinstance(image_url, dict) or not isinstance(image_url.get("url"), str):
        raise _error(f"{param}.image_url", "must be an object with a string 'url' (a data: URL)")
    return ImageRef(param, ImageSource(f"{param}.image_url.url", url=image_url["url"]),
                    _detail(image_url.get("detail"), f"{param}.image_url.detail"))


def video_frames(frames: Any, param: str) -> list[ImageRef]:
    """A client video part `{"type": "video", "video": [frame URLs]}`: one ref per frame."""
    where = f"{param}.video"
    if not isinstance(frames, list) or not frames:
        raise _error(where, "must be a non-empty list of frames (image data: URLs)")
    refs = []
    for k, frame in enumerate(frames):
        url = frame.get("url") if isinstance(frame, dict) else frame   # {"url": ...} as image_url spells it
        if not isinstance(url, str):
            raise _error(f"{where}[{k}]", "must be an image data: URL")
        refs.append(ImageRef(f"{where}[{k}]", ImageSource(f"{where}[{k}]", url=url), video=param))
    return refs


def anthropic_image(source: Any, param: str) -> ImageRef:
    """Anthropic's `{"type": "image", "source": {"type": "base64", "media_type", "data"} | {"type": "url", "url"}}`."""
    where = f"{param}.source"
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if not isinstance(media, str):
            raise _error(f"{where}.media_type", "is required: image/png, image/jpeg, image/webp or image/gif")
        if not isinstance(data, str):
            raise _error(f"{where}.data", "is required: the image as base64")
        return ImageRef(param, ImageSource(f"{where}.data", data=data, media_type=media))
    if kind == "url":
        if not isinstance(source.get("url"), str):
            raise _error(f"{where}.url", "is required")
        return ImageRef(param, ImageSource(f"{where}.url", url=source["url"]))
    raise _error(f"{where}.type" if isinstance(source, dict) else where,
                 "must be a source of type 'base64' or 'url'")


def responses_image(part: dict[str, Any], param: str) -> ImageRef:
    """Responses' `{"type": "input_image", "image_url": "data:...", "detail": ...}` (no file_id: no Files API)."""
    if part.get("file_id") is not None and part.get("image_url") is None:
        raise InvalidRequestError(f"'{param}.file_id': this server has no Files API; send 'image_url' as a "
                                  "data: URL", param=f"{param}.file_id", code="not_supported")
    if not isinstance(part.get("image_url"), str):
        raise _error(f"{param}.image_url", "is required: the image as a data: URL")
    return ImageRef(param, ImageSource(f"{param}.image_url", url=part["image_url"]),
                    _detail(part.get("detail"), f"{param}.detail"))


def check_counts(refs: list[ImageRef], limits: ImageLimits) -> None:
    """400 past --max-video-frames frames in one video part, or past --max-images-per-request images."""
    frames: dict[str, int] = {}
    for ref in refs:
        if ref.video is not None:
            frames[ref.video] = frames.get(ref.video, 0) + 1
            if frames[ref.video] > limits.max_video_frames:
                where = f"{ref.video}.video"
                raise InvalidRequestError(f"'{where}' has more than {limits.max_video_frames} frames "
                                          "(--max-video-frames)", param=where, code="too_many_images")
    if len(refs) > limits.max_images:
        ref = refs[limits.max_images]
        raise InvalidRequestError(f"'{ref.param}': the request has {len(refs)} images (video frames count); this "
                                  f"server takes at most {limits.max_images} (--max-images-per-request)",
                                  param=ref.param, code="too_many_images")


async def load_images(refs: list[ImageRef], limits: ImageLimits) -> list[ImageInput]:
    """Every ref decoded, in order, each on a worker thread (one at a time: a request holds one thread)."""
    check_counts(refs, limits)
    out = []
    for ref in refs:
        raw = await off_loop(image_bytes, ref.source, limits)
        out.append(await off_loop(decode, raw, ref.source.param, limits, ref.detail))
    return out


def require_vision(engine: Engine, refs: list[ImageRef]) -> None:
    """400 naming the first image part unless the served model takes images (Engine.vision)."""
    if refs and not engine.vision:
        param = refs[0].video or refs[0].param
        raise InvalidRequestError(f"'{param}' is an image, and the served model '{engine.served_name}' has no "
                                  "vision encoder; send text only", param=param, code="model_not_multimodal")


async def request_images(refs: list[ImageRef], engine: Engine, limits: ImageLimits) -> list[ImageInput]:
    """The request's images decoded (a 400 naming the first bad one), then the vision gate."""
    images = await load_images(refs, limits)
    require_vision(engine, refs)
    return images
