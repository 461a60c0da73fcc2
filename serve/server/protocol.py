"""uvicorn's h11 protocol, answering a request head it cannot parse with a status the client can read.

uvicorn answers every unparsable head with a plain 400 and closes the socket at once; a client still sending its
head (a 200,000-character path, a huge header) then gets a TCP reset instead of the answer, because the kernel
resets a connection closed with unread input. Here the answer names the problem in the API's error shape — 414 when
the head outgrew `h11_max_incomplete_event_size` before its request line ended (the path), 431 when its headers did,
400 for anything else malformed — and the connection closes gracefully: the answer, then our end of the stream
(FIN), then whatever the client still sends is read and discarded until it closes too (at most `LINGER_BYTES` or
`LINGER_S` seconds: a lingering close, RFC 9112 §9.6).
"""

from __future__ import annotations

import http
import json
import logging

import h11
from h11._connection import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE  # what uvicorn itself falls back to
from uvicorn.protocols.http.h11_impl import H11Protocol

LINGER_S = 5.0
LINGER_BYTES = 4 << 20

logger = logging.getLogger("uvicorn.error")


def head_refusal(buffered: bytes, max_head: int) -> tuple[int, str, str]:
    """(status, message, code) for a head h11 refused, from the bytes it had buffered."""
    if len(buffered) <= max_head:
        return 400, "invalid HTTP request head", "invalid_request"
    if b"\n" not in buffered:
        return 414, f"the request line is longer than {max_head} bytes", "uri_too_long"
    return 431, f"the request head is longer than {max_head} bytes", "header_too_large"


class LingeringH11Protocol(H11Protocol):
    """`H11Protocol` with `send_400_response` answering 400 / 414 / 431 (JSON) and closing by lingering."""

    _lingering = False
    _discarded = 0
    _linger_timer = None

    def send_400_response(self, msg: str) -> None:  # uvicorn calls it for every h11.RemoteProtocolError
        buffered = bytes(getattr(self.conn, "_receive_buffer", b""))  # h11 keeps the refused head there
        max_head = self.config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        status, message, code = head_refusal(buffered, max_head)
        logger.warning("refused a request head: %d %s", status, message)
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": code}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=status, headers=headers, reason=http.HTTPStatus(status).phrase),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self._linger()

    def _linger(self) -> None:
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()  # the answer, then FIN: the client reads it whole
        self._lingering = True
        self.flow.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:
            return super().data_received(data)
        self._discarded += len(data)  # the rest of a refused request: read so the kernel has no reason to reset
        if self._discarded > LINGER_BYTES:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)
