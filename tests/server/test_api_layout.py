"""The HTTP APIs' one convention (docs/architecture.md, "Where a new API goes"), checked on the code.

Each API is one module in server/http/ holding its `router` with the route handlers, and, for the
published /openapi.json, `BODIES` (path -> the model of the body its route parses itself, which
FastAPI cannot see) and `ANSWERS` (path -> the model of its typed answer); app.py serves it by
naming the module in a tuple. These checks fail when an API's module forgets a table entry (its
body would be missing from /openapi.json) or is never served.
"""
from __future__ import annotations

import ast
import inspect
import pathlib
import textwrap

import pytest
from fastapi import APIRouter
from pydantic import BaseModel

from hloserve.server.http import app, embeddings

APIS = (*app.LLM_APIS, *app.PREDICT_APIS, embeddings)
HTTP = pathlib.Path(app.__file__).parent


def routes(api) -> dict[str, set[str]]:
    """path -> its methods, for one API module's router."""
    out: dict[str, set[str]] = {}
    for r in api.router.routes:
        out.setdefault(r.path, set()).update(r.methods)
    return out


def parses_its_body(endpoint) -> bool:
    """Whether a route handler reads its body with prepare.parse_body (off the event loop)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(endpoint)))
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "parse_body" for n in ast.walk(tree))


@pytest.mark.parametrize("api", APIS, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_an_api_module_holds_its_router_and_its_schema_tables(api):
    assert isinstance(api.router, APIRouter)
    paths = routes(api)
    for table in (api.BODIES, api.ANSWERS):
        for path, model in table.items():
            assert "POST" in paths.get(path, ()), f"{api.__name__} lists {path}, which is not one of its POST routes"
            assert issubclass(model, BaseModel)
    for r in api.router.routes:
        if parses_its_body(r.endpoint):
            assert r.path in api.BODIES, (f"{api.__name__}.{r.endpoint.__name__} parses its own body: add "
                                          f"{r.path} to its BODIES, or /openapi.json shows no request body")


def test_every_router_in_server_http_is_served_and_each_path_has_one_home():
    """A module with a router is one of app.py's APIs, and no two APIs of one service register the
    same path (an LLM's /v1/models/{name} and a predict service's are different services' routes)."""
    with_router = {p.stem for p in HTTP.glob("*.py") if "\nrouter = APIRouter(" in p.read_text()}
    assert with_router == {api.__name__.rsplit(".", 1)[1] for api in APIS}
    for served in (app.LLM_APIS, (*app.PREDICT_APIS, embeddings)):
        seen: dict[str, str] = {}
        for api in served:
            for path in routes(api):
                assert path not in seen, f"{path} is registered by both {seen[path]} and {api.__name__}"
                seen[path] = api.__name__
