"""Grammars for structured output: what a request's output must match (`GrammarSpec`), compiled
against the model's tokenizer (`Grammars`, llguidance) into one matcher per request (`Matcher`).

    grammars = Grammars(tokenizer_json, vocab_size, eos_ids)     # one per server
    matcher = grammars.matcher(GrammarSpec("json_schema", schema_text))   # per request; ValueError if bad
    matcher.allowed()      # bool[vocab]: the tokens that keep the output inside the grammar
    matcher.accept(token)  # after sampling
    matcher.done           # the grammar is complete (only EOS remains)

llguidance computes a step's mask in tens of microseconds (an Earley parser over the token trie,
no per-vocabulary Python loop), so masks are computed per step on the engine's loop thread by
its structured-output manager (server/core/structured_output.py, between scheduling and
execution) and applied to that row only: the other rows of the batch are not held up. The
request side names the spec, the engine side the manager (vLLM's StructuredOutputManager), so the
two never share a name. Chosen over xgrammar (its wheel requires torch, which the server never
imports) and outlines-core (compiles a regex index per schema up front: seconds for a nested
schema on a 49k vocabulary, against llguidance's lazy masks).
"""
from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Sequence

import numpy as np

KINDS = ("json", "json_schema", "regex", "choice", "grammar")
# JSON is written as json.dumps writes it: ", " and ": " between items, no other whitespace (a model
# that may put whitespace anywhere can spend its whole budget on newlines). A schema's own
# "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclasses.dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    kind: "json" (any JSON object: response_format json_object), "json_schema" (spec: the schema
      as JSON text), "regex" (spec: a regular expression), "choice" (spec: a JSON list of strings,
      the output is exactly one of them), "grammar" (spec: a Lark grammar, llguidance's dialect).
    """
    kind: str
    spec: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind {self.kind!r} is not one of {', '.join(KINDS)}")


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, matcher, vocab_size: int):
        self._m = matcher
        self._vocab = vocab_size

    def allowed(self) -> np.ndarray:
        """bool[vocab]: tokens the grammar allows next."""
        bits = np.frombuffer(self._m.compute_bitmask(), np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self._vocab].astype(bool)

    def accept(self, token: int) -> None:
        self._m.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar is complete (or failed): nothing but EOS may follow."""
        return self._m.is_stopped() or self._m.is_error()


class Grammars:
    """Compiles structured-output specs against one tokenizer (built on first use: ~1 s)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int]):
        self._json = tokenizer_json
        self._vocab = vocab_size
        self._eos = [e for e in eos_token_ids if 0 <= e < vocab_size]   # ids past the vocabulary never come
        self._tok = None
        self._error: str | None = None
        self._lock = threading.Lock()

    def _tokenizer(self):
        with self._lock:
            if self._error is not None:
                raise ValueError(f"structured output is unavailable for this model: {self._error}")
            if self._tok is None:
                import llguidance
                try:
                    self._tok = llguidance.LLTokenizer(self._json, n_vocab=self._vocab,
                                                       eos_token=self._eos[0] if self._eos else None)
                except Exception as e:  # noqa: BLE001 - llguidance's own errors; the model still serves
                    self._error = f"its tokenizer cannot drive a grammar ({type(e).__name__}: {e})"
                    raise ValueError(f"structured output is unavailable for this model: {self._error}") from None
            return self._tok

    def prepare(self) -> str | None:
        """Build the grammar tokenizer now (server start) rather than on the first request; returns
        why structured output is unavailable, or None."""
        try:
            self._tokenizer()
        except ValueError as e:
            return str(e)
        return None

    def grammar(self, spec: GrammarSpec) -> str:
        """The llguidance grammar of `spec`; ValueError naming the problem."""
        import llguidance
        m = llguidance.LLMatcher
        try:
            if spec.kind == "json":
                return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if spec.kind == "json_schema":
                schema = json.loads(spec.spec)
                if not isinstance(schema, dict):
                    raise ValueError("the JSON schema must be an object")
                return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if spec.kind == "regex":
                re.compile(spec.spec)
                return m.grammar_from_regex(spec.spec)
            if spec.kind == "choice":
                choices = json.loads(spec.spec)
                if not (isinstance(choices, list) and choices and all(isinstance(c, str) for c in choices)):
                    raise ValueError("choices must be a non-empty list of strings")
                return m.grammar_from_regex("|".join(f"({re.escape(c)})" for c in choices))
            return m.grammar_from_lark(spec.spec)
        except (ValueError, TypeError, re.error) as e:
            raise ValueError(f"{spec.kind}: {e}") from None
        except Exception as e:  # noqa: BLE001 - llguidance raises its own errors for bad grammars
            raise ValueError(f"{spec.kind}: {e}") from None

    def matcher(self, spec: GrammarSpec) -> Matcher:
        """A fresh matcher for one request; ValueError when the spec is not a valid grammar."""
        import llguidance
        grammar = self.grammar(spec)
        tok = self._tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise ValueError(f"{spec.kind}: {error.strip().splitlines()[0][:300]}")
        m = llguidance.LLMatcher(tok, grammar)
        if m.is_error():
            raise ValueError(f"{spec.kind}: {m.get_error()[:300]}")
        return Matcher(m, self._vocab)
