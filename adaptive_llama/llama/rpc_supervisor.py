"""An RPC worker that outlives ggml's RPC server.

ggml's RPC server trusts what it is sent: one malformed message (a size field of 2^63,
tensor data past its buffer, a graph node without sources, an unknown op) makes it abort the
process (``GGML_ASSERT``, ``std::length_error``, ``GGML_ABORT``). It is not ours to rewrite,
so ``adaptive-llama rpc-worker`` runs it in a child process on a loopback port of its own
and relays each host's connection to it: the worker's own port is held by this process,
which knows each host's address, and when the child ends mid-connection it says so in one
line naming the host and the reason, starts a new child and serves the next host. A child
is started before the first host, so that a host waits no longer than before.

The relay copies bytes both ways in one thread, one host at a time (ggml's server serves one
host at a time too: the others wait in the listening socket's queue).
"""

from __future__ import annotations

import collections
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable

START_TIMEOUT_S = 60.0  # for a child to listen (llama.cpp's libraries loaded, devices set up)
END_WAIT_S = 2.0  # for a child whose connection closed to be seen ending, if it crashed
RELAY_CHUNK = 1 << 20


class Supervisor:
    """ggml's RPC server in a child process (``child(port)``: its command, listening on
    127.0.0.1:port), behind ``listener``; ``say`` writes one line for the user."""

    def __init__(self, listener: socket.socket, child: Callable[[int], list[str]],
                 say: Callable[[str], None]):
        self._listener = listener
        self._child_command = child
        self._say = say
        self._process: subprocess.Popen | None = None
        self._port = 0
        self._last_lines: collections.deque[str] = collections.deque(maxlen=8)

    def start(self) -> None:
        """A child that listens; RuntimeError in one line if it does not start."""
        self._port = _free_loopback_port()
        self._last_lines.clear()
        self._process = subprocess.Popen(
            self._child_command(self._port), stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, errors="replace",
            env={**os.environ, "GGML_NO_BACKTRACE": "1"})
        threading.Thread(target=self._keep_lines, args=(self._process,), daemon=True,
                         name="rpc-child-stderr").start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"llama.cpp's RPC server did not start ({self._reason()})")
            try:
                # ggml's server takes this as a host that closes at once, and waits for the next.
                socket.create_connection(("127.0.0.1", self._port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"llama.cpp's RPC server did not listen within "
                           f"{START_TIMEOUT_S:g} s")

    def serve_forever(self) -> None:
        """Relay hosts, one at a time, to the child; a new child after one that ended."""
        while True:
            client, peer = self._listener.accept()
            host = f"{peer[0]}:{peer[1]}"
            with client:
                self._serve(client, host)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()

    def _serve(self, client: socket.socket, host: str) -> None:
        if self._process.poll() is not None:
            self._restart(f"llama.cpp's RPC server had stopped ({self._reason()})")
        try:
            server = socket.create_connection(("127.0.0.1", self._port), timeout=5)
        except OSError as exc:
            self._restart(f"llama.cpp's RPC server did not take a connection ({exc})")
            server = socket.create_connection(("127.0.0.1", self._port), timeout=5)
        with server:
            for sock in (client, server):
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            closed_by_server = _relay(client, server)
        if closed_by_server:
            try:
                self._process.wait(END_WAIT_S)
            except subprocess.TimeoutExpired:
                return  # the server closed a connection it would not serve, and goes on
            self._restart(f"llama.cpp's RPC server stopped on a message from {host} "
                          f"({self._reason()})")

    def _restart(self, what: str) -> None:
        self._say(f"RPC worker: {what}; it is started again for the next host.")
        self.stop()
        self.start()

    def _keep_lines(self, process: subprocess.Popen) -> None:
        for line in process.stderr:
            if line.startswith("Warning:"):  # the child's own, for the user
                self._say(line.rstrip())
            elif line.strip():
                self._last_lines.append(line.strip())

    def _reason(self) -> str:
        """The child's last words (ggml's assertion), else how it ended."""
        code = self._process.wait()
        time.sleep(0.05)  # its last lines on their way through the pipe
        said = [line for line in self._last_lines
                if "GGML_ASSERT" in line or "error" in line.lower() or "what()" in line]
        if said:
            return said[-1]
        return f"signal {-code}" if code < 0 else f"exit status {code}"


def _relay(client: socket.socket, server: socket.socket) -> bool:
    """Copy bytes both ways until one side closes (or fails); whether the server did."""
    other = {client: server, server: client}
    buffer = bytearray(RELAY_CHUNK)
    view = memoryview(buffer)
    while True:
        for sock in select.select([client, server], [], [])[0]:
            try:
                count = sock.recv_into(buffer)
            except OSError:
                count = 0
            if not count:
                return sock is server
            try:
                other[sock].sendall(view[:count])
            except OSError:
                return other[sock] is server


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def end_with_stdin() -> None:
    """In the child: end when the supervisor does (its stdin closes), even after SIGKILL."""
    def wait() -> None:
        try:
            while os.read(0, 4096):
                pass
        finally:
            os._exit(0)

    threading.Thread(target=wait, daemon=True, name="rpc-supervisor-watch").start()
