"""A streaming client for an upstream OpenAI-compatible engine (vLLM, SGLang, llama-server, o3edged).

`stream(req)` sends one o3edge generate request as /chat/completions (messages) or /completions
(prompt), always streamed with usage in the last chunk, and yields ("text", str) events and one
("done", finish_reason, usage) at the end. Any failure (connection refused, a non-200 status, a
read timeout, a malformed or error event, a stream cut before its end) raises UpstreamError. The
request's class and remaining deadline travel as X-O3-Priority / X-O3-Deadline-Ms, which another
o3edged honours and other engines ignore.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import AsyncIterator

import aiohttp

from o3edge.errors import ConfigError
from o3edge.http.config import UpstreamSettings
from o3edge.http.schema import NO_LIMIT
from o3edge.ipc import protocol as P

MAX_LINE = 1 << 20


class UpstreamError(Exception):
    """The upstream failed this request (reason in the message)."""


def read_api_key(path: str) -> str | None:
    """The bearer token from `path` (stripped), None when no file is set; ConfigError if unreadable."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            key = fh.read().strip()
    except OSError as exc:
        raise ConfigError(f"upstream.api_key_file: cannot read {path}: {exc}") from None
    if not key:
        raise ConfigError(f"upstream.api_key_file: {path} is empty")
    return key


def request_body(req: P.GenerateRequest, model: str) -> tuple[str, dict]:
    """(path, JSON body) of the upstream request for `req`."""
    body: dict = {"model": model, "stream": True, "stream_options": {"include_usage": True},
                  "temperature": req.temperature, "top_p": req.top_p}
    if req.max_tokens != NO_LIMIT:  # the HTTP door's "no limit": leave it to the upstream's context
        body["max_tokens"] = req.max_tokens
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.top_k:
        body["top_k"] = req.top_k  # vLLM, SGLang, llama-server and o3edged accept it
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.messages is not None:
        body["messages"] = list(req.messages)
        return "/chat/completions", body
    body["prompt"] = req.prompt
    return "/completions", body


class UpstreamClient:
    """One aiohttp session to the upstream; create and use it on one event loop."""

    def __init__(self, settings: UpstreamSettings):
        self.settings = settings
        self.base = settings.url.rstrip("/")
        self.api_key = read_api_key(settings.api_key_file)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.settings.max_inflight),
                                                  read_bufsize=1 << 16)
        return self._session

    def _headers(self, req: P.GenerateRequest, deadline: float | None) -> dict:
        headers = {"X-O3-Priority": req.priority, "Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if deadline is not None:
            headers["X-O3-Deadline-Ms"] = str(max(1, int((deadline - time.monotonic()) * 1000)))
        return headers

    async def stream(self, req: P.GenerateRequest, deadline: float | None = None) -> AsyncIterator[tuple]:
        """Events of one upstream generation (see the module docstring); raises UpstreamError."""
        path, body = request_body(req, self.settings.model)
        s = self.settings
        total = None if deadline is None else max(0.001, deadline - time.monotonic())
        timeout = aiohttp.ClientTimeout(total=total, sock_connect=s.connect_timeout_s, sock_read=s.read_timeout_s)
        try:
            async with self._client().post(self.base + path, json=body, headers=self._headers(req, deadline),
                                           timeout=timeout) as resp:
                if resp.status != 200:
                    text = (await resp.text(errors="replace"))[:300]
                    raise UpstreamError(f"HTTP {resp.status} from {self.base}{path}: {text}")
                async for event in _events(resp):
                    yield event
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise UpstreamError(f"{type(exc).__name__}: {exc}"[:300] or "upstream failed") from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple]:
    finish, usage = None, None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments, `event:` lines
        data = line[5:].strip()
        if data == b"[DONE]":
            if finish is None:
                raise UpstreamError("the upstream stream ended without a finish reason")
            yield "done", finish, usage or {}
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise UpstreamError(f"upstream error: {str(chunk['error'])[:200]}")
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or ():
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text:
                yield "text", text
            finish = choice.get("finish_reason") or finish
    raise UpstreamError("the upstream closed the stream before [DONE]")
