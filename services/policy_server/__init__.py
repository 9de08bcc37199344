"""The policy server: a policy checkpoint behind the msgpack/WebSocket protocol.

``policy_format`` reads policy.json, ``engines`` runs the model (vLLM or
transformers), ``app`` serves it, ``cli`` is the ``policy-server`` command.
"""
