"""The text side of an artifact: manifest.model["text"], typed and versioned.

What a server needs, beside the weights and functions, to turn text into token ids and back: which
file of the artifact is the tokenizer, the chat template, and whether a raw prompt gets the
tokenizer's special tokens (Hugging Face's `add_bos_token`). The exporter builds one TextSpec from
the checkpoint's files (exporter/llm/hf_files.py `text_spec`), keeps it typed until the artifact is
written (`to_json`), and every reader types it once (`TextSpec.of`).

    text = TextSpec.of(manifest, path)       # ArtifactError naming the field when it is malformed
    tokenizer_json = text.tokenizer_path(path)   # None: the artifact ships no tokenizer

An LLM's BOS and EOS ids are not here: they are the step contract's (llm.py, LLMSpec.bos_token_id and
eos_token_ids), which the scheduler stops on with or without a tokenizer. Its recommended sampling is
generation_config.json (generation.py), read as vLLM reads a checkpoint's.

Versions (a reader must understand every field of the versions it accepts):
  1  2026-11  {"version": 1, "tokenizer", "chat_template", "add_bos_token"} under model["text"].
              Manifests written before it carry the same fields at the top of `model`
              (model["tokenizer"], model["chat_template"], model["add_bos_token"]); they read as
              version 1, an encoder's without "tokenizer" naming tokenizer.json where model["files"]
              lists it.
  (next: add a dated line here and raise TEXT_VERSIONS' upper bound in the same change)
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

from .errors import ArtifactError
from .manifest import Manifest

TEXT_VERSIONS = range(1, 2)            # the versions this reader accepts
TEXT_VERSION = TEXT_VERSIONS.stop - 1  # the version writers produce
TOKENIZER = "tokenizer.json"           # the tokenizer file every exporter copies (a `tokenizers` JSON)
FIELDS = ("version", "tokenizer", "chat_template", "add_bos_token")
DOC = "docs/artifact-format.md, 'Text'"
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextSpec:
    """How an artifact's text is tokenized and templated (manifest.model["text"]).

    Attributes:
      version: the spec's version (module docstring); readers accept TEXT_VERSIONS.
      tokenizer: the tokenizer file in the artifact directory (a `tokenizers` tokenizer.json), or None
        when the artifact ships none (it then serves token ids only: the predict API).
      chat_template: the checkpoint's jinja2 chat template (Hugging Face's convention), or None.
      add_bos_token: whether encoding a raw prompt adds the tokenizer's special tokens (a chat prompt
        never does: its template writes them).
    """
    version: int = TEXT_VERSION
    tokenizer: str | None = None
    chat_template: str | None = None
    add_bos_token: bool = True

    def to_json(self) -> dict:
        return {"version": self.version, "tokenizer": self.tokenizer, "chat_template": self.chat_template,
                "add_bos_token": self.add_bos_token}

    @classmethod
    def from_json(cls, raw: Any, where: str = "model.text") -> "TextSpec":
        """Validate and type a stored model["text"]; every problem is an ArtifactError naming the field."""
        if not isinstance(raw, Mapping):
            raise ArtifactError(f"{where} is {type(raw).__name__ if raw is not None else 'null'}, not an object; the "
                                f"artifact is corrupted, re-export it ({DOC})")
        version = raw.get("version")
        if version is None:
            raise ArtifactError(f"{where} has no 'version'; the artifact was written by an incompatible exporter, "
                                f"re-export it ({DOC})")
        if not isinstance(version, int) or isinstance(version, bool) or version not in TEXT_VERSIONS:
            raise ArtifactError(f"{where}: text spec version {str(version)[:20]} is outside the supported range "
                                f"[{TEXT_VERSIONS.start}..{TEXT_VERSIONS.stop - 1}]; upgrade hloserve or re-export ({DOC})")
        unknown = sorted(set(raw) - set(FIELDS))
        if unknown:
            raise ArtifactError(f"{where} has fields {unknown[:3]} that text spec version {version} does not define; "
                                f"the artifact was written by an incompatible exporter, re-export it ({DOC})")
        return cls._checked(raw, where, version=version)

    @classmethod
    def _checked(cls, raw: Mapping[str, Any], where: str, **given: Any) -> "TextSpec":
        """A TextSpec of the stored fields of `raw` (missing ones take their defaults), each checked."""
        fields = {k: raw[k] for k in FIELDS[1:] if k in raw}
        tok, template = fields.get("tokenizer"), fields.get("chat_template")
        if tok is not None and (not isinstance(tok, str) or not _FILE_NAME.fullmatch(tok)):
            raise ArtifactError(f"{where}.tokenizer = {str(tok)[:40]!r} must be a file name in the artifact "
                                f"({TOKENIZER}) or null; re-export it ({DOC})")
        if template is not None and not isinstance(template, str):
            raise ArtifactError(f"{where}.chat_template must be a jinja2 template (a string) or null, not "
                                f"{type(template).__name__}; re-export it ({DOC})")
        if not isinstance(fields.get("add_bos_token", True), bool):
            raise ArtifactError(f"{where}.add_bos_token = {str(fields['add_bos_token'])[:20]} must be true or false; "
                                f"re-export it ({DOC})")
        return cls(**fields, **given)

    @classmethod
    def of(cls, manifest: Manifest, path: str) -> "TextSpec":
        """The typed text spec of a manifest: model["text"], or, in a manifest written before it
        existed, the same fields at the top of `model` (version 1)."""
        model = manifest.model
        if "text" in model:
            return cls.from_json(model["text"], f"{path}: model.text")
        legacy = {k: model[k] for k in FIELDS[1:] if k in model}
        if "tokenizer" not in legacy:    # an encoder's manifest named no tokenizer: the file it copied
            legacy["tokenizer"] = TOKENIZER if TOKENIZER in (model.get("files") or ()) else None
        return cls._checked(legacy, f"{path}: model")

    def tokenizer_path(self, artifact_dir: str) -> str | None:
        """The tokenizer file's path in `artifact_dir`, or None when the artifact ships none;
        ArtifactError when the spec names a file that is missing."""
        if self.tokenizer is None:
            return None
        path = os.path.join(artifact_dir, self.tokenizer)
        if not os.path.isfile(path):
            raise ArtifactError(f"artifact {artifact_dir}: its tokenizer {self.tokenizer} (model.text.tokenizer) is "
                                f"missing; re-export the artifact")
        return path
