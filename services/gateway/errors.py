"""The gateway's one error: an OpenAI-style answer (HTTP status, message, the offending parameter). Its own module,
so that the request schema and a call's life (core) both raise it without importing each other."""

from __future__ import annotations


class GatewayError(Exception):
    """An OpenAI-style error: HTTP status, message, the offending parameter."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
