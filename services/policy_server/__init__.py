"""The policy server: a policy checkpoint behind the msgpack/WebSocket protocol.

``policy_format`` (the top-level package the trainer uses too) reads the checkpoint
and tokenizes; ``engines`` runs the model (vLLM or transformers), ``app`` serves it,
``settings`` and ``cli`` are the ``policy-server`` command.
"""
