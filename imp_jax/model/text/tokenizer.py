"""The tokenizer: a HF `tokenizers.Tokenizer` plus the special tokens, BOS/EOS rules and chat templates."""
from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, processors

from imp_jax.errors import ModelLoadError, TemplateError
from imp_jax.model.text.chat_template import _plain, render_chat_template

# Fill-in-the-middle token spellings, as (prefix, suffix, middle): StarCoder/SantaCoder, then Qwen-coder style.
_FIM_SPELLINGS = (
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
)


# Marks a special token's spelling inside client text (after its first character) while a chat is rendered,
# so that only the template's own markup is parsed into control tokens. A Unicode noncharacter.
_ESCAPE = "\ufdd0"
# What encode_chat puts before a text segment that follows a control token, so the tokenizer treats the
# segment as it does in the middle of a prompt (no "first word" prefix space); its id is dropped after.
_ANCHOR = "\ufdd1imp-jax-segment-anchor\ufdd1"


# Inputs longer than this (characters, or ids to decode) go through the tokenizers batch API, which lets go of
# the GIL while Rust works: `encode` holds it throughout (a 786k-token text, ~0.9 s, froze every other thread,
# the server's event loop included). Short inputs keep the plain call, cheaper by the batch's set-up.
GIL_FREE_ABOVE = 4096


def _encode(tok: tokenizers.Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if len(text) > GIL_FREE_ABOVE:
        return tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
    return tok.encode(text, add_special_tokens=add_special_tokens).ids


class Tokenizer:
    """Text <-> token ids with HF transformers' semantics, and chat rendering.

    Takes ownership of `tok`: the named special tokens are registered as special there, and
    its post-processor is aligned with add_bos/add_eos (see `_align_post_processor`).
    """

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool,
        add_eos: bool,
        chat_template: str | dict[str, str] | None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        fim_tokens: dict[str, str] | None = None,
    ):
        self._tok = tok
        self.bos_token, self.eos_token = bos_token, eos_token
        self.pad_token, self.unk_token = pad_token, unk_token
        self._register_special(bos_token, eos_token, pad_token, unk_token)
        self._bos_id = self.token_to_id(bos_token) if bos_token else None
        self._eos_id = self.token_to_id(eos_token) if eos_token else None
        self.add_bos, self.add_eos = self._align_post_processor(add_bos, add_eos)
        self._eos_ids = frozenset(
            [int(i) for i in extra_eos_ids] + ([self._eos_id] if self._eos_id is not None else [])
        )
        self._special_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        ends = [self.token_to_id(t) for t in ("<|return|>", "<|call|>")]
        if all(i is not None and i in self._special_ids for i in ends):
            # harmony (gpt-oss): <|return|> and <|call|> end a reply, <|end|> only one message of it (as llama.cpp)
            self._eos_ids = frozenset(self._eos_ids | set(ends)) - {self.token_to_id("<|end|>")}
        self._byte_fallback_ids = _byte_fallback_ids(tok)
        self._templates = _template_dict(chat_template)
        self._init_boundary()
        if fim_tokens is not None and any(self.token_to_id(t) is None for t in fim_tokens.values()):
            fim_tokens = None
        self.fim_tokens = dict(fim_tokens) if fim_tokens else None

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Load a HF tokenizer directory: tokenizer.json, tokenizer_config.json and the optional extras."""
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"tokenizer file not found: {tok_file}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as e:
            raise ModelLoadError(f"cannot read tokenizer file {tok_file}: {e}") from e
        config = _read_json(root / "tokenizer_config.json")
        special_map = _read_json(root / "special_tokens_map.json")
        generation = _read_json(root / "generation_config.json")

        def special(name: str) -> str | None:
            value = config.get(name)
            return _token_content(value if value is not None else special_map.get(name))

        bos, eos = special("bos_token"), special("eos_token")
        add_bos, add_eos = _added_by_post_processor(tok, bos, eos)
        if not (add_bos or add_eos) and not tok.encode("", add_special_tokens=True).ids:
            # No post-processor adds anything: the config's flags decide (HF Llama/Gemma classes do this).
            add_bos = bool(config.get("add_bos_token", False))
            add_eos = bool(config.get("add_eos_token", False))
        return cls(
            tok,
            bos_token=bos,
            eos_token=eos,
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=_load_chat_templates(root, config),
            pad_token=special("pad_token"),
            unk_token=special("unk_token"),
            extra_eos_ids=_as_ids(generation.get("eos_token_id")),
            fim_tokens=detect_fim_tokens(tok),
        )

    # --- text <-> ids ---

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS/EOS as the model wants (never twice).

        Special-token strings inside `text` (e.g. "<|im_end|>") become their ids, unless parse_special
        is False (llama.cpp's option): then they are tokenized as plain text. A raw prompt is the
        client's own, markup included; a chat is tokenized with `render_chat` + `encode_chat`.
        """
        if parse_special:
            return _encode(self._tok, text, add_special_tokens)
        ids = _encode(self._text_tok, text, add_special_tokens)
        return [i for i in ids if i != self._anchor_id]

    def encode_chat(self, rendered: str) -> list[int]:
        """Token ids of a chat rendered by `render_chat`: the template's markup yields control tokens,
        text from the messages never does (a `<|im_start|>` typed by a user stays text)."""
        if self._special_re is None:
            return _encode(self._tok, rendered.replace(_ESCAPE, ""), False)
        ids: list[int] = []
        at, strip_left = 0, False
        for m in self._special_re.finditer(rendered):
            token = self._specials[m.group()]
            segment = rendered[at:m.start()]
            if strip_left:
                segment = segment.lstrip()
            if token.lstrip:
                segment = segment.rstrip()
            ids += self._encode_segment(segment, first=at == 0)
            ids.append(self._special_ids_by_text[m.group()])
            at, strip_left = m.end(), token.rstrip
        segment = rendered[at:]
        ids += self._encode_segment(segment.lstrip() if strip_left else segment, first=at == 0)
        return ids

    def _encode_segment(self, segment: str, first: bool) -> list[int]:
        """A stretch of rendered chat between control tokens, its escaped specials restored as text."""
        if not segment:
            return []
        segment = self._unescape_re.sub(lambda m: m.group().replace(_ESCAPE, ""), segment)
        if first:
            ids = _encode(self._text_tok, segment, False)
        else:
            ids = _encode(self._text_tok, _ANCHOR + segment, False)
        return [i for i in ids if i != self._anchor_id]

    def _escape(self, value: Any, pattern: re.Pattern[str] | None = None) -> Any:
        """`value` (client data for a template) with every control-token spelling in its strings marked
        (`pattern`: those of the special tokens only)."""
        pattern = pattern or self._special_re
        if isinstance(value, str):
            return pattern.sub(_escape_match, value) if value else value
        if isinstance(value, Mapping):
            return {self._escape(k, pattern): self._escape(v, pattern) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._escape(v, pattern) for v in value]
        return value

    def _escape_message(self, message: Any) -> Any:
        """A message with its control-token spellings marked; an assistant's markup tags (a replayed or
        prefilled `<think>`, `<tool_call>`) are the model's own writing and stay markup, its special
        tokens do not."""
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            return self._escape(message, self._strict_special_re) if self._strict_special_re else message
        return self._escape(message)

    def _init_boundary(self) -> None:
        """The control tokens as a pattern, and a copy of the tokenizer that reads their spellings as text.
        Control tokens: the special added tokens, and the others that are markup (`_is_markup`: DeepSeek's
        `<｜User｜>`, Qwen's `<think>` and `<tool_call>`, a GGUF's USER_DEFINED tags), which the copy marks
        special too, so that its `encode_special_tokens` spells them out."""
        sources = list(self._templates.values())
        specials = {t.content: t for t in self._tok.get_added_tokens_decoder().values()
                    if t.special or _is_markup(t.content, sources)}
        self._specials = specials
        self._special_ids_by_text = {text: self._tok.token_to_id(text) for text in specials}
        alternation = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True))
        self._special_re = re.compile(alternation) if specials else None
        strict = "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True) if specials[t].special)
        self._strict_special_re = re.compile(strict) if strict else None
        escaped = "|".join(re.escape(t[0] + _ESCAPE + t[1:]) for t in sorted(specials, key=len, reverse=True))
        self._unescape_re = re.compile(escaped) if specials else None
        text_tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        text_tok.add_special_tokens([AddedToken(t.content, special=True, normalized=False, lstrip=t.lstrip,
                                                rstrip=t.rstrip, single_word=t.single_word)
                                     for t in specials.values() if not t.special])
        text_tok.encode_special_tokens = True
        text_tok.add_tokens([AddedToken(_ANCHOR, special=False, normalized=False)])
        self._anchor_id = text_tok.token_to_id(_ANCHOR)
        self._text_tok = text_tok

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; special tokens dropped unless skip_special_tokens=False."""
        ids = [int(i) for i in ids]
        if len(ids) > GIL_FREE_ABOVE:   # as `_encode`
            return self._tok.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary string of a token (raw, e.g. 'Ġhello' or '▁hello'), or None."""
        return self._tok.id_to_token(int(token_id))

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary string, or None when it is not in the vocabulary."""
        return self._tok.token_to_id(token)

    # --- special tokens ---

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added tokens included (may be < the model's logits width)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """Every id that ends generation: EOS plus the extra ones (generation_config, GGUF eot/eom)."""
        return self._eos_ids

    @property
    def pad_id(self) -> int | None:
        return self.token_to_id(self.pad_token) if self.pad_token else None

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of the added tokens flagged special: the ones decode(skip_special_tokens=True) drops."""
        return self._special_ids

    @property
    def byte_fallback_ids(self) -> frozenset[int]:
        """Ids of SentencePiece byte tokens ("<0xE4>") when the decoder assembles them (ByteFallback), else empty.

        ByteFallback decodes a whole run of such tokens at once and turns every byte of an
        invalid run into U+FFFD, so text from an unfinished run may still change.
        """
        return self._byte_fallback_ids

    @property
    def has_fim(self) -> bool:
        """Whether fill-in-the-middle prompts can be built (prefix, suffix and middle tokens all known)."""
        return self.fim_tokens is not None

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped `tokenizers.Tokenizer` (for grammar engines that need the raw vocabulary)."""
        return self._tok

    # --- chat ---

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None."""
        return self._templates.get("default")

    @property
    def chat_templates(self) -> Mapping[str, str]:
        """Every named chat template ("default", "tool_use", ...)."""
        return dict(self._templates)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """Render a conversation to prompt text, as transformers does (for display: to tokenize a chat,
        use `render_chat` and `encode_chat`, which keep message text from becoming control tokens).
        Takes `render_chat`'s keyword arguments."""
        rendered = self.render_chat(messages, **kwargs)
        if self._unescape_re is None:
            return rendered
        return self._unescape_re.sub(lambda m: m.group().replace(_ESCAPE, ""), rendered)

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_name: str | None = None,
        **extra_kwargs: Any,
    ) -> str:
        """The chat template's output with special-token spellings in the client's data marked, for
        `encode_chat` (the prompt boundary: docs/SECURITY.md). The template sees bos/eos/pad/unk_token
        and `extra_kwargs` (which override them)."""
        if self._special_re is not None:
            messages = [self._escape_message(m) for m in _plain(messages)]
            tools = self._escape(_plain(tools)) if tools is not None else None
            documents = self._escape(_plain(documents)) if documents is not None else None
            extra_kwargs = self._escape(_plain(extra_kwargs))
        source = self._select_template(template_name, tools)
        variables = {
            name: value
            for name, value in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                ("pad_token", self.pad_token), ("unk_token", self.unk_token))
            if value is not None
        }
        variables.update(extra_kwargs)
        return render_chat_template(
            source, messages, add_generation_prompt=add_generation_prompt, tools=tools,
            documents=documents, continue_final_message=continue_final_message, variables=variables,
        )

    def _select_template(self, name: str | None, tools: Sequence[Any] | None) -> str:
        """HF's choice: a named template, else "tool_use" when tools are given and it exists, else "default"."""
        if not self._templates:
            raise TemplateError("model has no chat template")
        if name is not None:
            if name not in self._templates:
                raise TemplateError(f"unknown chat template {name!r}; the model has {sorted(self._templates)}")
            return self._templates[name]
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        raise TemplateError(f"model has several chat templates and no default: {sorted(self._templates)}")

    # --- construction helpers ---

    def _register_special(self, *tokens: str | None) -> None:
        """Mark the named special tokens special (so decode can skip them), as HF does; unknown ones are ignored."""
        added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
        new = [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(tokens)
               if t and t not in added and self._tok.token_to_id(t) is not None]
        if new:
            self._tok.add_special_tokens(new)

    def _align_post_processor(self, add_bos: bool, add_eos: bool) -> tuple[bool, bool]:
        """Make encode(add_special_tokens=True) add exactly the BOS/EOS asked for; return what it now adds.

        A post-processor that adds other tokens (BERT's [CLS] ... [SEP]) is kept as it is.
        """
        bos, eos = self._bos_id, self._eos_id
        want = ([bos] if add_bos and bos is not None else []) + ([eos] if add_eos and eos is not None else [])
        added = self._tok.encode("", add_special_tokens=True).ids
        if added != want and set(added) <= {bos, eos}:
            parts, specials = ["$A:0"], {}
            if add_bos and bos is not None:
                parts.insert(0, f"{self.bos_token}:0")
                specials[self.bos_token] = bos
            if add_eos and eos is not None:
                parts.append(f"{self.eos_token}:0")
                specials[self.eos_token] = eos
            single = " ".join(parts)
            pair = single + " " + " ".join(p.replace("$A", "$B").replace(":0", ":1") for p in parts)
            self._tok.post_processor = processors.TemplateProcessing(
                single=single, pair=pair, special_tokens=list(specials.items())
            )
        return _added_by_post_processor(self._tok, self.bos_token, self.eos_token)


def _is_markup(token: str, templates: Sequence[str]) -> bool:
    """Whether a non-special added token is markup the prompt boundary keeps out of client text: spelled
    as a tag (`<think>`, `<｜User｜>`, `[INST]`) or written by a chat template. Runs of spaces and word
    pieces some vocabularies add (Phi's, GPT-NeoX's) are text and stay as they tokenize."""
    if len(token) < 3 or any(c.isspace() for c in token):
        return False
    return (token[0] in "<[" and token[-1] in ">]") or any(token in source for source in templates)


def _escape_match(m: re.Match[str]) -> str:
    text = m.group()
    return text[0] + _ESCAPE + text[1:]


def detect_fim_tokens(tok: tokenizers.Tokenizer) -> dict[str, str] | None:
    """FIM tokens found by name in the vocabulary, as {"prefix", "suffix", "middle"}, or None."""
    for spelling in _FIM_SPELLINGS:
        if all(tok.token_to_id(t) is not None for t in spelling):
            return dict(zip(("prefix", "suffix", "middle"), spelling))
    return None


def _added_by_post_processor(tok: tokenizers.Tokenizer, bos: str | None, eos: str | None) -> tuple[bool, bool]:
    """Whether encode(add_special_tokens=True) puts BOS first / EOS last (probed on empty text)."""
    added = tok.encode("", add_special_tokens=True).ids
    bos_id = tok.token_to_id(bos) if bos else None
    eos_id = tok.token_to_id(eos) if eos else None
    adds_bos = bos_id is not None and added[:1] == [bos_id]
    rest = added[1:] if adds_bos else added
    adds_eos = eos_id is not None and rest[-1:] == [eos_id]
    return adds_bos, adds_eos


def _byte_fallback_ids(tok: tokenizers.Tokenizer) -> frozenset[int]:
    """The "<0xXX>" token ids, if the decoder has a ByteFallback step."""
    if tok.decoder is None or not _has_decoder(json.loads(tok.decoder.__getstate__()), "ByteFallback"):
        return frozenset()
    ids = (tok.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


def _has_decoder(config: Any, kind: str) -> bool:
    """Whether a serialized decoder (possibly a Sequence) contains a step of type `kind`."""
    if isinstance(config, dict):
        return config.get("type") == kind or any(_has_decoder(v, kind) for v in config.values())
    if isinstance(config, list):
        return any(_has_decoder(v, kind) for v in config)
    return False


def _template_dict(chat_template: str | dict[str, str] | None) -> dict[str, str]:
    """Named templates; a single string is the "default" one."""
    if not chat_template:
        return {}
    if isinstance(chat_template, str):
        return {"default": chat_template}
    return {name: source for name, source in chat_template.items() if source}


def _load_chat_templates(root: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """Chat templates of a HF directory; standalone files (chat_template.jinja, ...) win over the config (as HF)."""
    files: dict[str, str] = {}
    legacy = _read_json(root / "chat_template.json").get("chat_template")
    if isinstance(legacy, str):
        files["default"] = legacy
    if (root / "chat_template.jinja").is_file():
        files["default"] = (root / "chat_template.jinja").read_text(encoding="utf-8")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            files[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    templates = files
    if not templates:
        value = config.get("chat_template")
        if isinstance(value, str):
            templates = {"default": value}
        elif isinstance(value, list):
            templates = {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t}
    if not templates:
        return None
    return templates["default"] if list(templates) == ["default"] else templates


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from an optional file: {} when absent, ModelLoadError when unreadable."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return value


def _token_content(value: Any) -> str | None:
    """A special token from a config: a string or an AddedToken dict {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _as_ids(value: Any) -> list[int]:
    """generation_config's eos_token_id: an int, a list of ints, or absent."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
