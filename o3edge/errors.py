"""Coded errors: every failure a user can see carries a stable code and a readable message."""


class O3Error(Exception):
    """Base error; `code` is stable and goes on the wire as the error code."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    @property
    def message(self) -> str:
        return str(self)


class ConfigError(O3Error):
    code = "bad_config"


class CheckpointError(O3Error):
    """A model directory is missing, broken, or of an architecture we do not support."""

    code = "bad_checkpoint"


class InvalidRequest(O3Error):
    code = "invalid_request"


class PromptTooLong(InvalidRequest):
    code = "prompt_too_long"


class OutOfCapacity(O3Error):
    """The KV cache cannot hold the request, even with everything else evicted."""

    code = "out_of_capacity"


class Busy(O3Error):
    """The queue is full or the request's class is shedding load; try again later."""

    code = "busy"


class EngineFailed(O3Error):
    """The engine cannot serve any more (device lost, memory that cannot be freed): o3edged exits `failed`."""

    code = "unavailable"
