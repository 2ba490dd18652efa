"""Images (Idefics3 / SmolVLM) as a feature: a request's pictures become encoder rows in the device row pool
(runtime/image_rows.py), and each prompt token that stands for one reads its row in the step.

`prepare` cuts and normalises the pixels (off the engine thread); admission checks the prompt's `<image>`
tokens against the images and takes each image's pool slots (a picture already there is a hit, not encoded
again) for the request's whole life, so recompute after preemption reads the same rows; a step whose chunks
reach an image's tokens first launches the encoder on every such image, across requests, then gives each
token row its pool row (`embed_src`). Blocks holding an image's tokens are keyed on its digest
(kv_hash.ImageKeys through Sequence.cache_key).
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import numpy as np

from imp_jax.errors import EngineError, InvalidRequestError
from imp_jax.model.vision.idefics3_processor import image_grid, image_token_positions
from imp_jax.runtime.features.base import Feature, Services
from imp_jax.runtime.image_encoder import ImageEncoder, frames_of, num_frames
from imp_jax.runtime.image_rows import ImageEntry, ImageRows
from imp_jax.runtime.kv_hash import ImageKeys


@dataclasses.dataclass(eq=False)
class RequestImages:
    """What a request holds: its images' entries, each prompt token's pool row (-1: not an image's), each
    image's (first, end token, digest hex) span, and the request's sequences (a failed encode fails them all)."""

    entries: list[ImageEntry]
    prompt_src: np.ndarray
    spans: tuple[tuple[int, int, str], ...]
    seqs: list


def frames_per_image(req, vision) -> list[int]:
    """How many frames each of the request's images is cut into (from its size alone)."""
    return [num_frames(image_grid(*image.size, vision.processor)) for image in req.images]


def image_bounds(req, vision) -> list[tuple[int, int]] | None:
    """Each image's [first, end) token span in `req.prompt_ids` (its frames x image_seq_len `<image>` tokens,
    in order), or None when the prompt's image tokens do not match the images."""
    frames = frames_per_image(req, vision)
    L = vision.config.image_seq_len
    positions = image_token_positions(req.prompt_ids, vision.config.image_token_id)
    if len(positions) != sum(frames) * L:
        return None
    ends = np.cumsum([f * L for f in frames])
    return [(int(positions[e - f * L]), int(positions[e - 1]) + 1) for e, f in zip(ends, frames)]


def image_keys(key: Any, req, vision) -> Any:
    """`key` as the prefix cache applies it to `req`'s blocks (kv_hash.ImageKeys when it has images)."""
    bounds = image_bounds(req, vision) if req.images and vision is not None else None
    if bounds is None:
        return key
    return ImageKeys(key, tuple((lo, hi, image.digest.hex()) for (lo, hi), image in zip(bounds, req.images)))


class ImagesFeature(Feature):
    """`GenerationRequest.images`: the encoder's rows over each image's `<image>` tokens."""

    name = "images"

    def __init__(self, services: Services):
        super().__init__(services)
        vision = services.vision
        self.rows: ImageRows | None = None
        self.encoder: ImageEncoder | None = None
        if vision is not None:
            L = vision.config.image_seq_len
            slots = services.config.image_cache_rows // L
            cfg = vision.processor
            widest = num_frames(image_grid(cfg.longest_edge, cfg.longest_edge, cfg))   # a full-size image
            step = -(-services.config.max_num_batched_tokens // L)   # the frames one step's tokens can cover
            self.rows = ImageRows(slots, L)
            self.encoder = ImageEncoder(vision, slots, max(widest, step), services.step_fn.mesh)

    def warm_up(self, progress=None) -> None:
        """Compile the encoder's buckets and run each once (engine start-up)."""
        if self.encoder is not None:
            step_fn = self.s.step_fn
            step_fn.image_pool = self.encoder.warm_up(step_fn.image_pool, progress)

    @classmethod
    def active(cls, req, params) -> bool:
        return bool(req.images)

    def prepare(self, req) -> None:
        """Cut and normalise every image's frames (Pillow resizes: unbounded host work) before admission."""
        if req.images and self.encoder is not None and req.prepared_images is None:
            req.prepared_images = [frames_of(image.pixels, self.s.vision) for image in req.images]

    def check(self, req, params):
        if self.rows is None:
            if req.images:
                raise InvalidRequestError("this model takes no image input (it has no vision encoder)",
                                          param="images")
            return params
        if params.prompt_logprobs is not None and req.images:
            raise InvalidRequestError("prompt_logprobs is not supported for prompts with images",
                                      param="prompt_logprobs")
        L = self.rows.rows_per_frame
        frames = frames_per_image(req, self.s.vision)
        have = len(image_token_positions(req.prompt_ids, self.s.vision.config.image_token_id))
        if have != sum(frames) * L:
            raise InvalidRequestError(
                f"the prompt has {have} image tokens, but its {len(frames)} image(s) need {sum(frames) * L} "
                f"({sum(frames)} frames of {L}): each image's prompt text (Engine.image_prompt) must be in the "
                "prompt once, in the order of the images, and no other image token", param="images")
        distinct = dict(zip((image.digest for image in req.images), frames))
        if sum(distinct.values()) > self.rows.num_slots:
            raise InvalidRequestError(
                f"the images need {sum(distinct.values()) * L} rows of the image cache, which holds "
                f"{self.rows.num_slots * L} (--image-cache-rows)", param="images")
        return params

    def acquire(self, state) -> None:
        req = state.request
        if not req.images:
            return
        frames = frames_per_image(req, self.s.vision)
        entries = self.rows.acquire([(image.digest, f) for image, f in zip(req.images, frames)])
        if entries is None:
            raise EngineError("the image cache is held by running requests' images; retry shortly",
                              code="image_cache_full", status=503)
        prepared, req.prepared_images = req.prepared_images, None   # the pixels live on in the new entries only
        for i, entry in enumerate(entries):
            if not entry.encoded and entry.pixels is None:   # new: its frames wait for the encoder
                entry.pixels = prepared[i] if prepared is not None else frames_of(req.images[i].pixels,
                                                                                  self.s.vision)
        positions = image_token_positions(req.prompt_ids, self.s.vision.config.image_token_id)
        src = np.full(len(req.prompt_ids), -1, np.int32)
        src[positions] = np.concatenate([self.rows.rows(entry) for entry in entries])
        state.ext[self.name] = RequestImages(entries, src, image_keys(None, req, self.s.vision).spans, state.seqs)

    def start(self, seq, state) -> None:
        images = state.ext.get(self.name)
        if images is not None:
            seq.ext[self.name] = images
            seq.ext["image_spans"] = images.spans   # Sequence.cache_key: blocks keyed on their images

    def token_extras(self, chunks, num_tokens: int, failed) -> dict[str, Any]:
        if self.rows is None:
            return {}
        due: dict[ImageEntry, list[RequestImages]] = {}
        for c in chunks:
            images = c.seq.ext.get(self.name)
            if images is None:
                continue
            a, b = c.seq.num_computed, c.seq.num_computed + c.num_tokens
            for entry, (lo, hi, _) in zip(images.entries, images.spans):
                if not entry.encoded and lo < b and a < hi:   # an image whose KV is all cached is never encoded
                    due.setdefault(entry, []).append(images)
        bad = self._encode(due) if due else {}
        src = np.full(num_tokens, -1, np.int32)
        t = 0
        for c in chunks:
            images = c.seq.ext.get(self.name)
            if images in bad:
                if all(seq.request is not c.seq.request for seq, _ in failed):   # once per request
                    failed.append((c.seq, bad[images]))
            elif images is not None:
                a = c.seq.num_computed
                k = min(c.num_tokens, len(images.prompt_src) - a)
                if k > 0:
                    src[t:t + k] = images.prompt_src[a:a + k]
            t += c.num_tokens
        return {"embed_src": src}

    def _encode(self, due: dict[ImageEntry, list[RequestImages]]) -> dict[RequestImages, BaseException]:
        """Launch the encoder on the due images, all in as few programs as the buckets allow; the requests of a
        failed launch, with its error (their rows run without images and their blocks are never shared)."""
        entries = list(due)
        try:
            pixels = np.concatenate([e.pixels[0] for e in entries])
            mask = np.concatenate([e.pixels[1] for e in entries])
            slots = np.concatenate([np.asarray(e.slots, np.int32) for e in entries])
            self.encoder.encode(self.s.step_fn, pixels, mask, slots)
        except Exception as error:
            bad = {}
            for entry in entries:
                self.rows.forget(entry)
                for images in due[entry]:
                    bad[images] = error
                    for seq in images.seqs:   # this request's KV from here on is wrong: a key nobody shares
                        seq.ext["private_cache"] = uuid.uuid4().hex
            return bad
        for entry in entries:
            entry.encoded, entry.pixels = True, None
        return {}

    def release(self, state) -> None:
        images = state.ext.pop(self.name, None)
        if images is not None:
            self.rows.release(images.entries)

    def stats(self) -> dict[str, int]:
        """The row pool's and the encoder's counters (zeros for a text model)."""
        rows, enc = self.rows, self.encoder
        return dict(image_rows_total=rows.num_slots * rows.rows_per_frame if rows else 0,
                    image_rows_used=rows.slots_in_use * rows.rows_per_frame if rows else 0,
                    image_row_cache_hits_total=rows.hits if rows else 0,
                    image_encoder_launches_total=enc.launches if enc else 0,
                    image_frames_encoded_total=enc.frames_encoded if enc else 0)
