"""The evaluation API: FastAPI routes over the results store, enqueueing episodes for the workers.

``app.create_app`` builds it; ``routes/`` holds one module per resource,
``schemas`` the bodies, ``planning`` checks a request against the suite catalogue,
``handshake`` reads a policy server's metadata, ``settings`` documents every knob.
Episode tasks are published with ``services.queue``, which the workers read too.
"""
