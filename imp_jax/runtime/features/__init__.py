"""The decoding features the engine loop runs, in the order it calls their hooks (features/base.py).

Order matters where one feature reads another's state: an adapter before CFG (a shadow shares its
slot) and scoring (scored under it); the think tracker before the grammar (a forced end's mask wins,
the grammar applies to the answer only) and before anything reading a token's kind. Adding a feature:
write its module, add its class here.
"""
from __future__ import annotations

from imp_jax.runtime.features.banned import BannedFeature
from imp_jax.runtime.features.base import Accepted, EndSequence, Feature, Services
from imp_jax.runtime.features.cfg import CfgFeature
from imp_jax.runtime.features.dry import DryFeature
from imp_jax.runtime.features.grammar import GrammarFeature
from imp_jax.runtime.features.images import ImagesFeature
from imp_jax.runtime.features.lens import LensFeature
from imp_jax.runtime.features.lora import AdapterFeature
from imp_jax.runtime.features.mirostat import MirostatFeature
from imp_jax.runtime.features.probes import ProbesFeature
from imp_jax.runtime.features.scoring import ScoringFeature
from imp_jax.runtime.features.speculation import SpeculationFeature
from imp_jax.runtime.features.think import ThinkFeature

FEATURES: tuple[type[Feature], ...] = (
    AdapterFeature, ThinkFeature, GrammarFeature, BannedFeature, DryFeature, MirostatFeature, CfgFeature,
    ProbesFeature, LensFeature, SpeculationFeature, ScoringFeature, ImagesFeature,
)


def speculation_allowed(params, request) -> bool:
    """Whether a request's sequences may draft: it does not opt out, and no feature it uses makes a row's
    processing depend on host state the drafts before it would have to update first."""
    if request.speculative is False:
        return False
    return all(f.drafts_ok or not f.active(request, params) for f in FEATURES)


__all__ = ["FEATURES", "Accepted", "EndSequence", "Feature", "Services", "speculation_allowed"]
