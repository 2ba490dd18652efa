"""Images in prompts: each image part goes through the chat template as a mark, and the rendered text's marks
become the model's image text (`Engine.image_prompt`) before tokenizing.

A mark is a private-use character pair around this process's nonce and the image's pixel digest, so no
client text can forge one, every chat template passes it through as plain message text, and the images end
up in the order the template put them (Anthropic's tool results render before their turn's text; a stored
Responses conversation may hold an earlier request's image). `GenerationRequest.images` is that order.
"""
from __future__ import annotations

import re
import secrets
from collections.abc import Iterable, Mapping
from typing import Any

from imp_jax.errors import InvalidRequestError
from imp_jax.runtime.api import Engine
from imp_jax.runtime.request import ImageInput
from imp_jax.server.image_parts import ImageRef

_NONCE = secrets.token_hex(6)
_MARK = re.compile("\ue000" + _NONCE + "([0-9a-f]{32})\ue001")


def image_mark(image: ImageInput) -> str:
    """The text standing for `image` in a message until the rendered prompt is expanded."""
    return f"\ue000{_NONCE}{image.digest.hex()}\ue001"


class PromptImages:
    """A request's decoded images by the part that sent them: what its dialect's message builders write."""

    def __init__(self, refs: list[ImageRef], images: list[ImageInput],
                 earlier: Mapping[str, ImageInput] | None = None):
        self._marks: dict[str, str] = {}
        self.by_digest: dict[str, ImageInput] = dict(earlier or {})   # a stored conversation's images too
        for ref, image in zip(refs, images, strict=True):
            part = ref.video or ref.param   # a video part's marks are its frames', in order
            self._marks[part] = self._marks.get(part, "") + image_mark(image)
            self.by_digest[image.digest.hex()] = image

    def mark(self, part: str) -> str:
        """The marks of the image (or video) part at `part`, e.g. `messages[0].content[1]`; "" for others."""
        return self._marks.get(part, "")

    def __bool__(self) -> bool:
        return bool(self.by_digest)


NO_IMAGES = PromptImages([], [])


def count_marks(contents: Iterable[Any]) -> int:
    """How many image marks the string contents hold (what a render should keep)."""
    return sum(len(_MARK.findall(c)) for c in contents if isinstance(c, str))


def expand(text: str, images: PromptImages, engine: Engine, param: str,
           expected: int | None = None) -> tuple[str, tuple[ImageInput, ...]]:
    """The rendered `text` with each mark replaced by its image's text, and the images in prompt order.
    `expected`: how many marks the rendered messages held; a template that left some out (or repeated
    them) is a 400 naming `param`, since the model would see other images than the client sent."""
    found = [images.by_digest[d] for d in _MARK.findall(text)]
    if expected is not None and len(found) != expected:
        raise InvalidRequestError(f"'{param}': the model's chat template rendered {len(found)} of the request's "
                                  f"{expected} images; it does not place images in these messages",
                                  param=param, code="invalid_image")
    if not found:
        return text, ()
    return _MARK.sub(lambda m: engine.image_prompt(images.by_digest[m.group(1)]), text), tuple(found)


def strip_marks(text: str) -> str:
    """`text` without image marks (prompt text a client sees, or a route that renders text only)."""
    return _MARK.sub("", text)
