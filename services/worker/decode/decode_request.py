"""One request on a decode worker, and the error item that ends its stream."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from services.worker.token_stream import TokenStreamer
from shared.engine.sequence import Sequence
from shared.messages import TokenItem


@dataclass(eq=False)
class DecodeRequest:
    request_id: str
    tokens_subject: str
    seq: Sequence
    arrival_s: float
    phase: str = "receiving"  # receiving | runnable
    receive_task: asyncio.Task[Any] | None = None
    stolen_tokens: int = 0
    suffix_token_ids: tuple[int, ...] = ()
    migrating: bool = False
    ticket: Any = None
    receive_started: bool = False
    # A live migration in: the worker it comes from, which owns the move's outcome ("" else).
    migrated_from: str = ""
    timestamps: dict[str, float] = field(default_factory=dict)


def add_error_item(streamer: TokenStreamer, req: DecodeRequest, error: str, code: str) -> None:
    """Queue the error item that ends ``req``'s token stream (the caller flushes it and
    drops the request)."""
    streamer.add(
        req.tokens_subject,
        TokenItem(
            request_id=req.request_id,
            index=len(req.seq.output_token_ids),
            finish_reason="error",
            error=error,
            error_code=code,
        ),
    )
