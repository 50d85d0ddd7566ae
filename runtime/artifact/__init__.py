"""hloserve.runtime.artifact: the artifact format, owned by its reader.

    ARTIFACT/
      manifest.json                 Manifest (manifest.py): the source of truth
      weights.safetensors           every weight once, shared by all functions (weights.py)
      functions/NAME.mlir           readable StableHLO
      functions/NAME.mlirbc         StableHLO portable artifact (target version recorded)
      functions/NAME.jax_exported   jax.export serialization (calling convention, shape assertions)

An LLM step artifact also carries a typed, versioned step contract under manifest.model["llm"]
(llm.py: LLMSpec, KVCacheSpec, and the one step packer); an artifact that ships a tokenizer, a typed,
versioned text spec under manifest.model["text"] (text.py: TextSpec). This package needs only the standard library,
numpy and ml_dtypes: the exporter writes through it, the runtime and the server read through it, and
neither torch nor jax is imported to do so. See docs/artifact-format.md.
"""
from . import dtypes, errors, weights
from .errors import ArtifactError, HloserveError, ShapeConstraintError
from .llm import LLM_VERSIONS, STEP_INPUTS, KVCacheSpec, LLMArtifact, LLMSpec, StepBatch, pack_step
from .manifest import (
                       FORMAT_VERSION,
                       MANIFEST,
                       WEIGHTS,
                       FunctionSpec,
                       Manifest,
                       SymbolSpec,
                       TensorSpec,
                       WeightSpec,
                       file_digest,
                       numpy_dtype,
                       read_manifest,
                       verify_files,
                       verify_weights,
                       write_manifest,
)
from .symbols import bind_symbols, concrete_shape, names_in
from .text import TEXT_VERSIONS, TextSpec

__all__ = [
    "ArtifactError", "FORMAT_VERSION", "FunctionSpec", "HloserveError", "KVCacheSpec", "LLMArtifact", "LLMSpec", "LLM_VERSIONS",
    "MANIFEST", "Manifest", "STEP_INPUTS", "ShapeConstraintError", "StepBatch", "SymbolSpec", "TEXT_VERSIONS", "TensorSpec",
    "TextSpec", "WEIGHTS", "WeightSpec", "bind_symbols", "concrete_shape", "dtypes", "errors", "file_digest", "names_in",
    "numpy_dtype", "pack_step", "read_manifest", "verify_files", "verify_weights", "weights", "write_manifest",
]
