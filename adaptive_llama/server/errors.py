"""The errors a client can cause, answered in the protocol's own shape: OpenAI's
``{"error": {"message", "type", "param", "code"}}``, or Ollama's ``{"error": message}`` on
its routes (``/api/``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error the client caused (or a busy server), with its HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self, path: str = "") -> JSONResponse:
        if path.startswith("/api/"):
            body = {"error": self.message}
        else:
            body = {"error": {"message": self.message, "type": self.type,
                              "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def too_large(max_body: int) -> APIError:
    return APIError(413, f"the body is larger than this server's limit of {max_body:,} "
                    "bytes (adaptive-llama serve --max-body)", code="request_too_large")
