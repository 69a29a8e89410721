"""The per-request read deadline (server/protocol.py) on a real uvicorn server with a small
ASGI app, no model: slow or silent clients are closed, slow replies and kept-alive
connections are not. test_server.py checks the same through `adaptive-llama serve`."""

import asyncio
import socket
import threading
import time

import pytest
import uvicorn

from adaptive_llama.server.protocol import with_read_timeout

TIMEOUT_S = 0.5
SLOW_REPLY_S = 3 * TIMEOUT_S
seen = {}


async def app(scope, receive, send):
    """Echoes the body's length; /slow answers after SLOW_REPLY_S; records disconnects."""
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            seen["disconnected"] = scope["path"]
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await asyncio.sleep(SLOW_REPLY_S)
    reply = str(len(body)).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(reply)).encode())]})
    await send({"type": "http.response.body", "body": reply})


@pytest.fixture(scope="module")
def port():
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                            http=with_read_timeout(TIMEOUT_S), lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    yield server.servers[0].sockets[0].getsockname()[1]
    server.should_exit = True
    thread.join(timeout=10)


def request(path: str, body: bytes = b"") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode() + body)


def closed_after(sock: socket.socket, head: bytes, trickle: bytes, every_s=0.05) -> float:
    """Seconds until the server closes ``sock``, sent ``head`` at once and then ``trickle``
    a byte at a time."""
    started = time.monotonic()
    sock.sendall(head)
    sock.settimeout(every_s)
    for byte in trickle:
        try:
            sock.sendall(bytes([byte]))
            if sock.recv(1024) == b"":
                return time.monotonic() - started
        except TimeoutError:
            continue
        except OSError:  # reset: closed too
            return time.monotonic() - started
    sock.settimeout(10)
    try:
        while sock.recv(1024):
            pass
    except OSError:
        pass
    return time.monotonic() - started


def replies(sock: socket.socket, count: int) -> list[bytes]:
    """The bodies of the next ``count`` responses on ``sock`` (each a short number)."""
    sock.settimeout(10)
    data, bodies = b"", []
    while len(bodies) < count:
        chunk = sock.recv(4096)
        assert chunk, f"closed after {bodies}"
        data += chunk
        while b"\r\n\r\n" in data:
            head, rest = data.split(b"\r\n\r\n", 1)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            if len(rest) < length:
                break
            bodies.append(rest[:length])
            data = rest[length:]
    return bodies


HALF_SENT = request("/half", b"{" * 400)[:-300]  # whole headers, then part of the body
HEADERS_END = HALF_SENT.index(b"\r\n\r\n") + 4


@pytest.mark.parametrize("head, trickle", [
    (b"", b""),  # connects and says nothing
    (b"POST /x HTTP/1.1\r\n", b"Host: localhost\r\nX-Padding: " + b"a" * 200),  # endless
    (HALF_SENT[:HEADERS_END], HALF_SENT[HEADERS_END:]),  # the body a byte at a time
], ids=["silent", "headers", "body"])
def test_a_request_slower_than_the_deadline_loses_its_connection(port, head, trickle):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        # sending every 50 ms would keep an idle timer from ever firing: not this clock
        took = closed_after(sock, head, trickle)
    assert TIMEOUT_S * 0.9 < took < TIMEOUT_S + 2, took


def test_the_route_waiting_for_the_body_sees_the_client_leave(port):
    seen.clear()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        closed_after(sock, HALF_SENT[:HEADERS_END], HALF_SENT[HEADERS_END:])
        time.sleep(0.1)
        assert seen.get("disconnected") == "/half"  # the server closed it, not the client


def test_a_reply_slower_than_the_deadline_is_whole(port):
    # the clock stops once the request is in: generating the reply is not counted
    with socket.create_connection(("127.0.0.1", port)) as sock:
        started = time.monotonic()
        sock.sendall(request("/slow", b"abc"))
        assert replies(sock, 1) == [b"3"]
        assert time.monotonic() - started >= SLOW_REPLY_S


def test_each_request_on_a_kept_alive_connection_gets_its_own_clock(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        for size in (1, 22, 333, 4444):  # 4 x 0.3 s: longer than one deadline in all
            time.sleep(0.6 * TIMEOUT_S)
            sock.sendall(request("/x", b"y" * size))
            assert replies(sock, 1) == [str(size).encode()]


def test_pipelined_requests_are_all_answered(port):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request("/slow", b"a") + request("/x", b"bb") + request("/x", b"ccc"))
        assert replies(sock, 3) == [b"1", b"2", b"3"]
