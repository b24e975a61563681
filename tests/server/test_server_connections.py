"""Connection hygiene against the real server: slow clients (slowloris heads, stalled bodies, idle sockets) are
dropped while others are served, a flood of connections is capped without refusing /health, requests past
--limit-concurrency get a 503 JSON, oversized or malformed heads get a JSON 4xx instead of plain text."""

from __future__ import annotations

import json
import resource
import socket
import time

import httpx
import pytest
from helpers.server_utils import API_KEY, ENGINE_ARGS, RemoteServer

from replayllm.entrypoints.cli import server_main
from replayllm.entrypoints.cli.main import main
from replayllm.entrypoints.http.connection_limits import ConnectionLimits

pytestmark = pytest.mark.serial  # second-scale connection timeouts: `make test` runs it alone

LIMIT = 8
CONN_ARGS = ["--limit-concurrency", str(LIMIT), "--timeout-header", "1", "--timeout-body", "2",
             "--timeout-keep-alive", "1", "--h11-max-header-count", "20", "--h11-max-incomplete-event-size", "4096"]
DEADLINE_S = 60.0  # every wait polls up to this: the timeouts above are seconds, CI machines are busy
OK = {"prompt": "Once upon a time", "max_tokens": 1}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer([*ENGINE_ARGS, "--api-key", API_KEY, *CONN_ARGS],
                       tmp_path_factory.mktemp("server_connections"), api_key=API_KEY)
    yield srv
    srv.stop()


def connect(server) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)


def closed_by_server(sock: socket.socket) -> bytes:
    """Read until the server closes the connection (EOF or reset) within DEADLINE_S; return what it sent."""
    data = b""
    sock.settimeout(DEADLINE_S)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {DEADLINE_S}s")
    return data


def is_closed(sock: socket.socket) -> bool:
    """True once the server has closed `sock` (non-blocking peek)."""
    sock.setblocking(False)
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def complete(server) -> httpx.Response:
    return httpx.post(server.base_url + "/completions", json=OK, headers=server.headers, timeout=DEADLINE_S)


def head_of(response: bytes) -> tuple[int, dict]:
    """(status, JSON body) of a raw HTTP/1.1 response."""
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def test_slow_head_is_dropped_while_others_are_served(server):
    slow = connect(server)
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # ... and never the rest of the head
    assert complete(server).status_code == 200
    assert closed_by_server(slow) == b""
    assert complete(server).status_code == 200


def test_silent_connection_is_dropped(server):
    with connect(server) as silent:
        assert closed_by_server(silent) == b""


def test_stalled_body_is_dropped(server):
    with connect(server) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n{\"prompt\"")
        assert complete(server).status_code == 200
        closed_by_server(slow)  # whatever was sent (nothing, or an error): the socket is gone
    assert complete(server).status_code == 200


def test_idle_keep_alive_connection_is_closed(server):
    with connect(server) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert closed_by_server(sock).startswith(b"HTTP/1.1 200")


def test_connection_flood_is_capped_and_health_still_answers(server):
    flood = [connect(server) for _ in range(25 * LIMIT)]
    try:
        r = httpx.get(server.url + "/health", timeout=DEADLINE_S)
        assert r.status_code == 200
        assert complete(server).status_code == 200
        deadline = time.monotonic() + DEADLINE_S  # the oldest idle sockets were closed to make room
        while sum(map(is_closed, flood)) < len(flood) - LIMIT and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sum(map(is_closed, flood)) >= len(flood) - LIMIT
    finally:
        for s in flood:
            s.close()


def test_requests_past_the_limit_get_a_503_json(server):
    """LIMIT requests held open by bodies that trickle in; the next one is refused with 503, /health is not."""
    held = [connect(server) for _ in range(LIMIT)]
    try:
        for s in held:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n ")
        deadline = time.monotonic() + DEADLINE_S
        while True:  # until the server has seen every held request: one byte each keeps them under timeout_body
            for s in held:
                s.sendall(b" ")
            r = complete(server)
            if r.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert r.status_code == 503, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["type"] == "server_error" and err["code"] == "service_unavailable"
        assert "--limit-concurrency" in err["message"]
        assert httpx.get(server.url + "/health", timeout=DEADLINE_S).status_code == 200
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + DEADLINE_S  # the held requests end with their sockets: capacity comes back
    while (r := complete(server)).status_code == 503 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r.status_code == 200


@pytest.mark.parametrize("headers, part", [
    ({f"x-h{i}": "1" for i in range(25)}, "--h11-max-header-count"),
    ({"x-big": "a" * 5000}, "--h11-max-incomplete-event-size"),
])
def test_oversized_head_is_a_431_json(server, headers, part):
    r = httpx.get(server.url + "/health", headers=headers, timeout=DEADLINE_S)
    assert r.status_code == 431
    assert r.headers["content-type"] == "application/json"
    assert part in r.json()["error"]["message"]


def test_malformed_request_is_a_400_json(server):
    with connect(server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, body = head_of(closed_by_server(sock))
    assert status == 400
    assert body["error"]["code"] == "invalid_http_request"


@pytest.mark.parametrize("flags", [["--timeout-header", "0"], ["--limit-concurrency", "-3"],
                                   ["--h11-max-header-count", "x"], ["--http", "h2"]])
def test_bad_connection_flags_are_rejected(flags, capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", *flags])
    assert e.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_limit_concurrency_above_the_open_file_limit_stops_serve(monkeypatch, capsys):
    """`serve` raises its soft open-file limit as far as the hard one allows; past that, a clear error before
    the port is taken and the model loads."""
    raised = []
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    monkeypatch.setattr(resource, "setrlimit", lambda kind, limits: raised.append(limits))
    monkeypatch.setattr(server_main, "bind_socket", lambda *a: pytest.fail("the port was taken"))
    monkeypatch.setattr(server_main, "EngineConfig", lambda **kw: pytest.fail("the model was loaded"))
    assert main(["serve", "--limit-concurrency", "4000", "--port", "0"]) == 2
    assert raised == [(4096, 4096)]
    assert "--limit-concurrency 4000 needs 4257 open files" in capsys.readouterr().err
    ConnectionLimits(limit_concurrency=3000).check_file_limit()  # fits in 4096: no error
