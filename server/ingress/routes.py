"""The internal listener's routes: a path and a method to a handler's reply."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from protocol.codec import compact_json
from protocol.http11 import Request

JSON = "application/json; charset=utf-8"


@dataclass(slots=True)
class Reply:
    status: int
    body: bytes
    content_type: str
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, status: int, value: Any) -> Reply:
        return cls(status, compact_json(value).encode(), JSON)

    @classmethod
    def error(cls, status: int, message: str, **extra: Any) -> Reply:
        return cls.json(status, {"error": message, **extra})


Handler = Callable[[Request], Awaitable[Reply]]


class Routes:
    """Exact paths (the query is ignored); ``HEAD`` is served wherever ``GET`` is."""

    def __init__(self) -> None:
        self._paths: dict[str, dict[str, Handler]] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        methods = self._paths.setdefault(path, {})
        if method in methods:
            raise ValueError(f"{method} {path} is routed twice")
        methods[method] = handler

    def find(self, method: str, path: str) -> Handler | Reply:
        """The handler, or the reply that says why there is none (404, 405)."""
        methods = self._paths.get(path)
        if methods is None:
            return Reply.error(404, f"no such path: {path}")
        handler = methods.get("GET" if method == "HEAD" else method)
        if handler is None:
            allowed = sorted({*methods, *(("HEAD",) if "GET" in methods else ())})
            refusal = Reply.error(405, f"{method} not allowed on {path}")
            refusal.headers = (("Allow", ", ".join(allowed)),)
            return refusal
        return handler
