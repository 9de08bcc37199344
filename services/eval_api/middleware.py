"""The request-body size cap: bodies over ``EVALFORGE_MAX_BODY_BYTES`` get a 413 before parsing.

A declared ``Content-Length`` over the cap is refused without reading the body. A
body without one (chunked) is read here, counted as it arrives and refused as soon
as it passes the cap; under the cap it is handed to the app as read. So no request
makes the server buffer more than the cap. (Raising from inside the app's own body
read would not do: FastAPI turns any error there into a 400.)
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.eval_api.errors import error_response


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, "payload_too_large", f"request body is larger than this server's limit of {self.max_bytes} "
            "bytes; send a smaller body (the limit is EVALFORGE_MAX_BODY_BYTES)", headers={"Connection": "close"})
        await response(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        chunked = False
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
            elif name == b"transfer-encoding":
                chunked = True
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        if not chunked:
            await self.app(scope, receive, send)  # the server enforces the declared length
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
