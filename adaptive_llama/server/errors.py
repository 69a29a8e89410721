"""The errors a client can cause, answered in the protocol's own shape: OpenAI's
``{"error": {"message", "type", "param", "code"}}``, Ollama's ``{"error": message}`` on
its routes (``/api/``), llama-server's ``{"error": {"code", "message", "type"}}`` on its own
routes (``/completion``, ``/props``, ...), or Anthropic's ``{"type": "error", "error":
{"type", "message"}}`` on its Messages routes (``/v1/messages``)."""

from __future__ import annotations

from fastapi.responses import JSONResponse


ANTHROPIC_PATH = "/v1/messages"  # the routes of Anthropic's Messages API (.messages)
# llama-server's own routes (.llamacpp), whose errors come in its shape
LLAMACPP_PATHS = ("/completion", "/tokenize", "/detokenize", "/props", "/apply-template",
                  "/metrics")
ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error"}


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
        elif path in LLAMACPP_PATHS or path.startswith("/slots"):
            body = {"error": {"code": self.status, "message": self.message,
                              "type": self.type}}
        elif path.startswith(ANTHROPIC_PATH):
            body = {"type": "error", "error": {"type": self.anthropic_type(),
                                               "message": self.message}}
        else:
            body = {"error": {"message": self.message, "type": self.type,
                              "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


    def anthropic_type(self) -> str:
        """The error's type in Anthropic's words, by its status."""
        if self.status >= 500:
            return "overloaded_error" if self.status == 503 else "api_error"
        return ANTHROPIC_TYPES.get(self.status, "invalid_request_error")


def too_large(max_body: int) -> APIError:
    return APIError(413, f"the body is larger than this server's limit of {max_body:,} "
                    "bytes (adaptive-llama serve --max-body)", code="request_too_large")
