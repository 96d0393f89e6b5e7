"""The HTTP door's endpoints: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

Each generate request waits for its first reply before answering, so a refusal (`busy`, a prompt
too long, the daemon draining) gets its own status code even when the client asked for a stream;
after that, tokens go out as server-sent events as the engine produces them (the replies of one
engine step in one write). A client that disconnects, or whose reply write blocks for
send_timeout_s, has its request cancelled: aiohttp cancels the handler, and leaving
LocalDoor.open() aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import TYPE_CHECKING, Callable

from aiohttp import web

from o3edge.http import schema as S
from o3edge.http.door import LocalDoor
from o3edge.ipc import protocol as P

if TYPE_CHECKING:
    from o3edge.http.config import HttpSettings
    from o3edge.ipc.server import IPCServer

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Routes:
    """Request handlers over one LocalDoor; `metrics()` renders the Prometheus text."""

    def __init__(self, server: "IPCServer", door: LocalDoor, settings: "HttpSettings",
                 metrics: Callable[[], bytes] | None = None):
        self.server, self.door, self.settings = server, door, settings
        self.metrics_text = metrics
        self.created = int(time.time())

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)

    # ---- plain GETs ---------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        state = self.server.state
        return web.json_response({"status": state}, status=200 if state == "ready" else 503)

    async def models(self, request: web.Request) -> web.Response:
        name = self.model_name()
        if name is None:
            raise S.HttpError(503, P.UNAVAILABLE, f"the engine is {self.server.state}; no model is served yet")
        return web.json_response({"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "o3edge",
             "max_model_len": self.server.loop.view.max_model_len}]})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.metrics_text() if self.metrics_text else b""
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def model_name(self) -> str | None:
        """The served model's name (its directory's), None until the engine is loaded."""
        view = self.server.loop.view  # the engine loop's published facts: the engine is its thread's alone
        if self.server.loop.state != "ready" or view is None:
            return None
        return view.model["model"]

    # ---- generation -------------------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, S.CHAT)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, S.COMPLETION)

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        body = await self._json(request)
        model = self._check_model(body)
        request_id = uuid.uuid4().hex[:24]
        req = S.to_generate(body, kind, request_id, request.headers)
        shaper = S.Shaper(kind, request_id, model)
        async with self.door.open(req) as stream:
            batch = await stream.next_batch()
            if batch[0]["type"] == "error":
                raise S.from_o3_error(batch[0])
            if not req.stream:
                return web.json_response(shaper.response(batch[-1]))
            return await self._stream(request, stream, batch, shaper, S.wants_usage_chunk(body))

    async def _stream(self, request: web.Request, stream, batch: list[dict], shaper: S.Shaper,
                      with_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        try:
            await self._send(response, _event(shaper.chunk(role=True)) if shaper.kind == S.CHAT else b"")
            while True:
                await self._send(response, b"".join(_events(batch, shaper, with_usage)))
                if stream.finished:
                    break
                batch = await stream.next_batch()
        except ConnectionResetError:  # gone: leaving open() unfinished cancels the request
            log.debug("HTTP client went away mid-stream")
        except asyncio.TimeoutError:
            log.info("HTTP client read nothing while a write waited %g s: request cancelled",
                     self.settings.send_timeout_s)
            if request.transport is not None:
                request.transport.abort()
        return response  # aiohttp ends it (write_eof), quietly when the client has already left

    async def _send(self, response: web.StreamResponse, data: bytes) -> None:
        """Write; a client that stops reading blocks the write: give up after send_timeout_s. (A timer
        handle, not asyncio.wait_for: that makes a task per write, a fifth of the door's cost per token.)"""
        if not data:
            return
        task, expired = asyncio.current_task(), []
        timer = asyncio.get_running_loop().call_later(self.settings.send_timeout_s,
                                                      lambda: expired.append(task.cancel()))
        try:
            await response.write(data)
        except asyncio.CancelledError:
            if expired:
                raise asyncio.TimeoutError from None
            raise
        finally:
            timer.cancel()

    async def _json(self, request: web.Request) -> object:
        size = request.content_length
        if size is not None and size > self.settings.max_body_bytes:
            raise S.HttpError(413, P.INVALID_REQUEST, f"request body of {size} bytes exceeds the "
                              f"{self.settings.max_body_bytes}-byte limit")
        try:
            raw = await asyncio.wait_for(request.read(), self.settings.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise S.HttpError(413, P.INVALID_REQUEST, f"request body exceeds the "
                              f"{self.settings.max_body_bytes}-byte limit") from None
        except asyncio.TimeoutError:
            raise S.HttpError(408, P.INVALID_REQUEST, f"request body not received within "
                              f"{self.settings.body_timeout_s:g} s") from None
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise S.HttpError(400, P.INVALID_REQUEST, f"the request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise S.HttpError(400, P.INVALID_REQUEST, "the request body nests too deeply") from None
        if _lone_surrogate(body):
            raise S.HttpError(400, P.INVALID_REQUEST, "the request body holds a lone UTF-16 surrogate escape "
                              "(\\ud800-\\udfff without its pair), which is not text")
        return body

    def _check_model(self, body: object) -> str:
        served = self.model_name()
        if served is None:
            raise S.HttpError(503, P.UNAVAILABLE, {"loading": "the engine is still loading; retry when /health "
                                                   "reports ready"}.get(self.server.state,
                                                                        f"the engine is {self.server.state}"))
        asked = body.get("model") if isinstance(body, dict) else None
        if asked not in (None, "", served):
            raise S.HttpError(404, "model_not_found", f"the model {str(asked)[:100]!r} does not exist; this "
                                                      f"daemon serves {served!r}", "model")
        return served


def _lone_surrogate(body: object) -> bool:
    """Whether any string in a parsed JSON body (keys included) holds a lone surrogate: JSON's \\ud800 escapes decode
    to one, which no tokenizer takes and no UTF-8 holds (a chat role with one left its request unanswered)."""
    stack = [body]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _events(batch: list[dict], shaper: S.Shaper, with_usage: bool):
    """SSE bytes for a batch of o3edge replies (token, done or error)."""
    for message in batch:
        kind = message["type"]
        if kind == "token":
            if message["text"]:
                yield _event(shaper.chunk(message["text"]))
        elif kind == "done":
            yield _event(shaper.chunk(finish_reason=S.finish_reason(message)))
            if with_usage:
                yield _event(shaper.usage_chunk(message))
            yield b"data: [DONE]\n\n"
        else:  # an error after the stream began: vLLM's shape, then the end
            err = S.from_o3_error(message)
            yield _event(err.body())
            yield b"data: [DONE]\n\n"


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Every failure in OpenAI's error shape: ours, aiohttp's (404, 405, 413), and bugs (500)."""
    try:
        return await handler(request)
    except S.HttpError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: P.INVALID_REQUEST}.get(exc.status, "http_error")
        return web.json_response(S.error_body(exc.status, code, exc.reason), status=exc.status,
                                 headers={"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None)
    except (asyncio.CancelledError, ConnectionResetError, asyncio.TimeoutError):
        raise
    except Exception:
        log.exception("HTTP request %s %s failed", request.method, request.path)
        return web.json_response(S.error_body(500, P.INTERNAL, "internal error"), status=500)
