"""Tokenizer: incremental detokenization on SmolLM2's real byte-level BPE, chat templates vs transformers."""
from __future__ import annotations

import dataclasses
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hloserve.runtime.artifact import ArtifactError, TextSpec
from hloserve.server.text.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer


@pytest.fixture(scope="module")
def smollm_files(tmp_path_factory):
    """SmolLM2-135M-Instruct's tokenizer.json and chat template, rebuilt from the GGUF preset."""
    from hloserve.exporter import presets
    from hloserve.exporter.gguf.checkpoint import load_gguf
    ckpt = load_gguf(presets.resolve("smollm2-135m-instruct", quiet=True))
    d = tmp_path_factory.mktemp("smollm-tok")
    with open(d / "tokenizer.json", "w") as f:
        f.write(ckpt.tokenizer_json)
    text = TextSpec(tokenizer="tokenizer.json", chat_template=ckpt.chat_template, add_bos_token=False)
    return str(d), text, {"bos_token_id": ckpt.special_tokens.bos_token_id,
                          "eos_token_ids": (ckpt.special_tokens.eos_token_id,)}


def _tokenizer(path: str, text: TextSpec, ids: dict) -> Tokenizer:
    with open(text.tokenizer_path(path), encoding="utf-8") as f:
        return Tokenizer.from_json(f.read(), text, **ids)


@pytest.fixture(scope="module")
def tok(smollm_files):
    return _tokenizer(*smollm_files)


TEXTS = [
    "Hello, world! How are you?",
    "héllo wörld — naïve café",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "中文字符测试，日本語のテキスト",
    "  leading spaces\n\ttabs and\nnewlines  ",
    "mixed: ½ € ™ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok",
]


def _stream(tok, ids, prompt=()):
    d = IncrementalDetokenizer(tok, list(prompt))
    deltas = [d.step(t) for t in ids]
    return deltas, d.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode_and_never_splits_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert tail == ""
    if any(ord(c) > 0xFFFF for c in text):   # 4-byte characters span several byte-level tokens
        assert "" in deltas                  # ... so some steps emitted nothing while waiting


def test_prompt_context_keeps_leading_spaces(tok):
    prompt = tok.encode("The answer is", add_special_tokens=False)
    gen = tok.encode(" forty two", add_special_tokens=False)
    deltas, _ = _stream(tok, gen, prompt)
    assert "".join(deltas) == " forty two"


def test_special_tokens_are_skipped(tok):
    eos = tok.eos_token_ids[0]
    ids = tok.encode("hi", add_special_tokens=False) + [eos]
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == "hi"


def test_incomplete_bytes_are_flushed_at_the_end(tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    deltas, tail = _stream(tok, ids[:-1])        # the character never completes
    assert "".join(deltas) == "" and tail == tok.decode(ids[:-1])


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40))
def test_incremental_matches_full_decode_on_random_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    deltas, tail = _stream(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)


def test_chat_template_matches_transformers(tok, smollm_files):
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    path, text, _ = smollm_files
    ref = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_file(os.path.join(path, "tokenizer.json")),
                                  bos_token=tok.config.bos_token, eos_token=tok.config.eos_token)
    ref.chat_template = text.chat_template
    for msgs in ([{"role": "user", "content": "What is 2+2?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye ☃"}]):
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert tok.render_chat(msgs, add_generation_prompt=gen) == want
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids == ref.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, add_generation_prompt=True,
                                          return_dict=False)


def test_special_tokens_come_from_the_ids_and_the_text_spec(tok):
    assert tok.eos_token_ids == (2,)
    assert tok.config.eos_token == "<|im_end|>" and tok.config.bos_token == "<|im_start|>"
    assert tok.config.add_bos is False and tok.vocab_size == 49152


def test_chat_template_errors(tmp_path, smollm_files):
    path, text, ids = smollm_files
    plain = _tokenizer(path, dataclasses.replace(text, chat_template=None), ids)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        plain.render_chat([{"role": "user", "content": "x"}])
    strict = _tokenizer(path, dataclasses.replace(text, chat_template=
                        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
                        "{% endif %}{{ messages[0]['content'] }}"), ids)
    with pytest.raises(ChatTemplateError, match="first must be user"):
        strict.render_chat([{"role": "system", "content": "x"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\] must be an object with a 'role'"):
        strict.render_chat([{"content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        _tokenizer(path, dataclasses.replace(text, chat_template="{% for %}"), ids)
    with pytest.raises(ArtifactError, match=r"its tokenizer tokenizer.json \(model.text.tokenizer\) is missing; re-export"):
        text.tokenizer_path(str(tmp_path))
    assert TextSpec.from_json(json.loads(json.dumps(text.to_json()))) == text   # the spec is plain JSON, as stored