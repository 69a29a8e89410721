"""The HTTP/1.1 connection handling: uvicorn's h11 protocol with a deadline for each request.

uvicorn closes a keep-alive connection idle after a response, but nothing else: a client
that opens connections and sends nothing, or trickles its headers or body a byte at a time
(slow loris), holds each connection for ever, until the process runs out of file
descriptors. Here every request, headers and body, has to arrive within ``read_timeout``
seconds of the connection opening or of the previous response ending; data arriving does
not restart the clock (as Go's ``ReadTimeout``), so trickling does not help. Generating the
reply is not counted: the clock stops once the whole request is in.
"""

import functools
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("adaptive_llama.server")

READ_TIMEOUT_S = 30.0
# Until the request is whole, h11 keeps the client's side in one of these states.
_RECEIVING = (h11.IDLE, h11.SEND_BODY)


class DeadlineProtocol(H11Protocol):
    def __init__(self, *args, read_timeout: float = READ_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_timeout = read_timeout
        self.read_deadline = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._start_clock()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._stop_clock_once_received()

    def on_response_complete(self) -> None:
        self._start_clock()  # the next request's (a pipelined one may be parsed just below)
        super().on_response_complete()
        self._stop_clock_once_received()

    def connection_lost(self, exc) -> None:
        self._stop_clock()
        super().connection_lost(exc)

    def _start_clock(self) -> None:
        self._stop_clock()
        self.read_deadline = self.loop.call_later(self.read_timeout, self._on_deadline)

    def _stop_clock(self) -> None:
        if self.read_deadline is not None:
            self.read_deadline.cancel()
            self.read_deadline = None

    def _stop_clock_once_received(self) -> None:
        if self.conn.their_state not in _RECEIVING:
            self._stop_clock()

    def _on_deadline(self) -> None:
        self.read_deadline = None
        if self.transport.is_closing() or self.conn.their_state not in _RECEIVING:
            return
        client = "{}:{}".format(*self.client) if self.client else "a client"
        log.info("%s: closed a connection that sent no whole request in %g s", client,
                 self.read_timeout)
        # A route waiting for the rest of the body sees the client leave, as if it had.
        self.transport.close()


def with_read_timeout(seconds: float):
    """The protocol class for ``uvicorn.run(http=...)``, with this deadline per request."""
    return functools.partial(DeadlineProtocol, read_timeout=seconds)
