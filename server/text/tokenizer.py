"""Tokenizer for serving: encode, incremental detokenization, chat templates.

Text comes from the artifact: `tokenizer.json` (the `tokenizers` library,
no transformers) and the chat template of its TextSpec (manifest.model["text"],
runtime/artifact/text.py), rendered with jinja2 in a sandbox the way HF renders it.

Incremental detokenization: a token can be part of a character (byte-level
BPE splits UTF-8 sequences) and a token's leading space depends on the token
before it. So each step decodes a small window `tokens[prefix_offset:]`,
compares it with the window's already-emitted part `tokens[prefix_offset:read_offset]`
and emits only the new suffix, holding it back while it ends in an
incomplete character (U+FFFD). Cost per token is constant.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
from typing import Any, Mapping, Protocol, Sequence

from hloserve.runtime.artifact.llm import LLMArtifact
from hloserve.runtime.artifact.text import TextSpec

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens kept as left context for the first decode


class Decoder(Protocol):
    """What the scheduler needs from a tokenizer: ids -> text."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Streams the text of generated tokens without splitting characters.

    Usage: `delta = d.step(token_id)` per generated token; `d.flush()` at the
    end returns any held-back tail (e.g. bytes that never completed a character).
    `d.text` is everything emitted so far.
    """

    def __init__(self, decoder: Decoder, prompt_ids: Sequence[int] = (), *, skip_special_tokens: bool = True):
        self._decoder = decoder
        self._skip = skip_special_tokens
        ctx = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._tokens = ctx
        self._prefix_offset = 0          # start of the decode window
        self._read_offset = len(ctx)     # tokens before this are already emitted (or are context)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self._skip)

    def step(self, token_id: int) -> str:
        self._tokens.append(int(token_id))
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new yet, or an incomplete character: wait for more tokens
        delta = full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        if self._prefix_offset > 64:  # keep the buffer bounded
            drop = self._prefix_offset
            self._tokens = self._tokens[drop:]
            self._prefix_offset, self._read_offset = 0, self._read_offset - drop
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit what is held back (called once, when the request finishes)."""
        prefix = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset:])
        delta = full[len(prefix):] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text += delta
        return delta


class ChatTemplateError(ValueError):
    """The chat template failed to render (bad messages or template); the message says which."""


def _render_env():
    from jinja2 import ext, sandbox

    def raise_exception(message):
        raise ChatTemplateError(f"chat template rejected the messages: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    """What the server needs besides tokenizer.json: the artifact's TextSpec and its special tokens.

    Attributes:
      chat_template: jinja2 source (HF convention), or None if the model has none.
      bos_token / eos_token: strings the template may reference.
      eos_token_ids: ids that end generation (unless SamplingParams.ignore_eos).
      add_bos: whether `encode` of a raw prompt should add special tokens.
    """
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    add_bos: bool = True


class Tokenizer:
    """tokenizers.Tokenizer + chat template + EOS ids.

    Attributes:
      tokenizer_json: the tokenizer.json text it was built from (structured output's grammars are
        compiled against the same text, so the file is read once), or None.
    """

    def __init__(self, tokenizer, config: TokenizerConfig = TokenizerConfig(), *, tokenizer_json: str | None = None):
        self._tok = tokenizer
        self.config = config
        self.tokenizer_json = tokenizer_json
        self._template = None
        if config.chat_template:
            try:
                self._template = _render_env().from_string(config.chat_template)
            except Exception as e:  # noqa: BLE001 (jinja2 TemplateSyntaxError and friends)
                raise ChatTemplateError(f"the model's chat template does not parse: {e}") from e

    @classmethod
    def from_json(cls, tokenizer_json: str, text: TextSpec, *, bos_token_id: int | None = None,
                  eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        """Build from a tokenizer.json's text, the artifact's TextSpec (chat template, add_bos_token)
        and the special ids (an LLM's: LLMSpec.bos_token_id and eos_token_ids)."""
        import tokenizers
        tok = tokenizers.Tokenizer.from_str(tokenizer_json)
        eos = tuple(int(e) for e in eos_token_ids)
        config = TokenizerConfig(
            chat_template=text.chat_template,
            bos_token=tok.id_to_token(int(bos_token_id)) if bos_token_id is not None else None,
            eos_token=tok.id_to_token(eos[0]) if eos else None,
            eos_token_ids=eos, add_bos=text.add_bos_token)
        return cls(tok, config, tokenizer_json=tokenizer_json)

    @classmethod
    def from_artifact(cls, art: LLMArtifact) -> "Tokenizer | None":
        """The tokenizer of an LLM artifact read once (its TextSpec names the file; BOS and EOS ids are
        its LLMSpec's), or None when it ships none; ArtifactError when the named file is missing."""
        path = art.text.tokenizer_path(art.path)
        if path is None:
            return None
        with open(path, encoding="utf-8") as f:
            return cls.from_json(f.read(), art.text, bos_token_id=art.llm.bos_token_id,
                                 eos_token_ids=art.llm.eos_token_ids)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocab_digest(self) -> str:
        """A short digest of the token -> id map, added tokens included: two tokenizers that encode and
        decode alike share it (a draft model's is checked against its target's)."""
        import hashlib
        vocab = sorted(self._tok.get_vocab(with_added_tokens=True).items())
        return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:12]

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids

    def encode(self, text: str, *, add_special_tokens: bool | None = None) -> list[int]:
        add = self.config.add_bos if add_special_tokens is None else add_special_tokens
        return list(self._tok.encode(text, add_special_tokens=add).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    variables: Mapping[str, Any] | None = None) -> str:
        """Render OpenAI-style messages with the model's chat template."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template in its artifact metadata; "
                                    "use /v1/completions with a raw prompt instead")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ChatTemplateError(f"messages[{i}] must be an object with a 'role' (and 'content')")
        # the caller's template variables (a request's chat_template_kwargs, its tools) may set
        # add_generation_prompt; the messages and special tokens are always the ones given here
        context = {"add_generation_prompt": add_generation_prompt, **(variables or {}), "messages": [dict(m) for m in messages],
                   "bos_token": self.config.bos_token or "", "eos_token": self.config.eos_token or ""}
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as e:  # noqa: BLE001 (a template error is a bad request, not a crash)
            raise ChatTemplateError(f"chat template failed to render the messages: {type(e).__name__}: {e}") from e

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                    variables: Mapping[str, Any] | None = None) -> list[int]:
        """Chat prompt ids: the template already writes BOS, so no special tokens are added."""
        return self.encode(self.render_chat(messages, add_generation_prompt=add_generation_prompt, variables=variables),
                           add_special_tokens=False)
