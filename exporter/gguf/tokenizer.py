"""Tokenizers and chat templates carried inside GGUF files, as Hugging Face `tokenizers` JSON.

A GGUF has no tokenizer.json: llama.cpp stores the vocabulary, merges, token
types and special ids as metadata (`tokenizer.ggml.*`). `gguf_tokenizer_json`
rebuilds the tokenizer those describe as a `tokenizers.Tokenizer` JSON string,
so the artifact ships a tokenizer.json that the server (and anything else) can
load with `tokenizers.Tokenizer.from_str`.

Supported: `tokenizer.ggml.model == "gpt2"` (byte-level BPE: Llama 3, SmolLM,
Qwen2, Mistral-Nemo, ...). The text split before BPE ("pre-tokenization") is
not stored in the file either, only its name (`tokenizer.ggml.pre`); we map
the names llama.cpp knows to the regexes llama.cpp uses (llama-vocab.cpp),
and reject names we do not know rather than tokenize differently from the model's
training.

`render_chat_template` renders a GGUF/HF chat template (jinja2) the way
transformers' `apply_chat_template` does (sandboxed, trim_blocks, lstrip_blocks).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping, Sequence

from ..errors import SourceError

# GGUF token types (gguf.TokenType); kept as ints so this module does not import gguf.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Splits named by sentinel are built from pre-tokenizers that carry them (see gguf_tokenizer_json).
_GPT2 = "gpt2"                      # ByteLevel(use_regex=True) applies exactly GPT-2's regex
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = "digits+gpt2"   # llama.cpp: "\p{N}" then the GPT-2 regex (= HF Digits(individual) + ByteLevel)

# tokenizer.ggml.pre -> split, as in llama.cpp's llama-vocab.cpp.
PRE_TOKENIZER_SPLITS: Mapping[str, str] = {
    "default": _GPT2, "gpt2": _GPT2, "gpt-2": _GPT2, "olmo": _GPT2, "jais": _GPT2,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "pixtral": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT,
    "tekken": _TEKKEN_SPLIT,
}
# Pre-tokenizer names for which llama.cpp looks a whole pre-token up in the vocabulary before merging
# (its `ignore_merges`, HF BPE's `ignore_merges`): the Llama 3 family.
IGNORE_MERGES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral"})


@dataclasses.dataclass(frozen=True)
class GGUFVocab:
    """The `tokenizer.ggml.*` metadata of a GGUF file.

    Attributes:
      model: tokenizer.ggml.model ("gpt2" = byte-level BPE, "llama" = sentencepiece, ...).
      pre: tokenizer.ggml.pre, the name of the pre-tokenizer split ("smollm", "llama-bpe", ...).
      tokens: token strings by id, as stored (byte-level spelling for normal tokens).
      token_types: GGUF token type by id (1 normal, 3 control, 4 user-defined, ...).
      merges: BPE merges "left right", best first.
      add_bos_token / add_eos_token: whether encoding adds BOS / EOS.
      bos_token_id, eos_token_id, unk_token_id, pad_token_id: special ids or None.
    """
    model: str
    pre: str | None
    tokens: tuple[str, ...]
    token_types: tuple[int, ...]
    merges: tuple[str, ...]
    add_bos_token: bool
    add_eos_token: bool
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None


def gguf_tokenizer_json(vocab: GGUFVocab, *, where: str = "the GGUF file") -> str:
    """A `tokenizers` tokenizer.json string for the vocabulary (byte-level BPE only)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if vocab.model != "gpt2":
        raise SourceError(f"{where}: tokenizer.ggml.model is {vocab.model!r}; only 'gpt2' (byte-level BPE) "
                          f"tokenizers are supported. Export the Hugging Face directory of this model instead, "
                          f"which carries its own tokenizer.json")
    pre = vocab.pre or "default"
    if pre not in PRE_TOKENIZER_SPLITS:
        raise SourceError(f"{where}: tokenizer.ggml.pre {pre!r} names a pre-tokenizer split we do not know "
                          f"(known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}); add its regex from llama.cpp's "
                          f"llama-vocab.cpp to PRE_TOKENIZER_SPLITS in exporter/gguf/tokenizer.py")
    ids: dict[str, int] = {}
    for i, token in enumerate(vocab.tokens):
        ids.setdefault(token, i)  # a duplicated token string keeps its first id, as llama.cpp's lookup does
    merges = []
    for m in vocab.merges:
        left, sep, right = m.partition(" ")
        if not sep:
            raise SourceError(f"{where}: BPE merge {m!r} is not 'left right'")
        merges.append((left, right))
    bpe = models.BPE(vocab=ids, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=pre in IGNORE_MERGES)
    tok = Tokenizer(bpe)
    split = PRE_TOKENIZER_SPLITS[pre]
    if split == _GPT2:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif split == _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()

    # Control tokens (<|im_start|>, ...) match whole in the text and are special (skipped when decoding with
    # skip_special_tokens); user-defined ones match whole but are ordinary text. Both keep their file ids
    # because their strings are already in the BPE vocabulary.
    types = vocab.token_types
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(vocab.tokens, types) if ty == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(vocab.tokens, types) if ty == USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)

    prefix, suffix, specials = [], [], []
    if vocab.add_bos_token and vocab.bos_token_id is not None:
        prefix = [vocab.tokens[vocab.bos_token_id]]
        specials.append((prefix[0], vocab.bos_token_id))
    if vocab.add_eos_token and vocab.eos_token_id is not None:
        suffix = [vocab.tokens[vocab.eos_token_id]]
        specials.append((suffix[0], vocab.eos_token_id))
    tok.post_processor = processors.TemplateProcessing(
        single=prefix + ["$A"] + suffix, pair=prefix + ["$A"] + suffix + prefix + ["$B:1"] + suffix,
        special_tokens=list(dict.fromkeys(specials)))
    text = tok.to_str()
    added = {t["id"]: t["content"] for t in json.loads(text)["added_tokens"]}
    wrong = [(i, c) for i, c in added.items() if ids.get(c) != i]
    if wrong:  # would mean the added-token table renumbered a file token
        raise SourceError(f"{where}: added tokens got ids that differ from the file: {wrong[:5]}")
    return text


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render a chat template like transformers' `apply_chat_template(..., tokenize=False)`.

    `variables` are passed to the template as well (bos_token, eos_token, tools, ...).
    """
    import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                            **variables)
