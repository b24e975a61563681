"""OffloadedBodyRoute's direct call (entrypoints/http/body_offload.py): a route of one JSON body (+ the Request)
gets its endpoint called with the validated model without FastAPI's per-request machinery, and every answer,
valid or not, is the one FastAPI's own route gives."""

from __future__ import annotations

import fastapi.routing
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict
from starlette.responses import JSONResponse

from replayllm.entrypoints.http.body_offload import OffloadedBodyRoute, direct_call


class Body(BaseModel):
    model_config = ConfigDict(strict=True)
    prompt: str
    max_tokens: int = 16


def _app(route_class) -> FastAPI:
    app = FastAPI()
    app.router.route_class = route_class

    @app.post("/gen")
    async def gen(body: Body, request: Request):
        return JSONResponse({"prompt": body.prompt, "max_tokens": body.max_tokens, "path": request.url.path})

    @app.post("/plain")
    async def plain(body: Body):
        return {"n": body.max_tokens}  # not a Response: FastAPI's default JSON answer

    @app.post("/query")
    async def query(body: Body, k: int = 0):
        return {"k": k}

    return app


BODIES = [
    b'{"prompt": "hi", "max_tokens": 3}',
    b'{"prompt": "hi"}',
    b'{"prompt": 5}',  # wrong type
    b'{"max_tokens": 3}',  # missing field
    b'{"prompt": "hi", "max_tokens": "3"}',  # strict: no coercion
    b"null",
    b"[1, 2]",
    b'{"prompt": "x",',  # not JSON
    b"",
    b'\x02ge\x1f\xdc.\xffu',  # not UTF-8
]


@pytest.mark.parametrize("path", ["/gen", "/plain", "/query"])
def test_every_answer_equals_fastapis_own_route(path, monkeypatch):
    calls = []
    solve = fastapi.routing.solve_dependencies

    async def counted(*args, **kwargs):
        calls.append(1)
        return await solve(*args, **kwargs)

    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counted)
    ours, theirs = TestClient(_app(OffloadedBodyRoute)), TestClient(_app(fastapi.routing.APIRoute))
    headers = {"content-type": "application/json"}
    for body in BODIES:
        a = ours.post(path, content=body, headers=headers)
        b = theirs.post(path, content=body, headers=headers)
        assert (a.status_code, a.json()) == (b.status_code, b.json()), body
    valid = ours.post(path, content=BODIES[0], headers=headers)
    assert valid.status_code == 200
    calls.clear()
    ours.post(path, content=BODIES[0], headers=headers)
    # The direct call skips FastAPI's dependency solving; a route with a query parameter keeps it.
    assert calls == ([1] if path == "/query" else [])
    calls.clear()
    ours.post(path, content=b"null", headers=headers)  # not an object: FastAPI's path and its error entries
    assert calls == [1]


def test_direct_call_names_the_body_and_request_parameters():
    routes = {r.path: r for r in _app(OffloadedBodyRoute).routes if hasattr(r, "dependant")}
    assert direct_call(routes["/gen"]) == ("body", "request")
    assert direct_call(routes["/plain"]) == ("body", None)
    assert direct_call(routes["/query"]) is None


def test_a_route_with_its_own_response_class_keeps_fastapis_path():
    app = FastAPI()
    app.router.route_class = OffloadedBodyRoute

    @app.post("/own", response_class=JSONResponse)
    async def own(body: Body):
        return {"n": body.max_tokens}

    route = next(r for r in app.routes if getattr(r, "path", None) == "/own")
    assert direct_call(route) is None
    assert TestClient(app).post("/own", json={"prompt": "x", "max_tokens": 2}).json() == {"n": 2}
