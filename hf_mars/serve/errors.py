"""The one error type of the server: a refusal the app answers in the OpenAI error shape."""


class HTTPError(Exception):
    """A request refused with an OpenAI-style error: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.retry_after = status, message, code, param, retry_after
