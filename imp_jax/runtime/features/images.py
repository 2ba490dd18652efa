"""Images as a feature: a request's pictures become encoder rows in the device row pool (runtime/scheduling/image_rows.py),
and each prompt token that stands for one reads its row in the step. The family (Idefics3 / SmolVLM, or
Qwen2.5-VL) is behind runtime/decoding/image_family.py: its rows per image, pool units, preprocessing and encoder.

`prepare` preprocesses the pixels (and, for an M-RoPE family, computes the prompt's [3, T] positions) off the
engine thread; admission checks the prompt's image tokens against the images and takes each image's pool
units (a picture already there is a hit, not encoded again) for the request's whole life, so recompute after
preemption reads the same rows; a step whose chunks reach an image's tokens first launches the encoder on
every such image, across requests, then gives each token row its pool row (`embed_src`) and, for M-RoPE, its
position [3] (`mrope_positions`: the prompt's below its length, index + delta, all three equal, after).
Blocks holding an image's tokens are keyed on its digest (kv_hash.ImageKeys through Sequence.cache_key).
A bidirectional family (Gemma 3: an image's tokens attend each other during prefill) makes each image's span
atomic for the scheduler (`seq.ext["atomic_spans"]`: a prefill chunk never ends inside one, so its queries
never attend KV not yet written) and gives each token row inside a span its last key (`key_limit`, hi - 1).
"""
from __future__ import annotations

import dataclasses
import uuid
from typing import Any

import numpy as np

from imp_jax.errors import EngineError, InvalidRequestError
from imp_jax.runtime.features.base import Feature, Services
from imp_jax.runtime.decoding.image_family import image_family, row_unit
from imp_jax.runtime.scheduling.image_rows import ImageEntry, ImageRows
from imp_jax.runtime.kv.kv_hash import ImageKeys


@dataclasses.dataclass
class Prepared:
    """`GenerationRequest.prepared_images`: each image's encoder input and, for M-RoPE, (positions, delta)."""

    pixels: list
    mrope: tuple[np.ndarray, int] | None


@dataclasses.dataclass(eq=False)
class RequestImages:
    """What a request holds: its images' entries, each prompt token's pool row (-1: not an image's), each
    image's (first, end token, digest hex) span, the request's sequences (a failed encode fails them all),
    and for M-RoPE the prompt's positions [3, P] and the decode delta."""

    entries: list[ImageEntry]
    prompt_src: np.ndarray
    spans: tuple[tuple[int, int, str], ...]
    seqs: list
    mrope: tuple[np.ndarray, int] | None = None


def image_positions(req, family) -> np.ndarray:
    """Where the prompt's image tokens are."""
    return np.flatnonzero(np.asarray(req.prompt_ids) == family.image_token_id)


def image_bounds(req, family) -> list[tuple[int, int]] | None:
    """Each image's [first, end) token span in `req.prompt_ids` (its rows' image tokens, in order), or None
    when the prompt's image tokens do not match the images."""
    counts = [family.num_rows(image.size) for image in req.images]
    positions = image_positions(req, family)
    if len(positions) != sum(counts):
        return None
    ends = np.cumsum(counts)
    return [(int(positions[e - n]), int(positions[e - 1]) + 1) for e, n in zip(ends, counts)]


def image_keys(key: Any, req, vision) -> Any:
    """`key` as the prefix cache applies it to `req`'s blocks (kv_hash.ImageKeys when it has images)."""
    bounds = image_bounds(req, image_family(vision)) if req.images and vision is not None else None
    if bounds is None:
        return key
    return ImageKeys(key, tuple((lo, hi, image.digest.hex()) for (lo, hi), image in zip(bounds, req.images)))


def key_limits(chunks, num_tokens: int) -> np.ndarray:
    """int32 [num_tokens]: for each token row of the step's chunks (chunk i's rows after chunk i-1's), the last
    key it attends, hi - 1, when it lies in one of its sequence's atomic spans [lo, hi); -1 (causal) elsewhere."""
    out = np.full(num_tokens, -1, np.int32)
    t = 0
    for c in chunks:
        a, b = c.seq.num_computed, c.seq.num_computed + c.num_tokens
        for lo, hi in c.seq.ext.get("atomic_spans", ()):
            if lo < b and a < hi:
                out[t + max(lo, a) - a:t + min(hi, b) - a] = hi - 1
        t += c.num_tokens
    return out


class ImagesFeature(Feature):
    """`GenerationRequest.images`: the encoder's rows over each image's tokens (and M-RoPE positions)."""

    name = "images"

    def __init__(self, services: Services):
        super().__init__(services)
        vision = services.vision
        self.rows: ImageRows | None = None
        self.family = None
        if vision is not None:
            unit = row_unit(vision)
            units = services.config.image_cache_rows // unit
            self.rows = ImageRows(units, unit)
            self.family = image_family(vision, units, services.config.max_num_batched_tokens,
                                       services.step_fn.mesh)

    @property
    def encoder(self):
        return None if self.family is None else self.family.encoder

    def warm_up(self, progress=None) -> None:
        """Compile the encoder's buckets and run each once (engine start-up)."""
        if self.encoder is not None:
            step_fn = self.s.step_fn
            step_fn.image_pool = self.encoder.warm_up(step_fn.image_pool, progress)

    @classmethod
    def active(cls, req, params) -> bool:
        return bool(req.images)

    def prepare(self, req) -> None:
        """Preprocess every image (Pillow resizes: unbounded host work) and, for M-RoPE, the prompt's positions
        (a Python scan of the prompt) before admission."""
        if req.images and self.family is not None and req.prepared_images is None:
            req.prepared_images = Prepared([self.family.pixels(image.pixels) for image in req.images],
                                           self._mrope(req))

    def _mrope(self, req) -> tuple[np.ndarray, int] | None:
        if not self.family.mrope:
            return None
        try:
            return self.family.positions(req.prompt_ids, [image.size for image in req.images])
        except ValueError:
            return None   # check() says what is wrong

    def check(self, req, params):
        if self.rows is None:
            if req.images:
                raise InvalidRequestError("this model takes no image input (it has no vision encoder)",
                                          param="images")
            return params
        for knob in ("prompt_logprobs", "logit_lens"):
            if req.images and getattr(params, knob, None) is not None:
                raise InvalidRequestError(f"{knob} is not supported for prompts with images", param=knob)
        family, unit = self.family, self.rows.rows_per_frame
        counts = [family.num_rows(image.size) for image in req.images]
        have = len(image_positions(req, family))
        if have != sum(counts):
            raise InvalidRequestError(
                f"the prompt has {have} image tokens, but its {len(counts)} image(s) need {sum(counts)}: each "
                "image's prompt text (Engine.image_prompt) must be in the prompt once, in the order of the "
                "images, and no other image token", param="images")
        for image in req.images:
            why = family.refusal(image.size)
            if why:
                raise InvalidRequestError(why, param="images")
        if req.images and family.bidirectional:
            self._check_atomic(req, params)
        if req.images and family.mrope and self._positions(req) is None:
            raise InvalidRequestError("each image's tokens must be one run of exactly its count, between its "
                                      "start and end tokens (Engine.image_prompt)", param="images")
        distinct = {image.digest: family.units(image.size) for image in req.images}
        if sum(distinct.values()) > self.rows.num_slots:
            raise InvalidRequestError(
                f"the images need {sum(distinct.values()) * unit} rows of the image cache, which holds "
                f"{self.rows.num_slots * unit} (--image-cache-rows)", param="images")
        return params

    def _check_atomic(self, req, params) -> None:
        """A bidirectional image runs in one prefill chunk: it must fit the step's token budget. A CFG shadow
        pair is scheduled without atomic spans, so guidance is refused with such images."""
        budget = self.s.config.max_num_batched_tokens
        longest = max(hi - lo for lo, hi in image_bounds(req, self.family))
        if longest > budget:
            raise InvalidRequestError(
                f"an image of {longest} tokens must run in one step, whose budget is {budget} tokens "
                "(--max-num-batched-tokens): a smaller image, or a larger budget", param="images")
        if req.cfg_scale != 1:
            raise InvalidRequestError("cfg_scale is not supported with images for this model", param="cfg_scale")

    def _positions(self, req) -> tuple[np.ndarray, int] | None:
        """The request's M-RoPE (positions, delta), from `prepare` when it ran."""
        prepared = req.prepared_images
        if isinstance(prepared, Prepared) and prepared.mrope is not None and (
                prepared.mrope[0].shape[1] == len(req.prompt_ids)):   # the prompt prepare saw
            return prepared.mrope
        mrope = self._mrope(req)
        if isinstance(prepared, Prepared):
            prepared.mrope = mrope
        return mrope

    def acquire(self, state) -> None:
        req = state.request
        if not req.images:
            return
        family = self.family
        mrope = self._positions(req) if family.mrope else None
        entries = self.rows.acquire([(image.digest, family.units(image.size)) for image in req.images])
        if entries is None:
            raise EngineError("the image cache is held by running requests' images; retry shortly",
                              code="image_cache_full", status=503)
        prepared, req.prepared_images = req.prepared_images, None   # the pixels live on in the new entries only
        for i, entry in enumerate(entries):
            entry.num_rows = family.num_rows(req.images[i].size)
            if not entry.encoded and entry.pixels is None:   # new: its pixels wait for the encoder
                entry.pixels = (prepared.pixels[i] if isinstance(prepared, Prepared)
                                else family.pixels(req.images[i].pixels))
        src = np.full(len(req.prompt_ids), -1, np.int32)
        src[image_positions(req, family)] = np.concatenate([self.rows.rows(e)[:e.num_rows] for e in entries])
        spans = image_keys(None, req, self.s.vision).spans
        state.ext[self.name] = RequestImages(entries, src, spans, state.seqs, mrope)

    def start(self, seq, state) -> None:
        images = state.ext.get(self.name)
        if images is not None:
            seq.ext[self.name] = images
            seq.ext["image_spans"] = images.spans   # Sequence.cache_key: blocks keyed on their images
            if self.family.bidirectional:   # Sequence.chunk_fit: a prefill chunk never ends inside one
                seq.ext["atomic_spans"] = tuple((lo, hi) for lo, hi, _ in images.spans)

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
        pos = np.zeros((3, num_tokens), np.int32) if self.family.mrope else None
        t = 0
        for c in chunks:
            images = c.seq.ext.get(self.name)
            a = c.seq.num_computed
            if pos is not None:   # a sequence's index + delta (0 without images), the prompt's positions below
                mrope = images.mrope if images is not None else None
                index = np.arange(a, a + c.num_tokens, dtype=np.int32)
                pos[:, t:t + c.num_tokens] = index + (mrope[1] if mrope else 0)
                k = min(c.num_tokens, mrope[0].shape[1] - a) if mrope else 0
                if k > 0:
                    pos[:, t:t + k] = mrope[0][:, a:a + k]
            if images in bad:
                if all(seq.request is not c.seq.request for seq, _ in failed):   # once per request
                    failed.append((c.seq, bad[images]))
            elif images is not None:
                k = min(c.num_tokens, len(images.prompt_src) - a)
                if k > 0:
                    src[t:t + k] = images.prompt_src[a:a + k]
            t += c.num_tokens
        extras = {"embed_src": src} if pos is None else {"embed_src": src, "mrope_positions": pos}
        if self.family.bidirectional:
            extras["key_limit"] = key_limits(chunks, num_tokens)
        return extras

    def _encode(self, due: dict[ImageEntry, list[RequestImages]]) -> dict[RequestImages, BaseException]:
        """Launch the encoder on the due images, all in as few programs as the buckets allow; the requests of a
        failed launch, with its error (their rows run without images and their blocks are never shared)."""
        entries = list(due)
        try:
            self.family.encode(self.s.step_fn, entries, [self.rows.rows(e)[:e.num_rows] for e in entries])
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
