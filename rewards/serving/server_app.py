"""The HTTP side of the reward server (`flowrl.rewards.serving.server`): the FastAPI application that checks each
request's token, size and memory charge before reading its body, reads it into one buffer, hands it to the server
and answers in one-line JSON.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re

from flowrl.rewards.serving.server_requests import BODY_COST, RequestError, one_line, release_memory
from flowrl.rewards.serving.wire import REQUEST_ID_HEADER, scores_to_json


logger = logging.getLogger("flowrl.rewards.serving.server")

BODY_TIMEOUT_S = 120.0
"""A request body must arrive within this many seconds (a client trickling one is answered 408 and dropped)."""
_DRAIN_BYTES, _DRAIN_SECONDS = 1 << 30, 5.0  # after an early 401/413, drop at most this much of the body (never
# stored) so that a client still sending it reads the answer instead of a reset connection
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")
_TRIM_BYTES = 1 << 20  # after a request of at least this many bytes, freed memory goes back to the system


def make_app(server):
    """The FastAPI application of `server`: `POST /score`, `GET /health`, one-line JSON errors."""
    from fastapi import FastAPI, Request
    from fastapi.responses import Response
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    def answer(status: int, payload: dict, request_id: str | None = None, close: bool = False) -> Response:
        headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
        if close:
            headers["Connection"] = "close"
        data = json.dumps(payload, allow_nan=False).encode()
        return Response(data, status_code=status, headers=headers, media_type="application/json")

    class Refusal(Response):
        """An error answered before the body is read: sent at once, then a bounded part of the body is read and
        dropped (never stored) so that a client still sending it reads the answer, then the connection closes."""

        def __init__(self, request: Request, status: int, message: str):
            headers = {"Connection": "close", **({"WWW-Authenticate": "Bearer"} if status == 401 else {})}
            super().__init__(
                json.dumps({"error": one_line(message)}).encode(),
                status_code=status,
                headers=headers,
                media_type="application/json",
            )
            try:
                unread = int(request.headers.get("content-length", "0"))
            except ValueError:
                unread = 0
            # a client waiting for `100 Continue` sends nothing: there is nothing to drop
            self.unread = 0 if request.headers.get("expect", "").lower() == "100-continue" else unread

        async def __call__(self, scope, receive, send) -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            await send({"type": "http.response.body", "body": self.body, "more_body": self.unread > 0})
            if self.unread <= 0:
                return
            loop = asyncio.get_running_loop()
            left, deadline = min(self.unread, _DRAIN_BYTES), loop.time() + _DRAIN_SECONDS
            try:
                while left > 0 and loop.time() < deadline:
                    message = await asyncio.wait_for(receive(), deadline - loop.time())
                    if message["type"] != "http.request":
                        break
                    left -= len(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
            except asyncio.TimeoutError:
                pass
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            if self.unread >= _TRIM_BYTES:  # the dropped chunks' pages go back to the system
                await run_in_threadpool(release_memory)

    app = FastAPI(title=f"flowrl reward server ({server.name})", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        path = request.url.path
        if err.status_code == 404:
            message = f"no such endpoint {path!r}; use POST /score or GET /health"
        elif err.status_code == 405:
            message = "use POST /score" if path == "/score" else "use GET /health"
        else:
            message = str(err.detail)
        return Refusal(request, err.status_code, message)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception) -> Response:
        logger.error("reward server: unexpected error", exc_info=err)
        return answer(500, {"error": f"internal error: {type(err).__name__}: {one_line(err)}"}, close=True)

    async def health(request: Request) -> Response:
        if server.closed:
            return answer(503, {"error": "the reward server is shutting down"})
        return answer(200, {"reward": server.name, "status": "ok"})

    async def score(request: Request) -> Response:
        headers = request.headers
        try:
            length = int(headers.get("content-length", ""))
            if length < 0:
                raise ValueError
        except ValueError:
            return answer(411, {"error": "a Content-Length header is required"}, close=True)
        if server.token is not None:
            given = headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            valid = hmac.compare_digest(token.strip().encode(), server.token.encode())
            if scheme.lower() != "bearer" or not valid:
                reason = "missing" if not given else "wrong"
                return Refusal(request, 401, f"{reason} token: send Authorization: Bearer TOKEN")
        if length > server.max_body_bytes:
            return Refusal(
                request, 413, f"the body has {length} bytes; this server takes at most {server.max_body_bytes}"
            )
        if server.closed:
            return Refusal(request, 503, "the reward server is shutting down")
        try:  # the body's memory is charged before it is read: bodies in flight together stay within the budget
            server.budget.charge(length * BODY_COST, f"its {length}-byte body")
        except RequestError as err:
            return Refusal(request, err.status, str(err))
        try:
            return await read_and_score(request, length)
        finally:
            server.budget.release(length * BODY_COST)
            if length >= _TRIM_BYTES:  # the body and its decoded images are freed by now: give the pages back
                await run_in_threadpool(release_memory)

    async def read_body(request: Request, length: int) -> bytearray:
        """The body, read into one buffer of its announced length (no list of chunks joined into a copy)."""
        body, got = bytearray(length), 0
        with memoryview(body) as view:
            async for chunk in request.stream():
                if got + len(chunk) > length:
                    raise RequestError(400, f"the body is longer than its Content-Length of {length} bytes")
                view[got : got + len(chunk)] = chunk
                got += len(chunk)
        if got != length:
            raise RequestError(400, f"the body ended after {got} of its {length} bytes (Content-Length)")
        return body

    async def read_and_score(request: Request, length: int) -> Response:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        request_id = request_id if request_id and _REQUEST_ID.fullmatch(request_id) else None
        try:
            body = await asyncio.wait_for(read_body(request, length), BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return answer(408, {"error": f"the body did not arrive within {BODY_TIMEOUT_S:g} s"}, close=True)
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        except RequestError as err:
            return answer(err.status, {"error": one_line(err)}, request_id, close=True)
        try:
            scores = await server._score_body(body, request_id)
        except RequestError as err:
            return answer(err.status, {"error": one_line(err)}, request_id, close=err.status in (400, 413))
        except Exception as err:  # noqa: BLE001  (never let a request end without an answer)
            logger.exception("reward server: unexpected error")
            return answer(500, {"error": f"internal error: {type(err).__name__}: {one_line(err)}"}, request_id)
        return answer(200, {"scores": scores_to_json(scores)}, request_id)

    # plain routes: the handlers take the raw request (no FastAPI parameter parsing: the body is read by hand, after
    # the token and size checks)
    app.add_route("/health", health, methods=["GET"])
    app.add_route("/score", score, methods=["POST"])
    return app
