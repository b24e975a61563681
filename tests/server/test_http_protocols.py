"""`replayllm serve`'s two HTTP/1.1 protocols (`http_protocol.protocol_class`: httptools by default, h11 with
`--http h11`) behave alike: the same caps on a request head (431 JSON), the same 400 JSON for a malformed one,
slow heads and stalled bodies dropped, the connection cap, pipelining, and streamed chunks framed straight onto
the socket (`direct_chunk_writer`). Each test runs a bare ASGI app on uvicorn in a thread with short timeouts."""

from __future__ import annotations

import importlib.util
import json
import resource
import socket
import threading
import time
from contextlib import contextmanager

import pytest
import uvicorn

from replayllm.entrypoints.http.connection_limits import ConnectionLimits
from replayllm.entrypoints.http.http_protocol import direct_chunk_writer, protocol_class

if importlib.util.find_spec("httptools") is None:
    pytest.skip("httptools is not installed (a dependency of the package; `pip install httptools`)",
                allow_module_level=True)

DEADLINE_S = 60.0  # every wait polls up to this: CI machines are busy
LIMITS = dict(limit_concurrency=4, timeout_header=0.5, timeout_body=0.5, timeout_keep_alive=30.0,
              h11_max_incomplete_event_size=4096, h11_max_header_count=20)
CHUNKS = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
writers: dict[str, bool] = {}  # path of a /stream request -> whether its send had a DirectChunkWriter


async def app(scope, receive, send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body, more = b"", True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body, more = body + message.get("body", b""), message.get("more_body", False)
    if scope["path"].startswith("/stream"):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        write = direct_chunk_writer(send)
        writers[f'{scope["method"]} {scope["path"]}'] = write is not None
        for chunk in CHUNKS:
            if write is not None:
                await write(chunk)
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    answer = json.dumps({"path": scope["path"], "body": body.decode()}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


@contextmanager
def serving(http: str, limits: ConnectionLimits | None = None):
    limits = limits or ConnectionLimits(**LIMITS)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=protocol_class(limits, http), log_level="error", lifespan="on",
                            timeout_keep_alive=limits.timeout_keep_alive)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + DEADLINE_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(DEADLINE_S)
        sock.close()


@pytest.fixture(params=["httptools", "h11"])
def port(request):
    with serving(request.param) as port:
        yield port


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def responses(data: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    """Every (status, headers, de-chunked body) in a raw HTTP/1.1 byte stream."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = dict(line.lower().split(b": ", 1) for line in lines[1:])
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size, _, data = data.partition(b"\r\n")
                n = int(size, 16)
                body, data = body + data[:n], data[n + 2:]
                if n == 0:
                    break
        elif b"content-length" in headers:
            n = int(headers[b"content-length"])
            body, data = data[:n], data[n:]
        else:  # delimited by the connection's close
            body, data = data, b""
        out.append((int(lines[0].split(b" ")[1]), headers, body))
    return out


def request(port: int, raw: bytes) -> list[tuple[int, dict[bytes, bytes], bytes]]:
    with connect(port) as sock:
        sock.sendall(raw)
        return responses(read_until_closed(sock))


def get(path: str, headers: str = "", close: bool = True) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n{headers}{'Connection: close' if close else ''}\r\n\r\n".encode()


def error_of(answers) -> tuple[int, str]:
    (status, headers, body), = answers
    assert headers[b"content-type"] == b"application/json" and headers[b"connection"] == b"close"
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http_request"
    return status, error["message"]


def test_a_plain_request_is_answered(port):
    (status, _, body), = request(port, get("/ok"))
    assert status == 200 and json.loads(body) == {"path": "/ok", "body": ""}


def test_too_many_header_fields_is_a_431_json(port):
    fields = "".join(f"x-h{i}: 1\r\n" for i in range(21))
    status, message = error_of(request(port, get("/ok", fields)))
    assert status == 431 and "--h11-max-header-count" in message
    assert request(port, get("/ok", "".join(f"x-h{i}: 1\r\n" for i in range(18))))[0][0] == 200  # 20 with Host


@pytest.mark.parametrize("pieces", [1, 8])
def test_a_head_over_the_size_cap_is_a_431_json_whether_whole_or_in_pieces(port, pieces):
    raw = get("/ok", f"x-big: {'a' * 5000}\r\n")
    with connect(port) as sock:
        step = -(-len(raw) // pieces)
        for i in range(0, len(raw), step):
            try:
                sock.sendall(raw[i:i + step])
            except (BrokenPipeError, ConnectionResetError):  # refused before the whole head went out
                break
            time.sleep(0.01)
        status, message = error_of(responses(read_until_closed(sock)))
    assert status == 431 and "--h11-max-incomplete-event-size" in message


def test_an_incomplete_head_over_the_cap_is_refused_without_waiting_for_its_end(port):
    with connect(port) as sock:
        sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * 3000)
        time.sleep(0.05)
        sock.sendall(b"a" * 3000)  # the head is not finished, and past 4096 bytes
        status, message = error_of(responses(read_until_closed(sock)))
    assert status == 431 and "--h11-max-incomplete-event-size" in message


def test_a_head_just_under_the_cap_sent_in_pieces_is_served(port):
    raw = get("/ok", f"x-big: {'a' * 3900}\r\n")
    assert len(raw) < LIMITS["h11_max_incomplete_event_size"]
    with connect(port) as sock:
        for i in range(0, len(raw), 500):
            sock.sendall(raw[i:i + 500])
            time.sleep(0.01)
        (status, _, _), = responses(read_until_closed(sock))
    assert status == 200


def test_a_malformed_request_is_a_400_json(port):
    status, message = error_of(request(port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert status == 400 and message == "invalid HTTP request"


def test_a_slow_head_and_a_stalled_body_are_dropped(port):
    with connect(port) as slow_head, connect(port) as slow_body:
        slow_head.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # ... never the rest
        slow_body.sendall(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        assert read_until_closed(slow_head) == b""
        assert read_until_closed(slow_body) == b""
    assert request(port, get("/ok"))[0][0] == 200


def test_pipelined_requests_are_answered_in_order(port):
    raw = (b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\none"
           b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\ntwo" + get("/c"))
    answers = request(port, raw)
    assert [json.loads(body) for _, _, body in answers] == [
        {"path": "/a", "body": "one"}, {"path": "/b", "body": "two"}, {"path": "/c", "body": ""}]


def test_past_the_connection_cap_the_longest_idle_connection_is_closed(port):
    busy = connect(port)  # a request in flight: its body is still coming, so it is never the one closed
    busy.sendall(b"POST /busy HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{")
    time.sleep(0.1)
    idle = [connect(port) for _ in range(LIMITS["limit_concurrency"])]
    try:
        assert read_until_closed(idle[0]) == b""  # the oldest idle one made room
        busy.sendall(b"}")
        (status, _, body), = responses(busy.recv(65536))
        assert status == 200 and json.loads(body)["body"] == "{}"
    finally:
        for s in [busy, *idle]:
            s.close()


def test_the_cap_closes_connections_in_the_order_they_began_waiting(port):
    """Idle connections are closed oldest-waiting first, and a keep-alive connection that was just served waits
    from its response's end: it is closed after the ones that have waited longer."""
    socks = [connect(port) for _ in range(4)]  # the cap (4) is full
    a, b, c, _ = socks
    try:
        b.sendall(b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n")  # served, kept alive: now the newest to wait
        answer = b""
        while not answer.endswith(b"}"):  # the whole (small, sized) JSON answer
            answer += b.recv(65536)
        assert responses(answer)[0][0] == 200
        socks.append(connect(port))
        assert read_until_closed(a) == b""  # the oldest waiting
        socks.append(connect(port))
        assert read_until_closed(c) == b""  # then c, not b
        b.sendall(get("/b2"))
        assert responses(read_until_closed(b))[0][0] == 200  # b was kept
    finally:
        for s in socks:
            s.close()


def test_a_streamed_body_is_framed_straight_onto_the_socket(port):
    writers.clear()
    (status, headers, body), = request(port, get(f"/stream-{port}"))
    assert status == 200 and headers[b"transfer-encoding"] == b"chunked"
    assert body == b"".join(CHUNKS)
    assert writers == {f"GET /stream-{port}": True}  # direct_chunk_writer found the guarded connection
    with connect(port) as sock:
        sock.sendall(f"HEAD /stream-{port} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        head, _, body = read_until_closed(sock).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b""
    assert writers[f"HEAD /stream-{port}"] is False  # no body: nothing to frame


def test_a_burst_of_more_than_1024_connections_is_served_with_the_default_limits():
    """A benchmark's thousands of requests at once (vLLM's server has no cap) are served, none evicted or 503."""
    limits, burst = ConnectionLimits(), 1500
    limits.check_file_limit()  # raises this process's soft open-file limit, as `serve` does
    room = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if room != resource.RLIM_INFINITY and room < 2 * burst + 300:
        pytest.skip(f"the open-file limit ({room}) cannot hold {burst} connections at both ends in one process")
    assert limits.limit_concurrency > burst
    with serving("httptools", limits) as port:
        socks = [connect(port) for _ in range(burst)]  # all open before any request: the burst's shape
        try:
            for i, s in enumerate(socks):
                s.sendall(get(f"/burst-{i}"))
            paths = [json.loads(responses(read_until_closed(s))[0][2])["path"] for s in socks]
        finally:
            for s in socks:
                s.close()
    assert paths == [f"/burst-{i}" for i in range(burst)]


def test_the_default_cap_fits_the_open_file_limit(monkeypatch):
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 1 << 20))
    assert ConnectionLimits().limit_concurrency == 8192
    monkeypatch.setattr(resource, "getrlimit", lambda kind: (1024, 4096))
    assert ConnectionLimits().limit_concurrency == 4096 - 256 - 1  # what check_file_limit then accepts
    monkeypatch.setattr(resource, "setrlimit", lambda kind, limits: None)
    ConnectionLimits().check_file_limit()
    assert ConnectionLimits(limit_concurrency=100).limit_concurrency == 100


MALFORMED = [
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",  # smuggling
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
    b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHo\x00st: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
    b"CONNECT x:443 HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
]


def _malformed(n: int = 40) -> list[bytes]:
    """MALFORMED, then random bytes and valid heads with random bytes changed (seeded)."""
    import random

    rng, cases = random.Random(0), list(MALFORMED)
    for _ in range(n):
        cases.append(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
        head = bytearray(get("/x", "X-A: 1\r\n", close=False))
        for _ in range(rng.randrange(1, 5)):
            head[rng.randrange(len(head))] = rng.randrange(256)
        cases.append(bytes(head))
    return cases


def test_malformed_input_never_breaks_the_server(port):
    """Every connection either gets a whole HTTP/1.1 response (an error one as our JSON) or is closed without one
    (h11 waits for the rest of a request its bytes may still begin, then sees the end of the stream); the server
    serves a plain request after all of them."""
    for raw in _malformed():
        with connect(port) as sock:
            try:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # refused before everything went out
                pass
            data = read_until_closed(sock)
        if not data:
            continue
        assert data.startswith(b"HTTP/1.1 "), (raw, data[:80])
        status = int(data[9:12])
        if status >= 400:
            (status, headers, body), = responses(data)
            assert headers[b"content-type"] == b"application/json", (raw, data[:200])
            assert json.loads(body)["error"]["code"] == "invalid_http_request"
    assert request(port, get("/ok"))[0][0] == 200


def test_protocol_choice():
    limits = ConnectionLimits()
    assert protocol_class(limits).__name__ == "GuardedHttpToolsProtocol"
    assert protocol_class(limits, "h11").__name__ == "GuardedH11Protocol"
    with pytest.raises(ValueError, match="--http must be one of"):
        protocol_class(limits, "h2")
