"""One exception hierarchy for the whole project: each error carries an HTTP status and a stable code."""
from __future__ import annotations


class ImpError(Exception):
    """Base error. `status` is the HTTP status a server answers with; `code` is stable for clients."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 status: int | None = None):
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        self.param = param


class InvalidRequestError(ImpError):
    """The request is malformed or out of range (400)."""

    status = 400
    code = "invalid_request_error"


class NotFoundError(ImpError):
    """A named thing (model, stored response) does not exist (404)."""

    status = 404
    code = "not_found"


class ModelLoadError(ImpError):
    """A model, its config, weights or tokenizer cannot be loaded."""

    status = 500
    code = "model_load_error"


class TemplateError(InvalidRequestError):
    """A chat template failed to render (raise_exception, bad messages): the client's fault (400)."""

    code = "template_error"


class EngineError(ImpError):
    """The engine failed (device fault, engine stopped) while serving a request."""

    status = 500
    code = "engine_error"
