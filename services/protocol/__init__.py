"""EvalForge's policy wire protocol: msgpack over WebSocket, openpi-compatible.

A leaf package (msgpack, numpy and websockets only) that a simulator running in
another Python environment can install alone. ``codec`` encodes frames,
``messages`` defines what travels in them, ``client`` talks to a policy server,
``launcher`` starts one (``policy-server`` as a subprocess) for tools and tests.
"""

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
    "PROTOCOL_VERSION",
    "ActionsReply",
    "ErrorCode",
    "Limits",
    "Metadata",
    "Observation",
    "ProtocolError",
    "packb",
    "unpackb",
]
