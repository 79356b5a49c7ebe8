"""Typed errors shared by every layer.

Each error carries a stable ``code`` so that the router can map it to an HTTP status and a
NATS handler can put it in an error reply without string matching.
"""

from __future__ import annotations


class FluidPDError(Exception):
    """Base class: every error we raise on purpose."""

    code = "internal_error"
    http_status = 500


class InvalidRequestError(FluidPDError):
    """The caller sent something we cannot serve (bad field, too long, unknown model)."""

    code = "invalid_request_error"
    http_status = 400


class ModelLoadError(FluidPDError):
    """A model could not be loaded: missing file, corrupt file, unsupported architecture."""

    code = "model_load_error"
    http_status = 500


class ContextLengthError(InvalidRequestError):
    """Prompt (plus requested tokens) exceeds the model's context limit."""

    code = "context_length_exceeded"


class NoFreeBlocksError(FluidPDError):
    """Not enough free KV blocks right now. The caller may queue and retry; nothing changed."""

    code = "kv_capacity_exhausted"
    http_status = 503

    def __init__(self, needed_blocks: int, free_blocks: int) -> None:
        super().__init__(f"need {needed_blocks} KV blocks, {free_blocks} free")
        self.needed_blocks = needed_blocks
        self.free_blocks = free_blocks


class WorkerNotActiveError(FluidPDError):
    """This worker is draining or switching roles: send the work elsewhere (retryable)."""

    code = "worker_not_active"
    http_status = 503


class BlockStateError(FluidPDError):
    """A block-manager call that breaks ownership rules (double free, unknown owner, ...)."""

    code = "block_state_error"
