"""The memory UCX reads and writes: contiguous buffers (``as_buffer``), a posted request held
together with the buffer it must keep alive (``UcxOp``), and the CUDA context the posting
thread needs (``bind_cuda_device``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


def bind_cuda_device(device: Any) -> None:
    """Make ``device``'s primary CUDA context current on the calling thread; no-op for a
    CPU device. Why: UCX's cuda_copy/cuda_ipc work in the calling thread's context, ucxx
    wants one before it initialises, and a worker creates its CUDA context in its engine
    thread, not in the event loop's thread that makes every UCX call."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return
    torch.cuda.set_device(dev.index if dev.index is not None else torch.cuda.current_device())


def as_buffer(view: Any) -> Any:
    """A ucxx Array over a CPU tensor/ndarray/bytearray, asserting it is contiguous.

    ucxx sends ``ptr, nbytes`` without checking contiguity, so a strided view would move
    the wrong bytes: we refuse it here, before every send and receive.
    """
    from ucxx._lib.arr import Array

    if hasattr(view, "is_contiguous"):
        if not view.is_contiguous():
            raise AssertionError("tensor view for UCX is not contiguous")
        if view.device.type == "cpu":
            view = view.numpy()
    if isinstance(view, np.ndarray) and not view.flags.c_contiguous:
        raise AssertionError("array for UCX is not contiguous")
    arr = Array(view)
    if not arr.contiguous:
        raise AssertionError("buffer for UCX is not contiguous")
    return arr


@dataclass(eq=False)
class UcxOp:
    """A posted UCX request plus the buffer it reads or writes.

    ucxx requests do not keep their buffer alive: dropping the buffer while the request
    is posted lets UCX read freed memory. Hold the op until it completes.
    """

    req: Any
    buffer: Any

    @property
    def completed(self) -> bool:
        return bool(self.req.completed)
