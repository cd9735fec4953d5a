"""A client that leaves for real: one HTTP/1.1 request on a raw socket, closed when the test says.

HTTP client libraries decide for themselves when a connection really closes (a pooled client
closed from another thread, or a half-read streamed response, may keep the socket open); the
disconnect tests need the close to happen exactly when they call it.
"""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit


class RawRequest:
    def __init__(self, url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        u = urlsplit(url)
        self.sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 80), timeout=30)
        data = json.dumps(body).encode()
        head = [f"POST {u.path or '/'} HTTP/1.1", f"Host: {u.netloc}", "Content-Type: application/json"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        head.append(f"Content-Length: {len(data)}")
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        self.received = b""

    def read_until(self, needle: bytes) -> bytes:
        """Read until ``needle`` has arrived (after the headers); what came so far."""
        while needle not in self.received.partition(b"\r\n\r\n")[2]:
            part = self.sock.recv(65536)
            if not part:
                raise AssertionError(f"closed before {needle!r}: {self.received[-500:]!r}")
            self.received += part
        return self.received

    def read_response(self, timeout: float = 60.0) -> bytes:
        """The whole response (its head and Content-Length bytes of body), or what came before the
        connection closed (or was reset, or went silent for ``timeout``)."""
        self.sock.settimeout(timeout)
        while True:
            head, sep, body = self.received.partition(b"\r\n\r\n")
            if sep:
                lengths = [ln for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length:")]
                if lengths and len(body) >= int(lengths[0].split(b":", 1)[1]):
                    return self.received
            try:
                part = self.sock.recv(65536)
            except (TimeoutError, ConnectionResetError):
                return self.received
            if not part:
                return self.received
            self.received += part

    @property
    def status(self) -> int:
        return int(self.received.split(b" ", 2)[1]) if self.received else 0

    def close(self) -> None:
        self.sock.close()
