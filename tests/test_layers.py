"""The package graph is one-directional: every import of every module (function-level and
TYPE_CHECKING ones included) is checked against the table in docs/architecture.md ("Who owns what").

    runtime.artifact  <-  runtime  <-  server
           ^    ^-------- quantization <- exporter
           '------------------------------'
    server.cli: the composition root, the one module that knows every package.
"""
from __future__ import annotations

import ast
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {"exporter": "hloserve.exporter", "runtime": "hloserve.runtime", "server": "hloserve.server",
            "quantization": "hloserve.quantization"}
HEAVY = {"torch", "transformers", "tensorflow", "gguf"}
WEB = {"fastapi", "starlette", "uvicorn"}

# the OpenAI wire models: shared (protocol), then one module per API (docs/architecture.md, "Where a new API goes")
WIRE = tuple(f"hloserve.server.http.{m}" for m in ("protocol", "completions_protocol", "chat_protocol",
                                                     "responses_protocol", "tokenization_protocol", "embeddings_protocol",
                                                     "lora_protocol"))
# importer prefix (most specific first) -> (hloserve modules it may import, third-party tops it may not)
RULES = [
    ("hloserve.server.cli", ("hloserve",), set()),
    ("hloserve.runtime.artifact", ("hloserve.runtime.artifact",), HEAVY | WEB | {"jax", "jaxlib"}),
    ("hloserve.runtime", ("hloserve.runtime",), HEAVY | WEB),
    ("hloserve.quantization", ("hloserve.quantization", "hloserve.runtime.artifact"), WEB | {"jax", "jaxlib"}),
    ("hloserve.exporter", ("hloserve.exporter", "hloserve.quantization", "hloserve.runtime.artifact",
                           "hloserve.runtime.progress", "hloserve.runtime.paths"), WEB),
    ("hloserve.server.core.scheduler", ("hloserve.server.core.outputs", "hloserve.server.core.sampling",
                                        "hloserve.server.core.block_manager", "hloserve.server.core.spec_decode",
                                        "hloserve.server.core.request"),
     HEAVY | WEB | {"jax"}),
    # the request the scheduler keeps, and the context rule: host-only records
    ("hloserve.server.core.request", ("hloserve.server.core.sampling", "hloserve.server.core.spec_decode"),
     HEAVY | WEB | {"jax"}),
    # speculative decoding's config, proposer and counters: policy the scheduler reads, host-only
    ("hloserve.server.core.spec_decode", ("hloserve.server.core.sampling", "hloserve.runtime.artifact.errors"),
     HEAVY | WEB | {"jax"}),
    ("hloserve.server.core.block_manager", (), HEAVY | WEB | {"jax"}),
    # the prefix cache's host and disk tiers: numpy and files, no device
    ("hloserve.server.core.kv_tiers", ("hloserve.runtime.paths",), HEAVY | WEB | {"jax"}),
    ("hloserve.server.core", ("hloserve.server.core", "hloserve.server.text", "hloserve.runtime"), HEAVY | WEB),
    ("hloserve.server.text", ("hloserve.server.text", "hloserve.runtime.artifact"), HEAVY | WEB | {"jax"}),
    # TF Serving's predict semantics: shared by http/ and grpc/, so it may use neither the web stack nor a route
    ("hloserve.server.predict", ("hloserve.server.http.errors", "hloserve.server.services", "hloserve.runtime"),
     HEAVY | WEB | {"grpc"}),
    # an API's wire models (pydantic): no web framework, nothing of the serving path below them
    *[(m, WIRE + ("hloserve.server.http.tools", "hloserve.server.text.grammar"), HEAVY | WEB)
      for m in WIRE],
    ("hloserve.server.http", ("hloserve.server", "hloserve.runtime"), HEAVY),
    ("hloserve.server.grpc", ("hloserve.server", "hloserve.runtime"), HEAVY | WEB),
    ("hloserve.server.serve", ("hloserve.server", "hloserve.runtime"), HEAVY),
    ("hloserve.server", ("hloserve.server", "hloserve.runtime"), HEAVY | WEB),
]
# quantization's torch is confined to the modules that define the torch side
TORCH_FREE = ("hloserve.quantization.schemes", "hloserve.quantization.primitives")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((REPO / folder).rglob("*.py")):
            parts = f.relative_to(REPO / folder).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join((pkg, *parts))] = f
    return out


MODULES = modules()


def imports(name: str, path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import statement in the file, anywhere in it."""
    return _imports_of(name, path, ast.parse(path.read_text()))


def _imports_of(name: str, path: pathlib.Path, tree: ast.AST) -> list[tuple[int, str]]:
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[:len(name.split(".")) - node.level + (1 if is_pkg else 0)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            for a in node.names:   # `from pkg import submodule` is an edge to the submodule
                sub = f"{mod}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else mod))
    return out


def rule(importer: str):
    return next(r for r in RULES if importer == r[0] or importer.startswith(r[0] + "."))


def violations() -> list[str]:
    bad = []
    for name, path in MODULES.items():
        prefix, allowed, forbidden = rule(name)
        for line, mod in imports(name, path):
            top = mod.split(".")[0]
            where = f"{os.path.relpath(path, REPO)}:{line} ({name} imports {mod})"
            if top == "hloserve":
                if not any(mod == a or mod.startswith(a + ".") for a in allowed):
                    bad.append(f"{where}: {prefix} may import only {', '.join(allowed)}")
            elif top in forbidden or (name in TORCH_FREE and top == "torch"):
                bad.append(f"{where}: {prefix} may not import {top}")
    return bad


def test_every_module_is_covered_by_a_rule():
    assert len(MODULES) > 60
    for name in MODULES:
        assert rule(name)


def test_package_graph_is_one_directional():
    bad = violations()
    assert not bad, "forbidden imports (docs/architecture.md, 'Who owns what'):\n" + "\n".join(bad)


@pytest.mark.parametrize("importer, target", [
    ("hloserve.runtime.model", "hloserve.exporter.export"),
    ("hloserve.quantization.convert", "hloserve.exporter.llm.hf_causal"),
    ("hloserve.server.services", "hloserve.exporter.presets"),
    ("hloserve.runtime.artifact.manifest", "hloserve.runtime.client"),
    ("hloserve.server.http.chat_protocol", "hloserve.server.http.prepare"),
    ("hloserve.server.predict", "hloserve.server.http.app"),
])
def test_the_checker_sees_a_forbidden_edge(importer, target, monkeypatch, tmp_path):
    """A function-level import of a forbidden module is reported (the rule cannot be dodged)."""
    fake = tmp_path / "m.py"
    fake.write_text(MODULES[importer].read_text() + f"\n\ndef _sneaky():\n    import {target}\n")
    monkeypatch.setitem(MODULES, importer, fake)
    assert any(f"imports {target}" in v for v in violations())


def _module_level_imports(name: str, path: pathlib.Path) -> set[str]:
    """The hloserve modules `name` imports when it is imported (its top-level statements, not
    function bodies, not `if TYPE_CHECKING:` blocks)."""
    tree = ast.parse(path.read_text())
    body, out = list(tree.body), set()
    while body:
        node = body.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            wrapper = ast.Module(body=[node], type_ignores=[])
            out |= {m for _, m in _imports_of(name, path, wrapper) if m in MODULES and m != name}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += [n for part in ("body", "orelse", "finalbody", "handlers") for n in getattr(node, part, [])]
        elif isinstance(node, ast.ExceptHandler):
            body += node.body
    return out


def test_no_module_level_import_loop():
    """Importing any module never re-enters a module that is still being imported (no cycle in the
    graph of top-level imports, Tarjan's strongly connected components)."""
    graph = {n: _module_level_imports(n, p) for n, p in MODULES.items()}
    index, low, stack, on, loops, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                loops.append(sorted(scc))
    for v in graph:
        if v not in index:
            visit(v)
    assert not loops, f"module-level import loops: {loops}"


def test_kernel_backends_never_import_the_face():
    """runtime/kernels/__init__.py picks a backend; the backends (cpu/, pallas/, backend.py, rewrite.py)
    never import it back, at any level."""
    face = "hloserve.runtime.kernels"
    bad = [f"{n} imports {m}" for n, p in MODULES.items() if n.startswith(face + ".")
           for _, m in imports(n, p) if m == face]
    assert not bad, bad


def test_runtime_artifact_imports_neither_jax_nor_torch():
    """The format package loads with the standard library, numpy and ml_dtypes alone."""
    import subprocess
    import sys
    code = ("import sys, hloserve.runtime.artifact, hloserve.server.config; "
            "print(sorted(m for m in ('jax', 'torch', 'fastapi') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.stdout.strip() == "[]"


def _calls(path: pathlib.Path) -> list[tuple[str, str, ast.Call]]:
    """(enclosing function, called name, call) for every call in a module."""
    out = []

    def visit(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            if isinstance(child, ast.Call):
                f = child.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                    name = f"{f.value.id}.{f.attr}"
                out.append((inner, name, child))
            visit(child, inner)
    visit(ast.parse(path.read_text()), "<module>")
    return out


def test_the_server_reads_an_artifact_once():
    """One `hloserve serve` reads manifest.json once (services.build_service) and types its LLM contract
    once (LLMArtifact.read); everything below gets the typed objects (server/wiring.py)."""
    reads, parses, loads = [], [], []
    for name, path in MODULES.items():
        if not name.startswith("hloserve.server"):
            continue
        for where, called, call in _calls(path):
            site = f"{name}.{where}"
            if called.endswith("read_manifest"):
                reads.append(site)
            if called in ("LLMSpec.of", "LLMSpec.from_json", "LLMArtifact.read", "TextSpec.of", "TextSpec.from_json"):
                parses.append((site, called))
            if called == "runtime.load":
                loads.append((site, {k.arg for k in call.keywords}))
    assert reads == ["hloserve.server.services.build_service"]
    # the contract and text spec are typed where a path comes in: the service, a follower process,
    # the conveniences that also take a path (build_engine, ModelRunner.from_artifact), a predict
    # artifact's embedder and a draft model's artifact (a second one); handed the typed objects, as the
    # wiring hands them, they read nothing
    assert sorted(parses) == [("hloserve.server.core.model_runner.from_artifact", "LLMArtifact.read"),
                              ("hloserve.server.embeddings.from_artifact", "TextSpec.of"),
                              ("hloserve.server.serve.follow", "LLMArtifact.read"),
                              ("hloserve.server.services.build_service", "LLMArtifact.read"),
                              ("hloserve.server.wiring._draft_artifact", "LLMArtifact.read"),
                              ("hloserve.server.wiring.build_engine", "LLMArtifact.read")]
    assert loads and all("manifest" in kw for _, kw in loads), loads       # runtime.load gets the manifest read
