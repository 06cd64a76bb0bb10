"""The errors every layer may raise and catch, in one module that imports nothing of the engine.

Why one module: the model layers, the quantized-checkpoint loader, the scheduler, the serving routes and the UI all
raise or translate the same few classes; keeping them here lets each layer import them without importing the layer
that first raised them (the scheduler's request module, the async engine).

``EngineError``-style errors a user can act on carry a ``message``; the API maps them to OpenAI-shaped 4xx bodies
(``param`` names the offending field) and ``EngineUnavailableError`` and its subclasses to 503.
"""

from __future__ import annotations


class EngineError(ValueError):
    """An error a user can act on (bad parameter, prompt too long, model will not fit...).

    ``param`` names the offending field so the API can report it in an OpenAI-shaped error body.
    """

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class EngineUnavailableError(RuntimeError):
    """The request cannot be served right now (HTTP 503): no model, a switch, a shutdown."""

    def __init__(self, message: str, code: str = "engine_unavailable"):
        super().__init__(message)
        self.message = message
        self.code = code


class ModelSwitchedError(EngineUnavailableError):
    """The model serving this request was replaced; the request was aborted."""

    def __init__(self, message: str):
        super().__init__(message, code="model_switched")


class NoModelLoadedError(EngineUnavailableError):
    def __init__(self, message: str = "no model loaded: load one with POST /v1/models/load or from the UI"):
        super().__init__(message, code="no_model_loaded")


class EngineStepError(RuntimeError):
    """The engine failed while running this request (a bug, or the device failed); it was aborted."""
