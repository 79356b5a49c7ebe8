"""Two gaps of ucxx 0.52's Python layer that ``TransferNode`` works around: it does not expose
``Request.cancel`` (``find_cancel`` reaches the exported C++ method through ctypes), and its
blocking progress mode never re-arms the UCX worker after an epoll event
(``rearm_after_events`` does, as ucx-py does)."""

from __future__ import annotations

import asyncio
import ctypes
import time
from collections.abc import Callable
from pathlib import Path


def find_cancel() -> Callable[[int], None] | None:
    """``ucxx::Request::cancel()`` (``ucp_request_cancel``) from libucxx.so, called with a
    request's ``ucxx_ptr``; None where the wheel does not export it. Load after ucxx
    initialised (libucxx needs libucp loaded)."""
    try:
        import libucxx  # the wheel that carries libucxx.so

        path = Path(libucxx.__file__).parent / "lib64" / "libucxx.so"
        fn = ctypes.CDLL(str(path))._ZN4ucxx7Request6cancelEv
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p]
    fn.restype = None
    return lambda ptr: fn(ptr)


def rearm_after_events(
    loop: asyncio.AbstractEventLoop, after_progress: Callable[[], None]
) -> Callable[[], None] | None:
    """Make ucxx's blocking progress mode re-arm the UCX worker after each epoll event.

    ucxx 0.52's ``BlockingMode`` progresses the worker when its epoll fd is readable but
    never re-arms it, so after the first transfer the fd stays readable and the event loop
    runs the reader on every turn: ~40% of a core per idle worker, and the engine thread
    waits up to a GIL switch interval (5 ms) after each step (measured: +5 ms per decode
    iteration and per prefill). Re-arming after the event (as ucx-py does) lets the loop
    sleep in epoll again. ``after_progress`` runs after every worker progress made here
    (it wakes the waiters of requests that completed). Returns the function that
    progresses the worker and re-arms it (call it after posting an operation: local work
    raises no epoll event); None (nothing changed) for other progress modes.
    """
    from ucxx._lib_async import application_context as app
    from ucxx._lib_async.continuous_ucx_progress import BlockingMode

    task = app.ProgressTasks.get(loop)
    if not isinstance(task, BlockingMode):
        return None

    async def arm_worker() -> None:
        # ucxx's BlockingMode._arm_worker plus ``after_progress``: progress until UCX
        # agrees to arm, letting every ready task run in between (sock_recv on the closed
        # socket pair returns once the loop has polled for I/O).
        while True:
            task.last_progress_time = time.monotonic()
            task.worker.progress()
            after_progress()
            await loop.sock_recv(task.rsock, 1)
            if task.worker.arm():
                return

    def on_event() -> None:
        task.worker.progress()
        after_progress()
        if task.arm_task is None or task.arm_task.done():
            task.arm_task = loop.create_task(arm_worker())

    fd = task.worker.epoll_file_descriptor
    loop.remove_reader(fd)
    loop.add_reader(fd, on_event)
    return on_event
