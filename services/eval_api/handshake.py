"""Reading a policy server's handshake, which is how ``POST /policies`` learns what it serves.

The protocol's client connects (retrying until the deadline), reads the metadata
frame the server sends first — policy name, checkpoint sha256, dims, chunk size,
tasks — and disconnects. Any failure becomes ``HandshakeFailed`` with the reason,
which the route returns as a 422.
"""

from __future__ import annotations

from services.protocol.client import ClientSettings, PolicyClient, PolicyUnavailable
from services.protocol.codec import ProtocolError
from services.protocol.messages import Metadata


class HandshakeFailed(Exception):
    """The endpoint did not answer with a policy server's handshake."""


def read_handshake(endpoint: str, timeout_s: float) -> Metadata:
    """The metadata frame of the policy server at ``endpoint`` (a ws:// or wss:// URL)."""
    client = PolicyClient(endpoint, ClientSettings(connect_deadline_s=timeout_s, call_timeout_s=timeout_s,
                                                   max_backoff_s=min(1.0, timeout_s / 4)))
    try:
        return client.connect()
    except PolicyUnavailable as exc:
        raise HandshakeFailed(str(exc)) from exc
    except ProtocolError as exc:
        raise HandshakeFailed(f"{endpoint} answered, but not with a policy server's handshake: {exc}") from exc
    except Exception as exc:  # a user-supplied URL can fail in many ways (IDNA, ports…): report, not crash
        raise HandshakeFailed(f"could not connect to {endpoint}: {exc}") from exc
    finally:
        client.close()
