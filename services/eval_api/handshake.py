"""Reading a policy server's handshake, which is how ``POST /policies`` learns what it serves.

The endpoint is checked first (``services.policy_hosts``: no credentials in it, its host
in ``EVALFORGE_POLICY_HOSTS``). Then the client of the server's protocol
(``services.protocol.adapters.make_client``: ours, openpi's or vla-eval's) connects —
retrying only what can succeed later (a refused connection, a timeout) until the
deadline, following no redirect — completes the protocol's opening (our metadata frame:
policy name, checkpoint sha256, dims, chunk size, tasks, cameras, capped by
``services.protocol.messages``; openpi's free-form metadata frame; vla-eval's hello and
its specs) and disconnects. Any failure becomes ``HandshakeFailed``,
which the route returns as a 422.

The reason in ``HandshakeFailed`` is written for the user who typed the URL and for no
one else: it says "refused the connection" or "nothing answered as a policy server
within 10 s", and never quotes what the peer sent. An endpoint is a URL any key holder
chooses; a reply quoting a web service's headers or body would let them read services
the API can reach and they cannot, and wording open, closed and filtered ports apart
would make the API a port scanner.
"""

from __future__ import annotations

from services.policy_hosts import EndpointRefused, HostAllowList, check_endpoint
from services.protocol.adapters import ServerInfo, make_client
from services.protocol.client import ClientSettings, PolicyUnavailable
from services.protocol.codec import ProtocolError


class HandshakeFailed(Exception):
    """The endpoint did not answer with a policy server's handshake (the message says why, peer-free)."""


def read_handshake(endpoint: str, timeout_s: float, protocol: str = "evalforge",
                   observation_keys: dict[str, str] | None = None, *,
                   allowed: HostAllowList | None = None) -> ServerInfo:
    """What the ``protocol`` policy server at ``endpoint`` (a ws:// or wss:// URL) says about itself.

    ``allowed`` defaults to ``EVALFORGE_POLICY_HOSTS`` as the environment says now.
    """
    try:
        check_endpoint(endpoint, allowed)
    except EndpointRefused as exc:
        raise HandshakeFailed(str(exc)) from None
    client = make_client(protocol, endpoint, ClientSettings(connect_deadline_s=timeout_s, call_timeout_s=timeout_s,
                                                            max_backoff_s=min(1.0, timeout_s / 4)),
                         observation_keys=observation_keys)
    try:
        return client.connect()
    except PolicyUnavailable as exc:
        raise HandshakeFailed(str(exc)) from None
    except ProtocolError as exc:  # the client's handshake errors name fields and sizes, never the peer's bytes
        raise HandshakeFailed(f"{endpoint} answered, but not with a usable {protocol} policy server handshake: "
                              f"{exc}") from None
    except ValueError as exc:
        raise HandshakeFailed(str(exc)) from None
    except Exception as exc:  # a user-supplied URL can fail in many ways (IDNA, ports…): report, not crash
        raise HandshakeFailed(f"could not connect to {endpoint} ({type(exc).__name__})") from None
    finally:
        client.close()
