"""EvalForge's policy wire protocol: msgpack over WebSocket, openpi-compatible.

A leaf package (msgpack, numpy and websockets only) and a distribution of its own
(``pyproject.toml`` here): a simulator running in another Python environment installs
it alone with ``pip install ./services/protocol`` and imports it by the same name,
``services.protocol``. ``codec`` encodes frames, ``messages`` defines what travels in
them, ``client`` talks to a policy server (and holds the retry back-off the workers use
too). ``adapters`` is the one client interface to every protocol the workers speak
(``make_client``): ours, openpi's (``openpi``) and vla-eval's (``vla_eval``). Starting a ``policy-server`` process is not protocol: ``services.supervisor``.
"""

from services.protocol.adapters import PROTOCOLS, PolicyAdapter, ServerInfo, make_client
from services.protocol.codec import DEFAULT_LIMITS, Limits, ProtocolError, packb, unpackb
from services.protocol.messages import (
    PROTOCOL_VERSION,
    ActionsReply,
    ErrorCode,
    Metadata,
    Observation,
)

__all__ = [
    "DEFAULT_LIMITS",
    "PROTOCOLS",
    "PROTOCOL_VERSION",
    "ActionsReply",
    "ErrorCode",
    "Limits",
    "Metadata",
    "Observation",
    "PolicyAdapter",
    "ProtocolError",
    "ServerInfo",
    "make_client",
    "packb",
    "unpackb",
]
