"""One UCX worker per process: address, endpoint cache, tagged send/recv, cancellation.

Choices (measured on a 2-core host, ucxx 0.52 / UCX 1.21, see docs/transfer.md):

- Progress mode ``blocking`` (the ucxx default ``thread`` costs 4-5x p50 latency here).
- Peers connect by *worker address* (no listener). The transport follows the pair: a peer
  on the same host gets an endpoint with error handling OFF, which lets UCX use shared
  memory (``sm``: CMA single-copy rendezvous); a peer on another host gets error handling
  ON (network transports). With error handling off UCX never reports a dead peer, so peer
  death is detected by our own deadlines. ``UCX_TLS`` is left to UCX (fastest that works)
  unless configured; it is process-wide, so it is set before UCX initialises.
- Waits are event-driven (ucx_wait): woken after the worker progress that completes them.
- Receives are posted on the worker (matched by tag alone). ucxx's Python layer does not
  expose ``Request.cancel``; we call the exported C++ ``ucxx::Request::cancel()``
  (``ucp_request_cancel``) through ctypes. Where that symbol is missing, cancelled receives
  stay posted and their blocks stay pinned (never reused) until they drain — safe, leaky.

Exactly one TransferNode may exist per process (ucxx keeps one context per process). The
buffers and posted requests it handles are in ucx_memory.py; the two ucxx gaps it works
around (cancel, blocking-mode re-arm) in ucxx_workarounds.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.transfer.errors import TransportError
from shared.transfer.ucx_guard import PeerFailureGuard, apply_env_defaults
from shared.transfer.ucx_memory import UcxOp, as_buffer, bind_cuda_device
from shared.transfer.ucx_wait import SAFETY_POLL_S, CompletionWaiters
from shared.transfer.ucxx_workarounds import find_cancel, rearm_after_events

log = logging.getLogger(__name__)


def default_host_id() -> str:
    """Hostname plus boot id: two containers on one host name still differ by boot id."""
    boot = ""
    with contextlib.suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class TransferNodeConfig:
    """``ucx_tls``: None leaves UCX_TLS to the environment / UCX's own choice.
    ``cuda_device``: the device whose memory this process moves (``cuda``, ``cuda:N``), or
    None for CPU memory only."""

    ucx_tls: str | None = None
    host_id: str = field(default_factory=default_host_id)
    cancel_grace_s: float = 5.0
    cuda_device: str | None = None

    def __post_init__(self) -> None:
        if self.cancel_grace_s <= 0:
            raise ValueError("cancel_grace_s must be > 0")
        if self.cuda_device is not None and not self.cuda_device.startswith("cuda"):
            raise ValueError(f"cuda_device must be cuda or cuda:N, got {self.cuda_device!r}")


class TransferNode:
    """Owns this process's ucxx worker. Call ``await start()`` inside the event loop."""

    def __init__(self, config: TransferNodeConfig | None = None) -> None:
        self.config = config or TransferNodeConfig()
        self._ctx: Any = None
        self._endpoints: dict[bytes, Any] = {}
        self._connecting: dict[bytes, asyncio.Future[Any]] = {}
        self._cancel_fn: Callable[[int], None] | None = None
        self._kick: Callable[[], None] | None = None
        self._guard = PeerFailureGuard()
        self._failed_peers: set[bytes] = set()
        self._lingering: list[UcxOp] = []  # unsettled ops whose buffers must stay alive
        self._waiters = CompletionWaiters()  # event-driven waits (blocking mode)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Initialise UCX (progress mode ``blocking``). Raises TransportError on failure."""
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        apply_env_defaults()  # see ucx_guard: a dead sender must not take the receiver down
        if self.config.ucx_tls is not None:
            os.environ["UCX_TLS"] = self.config.ucx_tls
        if self.config.cuda_device is not None:
            bind_cuda_device(self.config.cuda_device)
        import ucxx

        try:
            ucxx.init(progress_mode="blocking")
        except RuntimeError as exc:  # already initialised in this process
            raise TransportError(f"one TransferNode per process: {exc}") from None
        # ucxx keeps its context private; the worker is what we post requests on.
        self._ctx = ucxx.core._get_ctx()
        self._kick = rearm_after_events(asyncio.get_running_loop(), self._waiters.wake_completed)
        self._cancel_fn = find_cancel()  # after ucxx loaded libucp, which libucxx needs
        if not self._guard.install():
            log.warning("UCS log hook not installed: a peer dying mid-copy may abort us")
        if self._cancel_fn is None:
            log.warning("ucxx Request::cancel not found: cancelled receives drain instead")

    async def close(self) -> None:
        """Close every cached endpoint. The node cannot be restarted in this process."""
        for ep in self._endpoints.values():
            with contextlib.suppress(Exception):
                ep.close_blocking(10**8, 1)
        self._endpoints.clear()

    @property
    def started(self) -> bool:
        return self._ctx is not None

    @property
    def address(self) -> bytes:
        """This worker's UCX address (goes into the worker's registration)."""
        return bytes(self._ctx.worker.address.tobytes())

    @property
    def host_id(self) -> str:
        return self.config.host_id

    @property
    def can_cancel(self) -> bool:
        return self._cancel_fn is not None

    @property
    def peer_guard_installed(self) -> bool:
        return self._guard.installed

    @property
    def peer_copy_failures_vetoed(self) -> int:
        """How many failed copies of a dead peer's memory UCX would have aborted us for."""
        return self._guard.vetoed

    def note_peer_failure(self, peer_address: bytes) -> None:
        """A UCX operation with this peer failed at the transport (on one host: a copy of
        its memory found the process gone)."""
        self._failed_peers.add(peer_address)

    def peer_failed(self, peer_address: bytes) -> bool:
        """True once ``note_peer_failure`` was called for this address. A restarted worker
        has a new UCX address, so a dead peer's address never comes back to life."""
        return peer_address in self._failed_peers

    def transport_label(self, peer_host_id: str) -> str:
        """Which path a transfer with this peer takes, for logs and outcomes."""
        tls = os.environ.get("UCX_TLS", "auto")
        kind = "same-host" if peer_host_id == self.host_id else "cross-host"
        return f"{kind}(UCX_TLS={tls},err_handling={'off' if kind == 'same-host' else 'on'})"

    # ------------------------------------------------------------------ endpoints
    async def endpoint(self, peer_address: bytes, peer_host_id: str) -> Any:
        """The cached endpoint to ``peer_address``, created on first use."""
        ep = self._endpoints.get(peer_address)
        if ep is not None and ep.alive:
            return ep
        pending = self._connecting.get(peer_address)
        if pending is not None:
            return await pending
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._connecting[peer_address] = fut
        try:
            import ucxx
            from ucxx._lib import libucxx as ucx_api

            addr = ucxx.get_ucx_address_from_buffer(peer_address)
            ep = ucx_api.UCXEndpoint.create_from_worker_address(
                self._ctx.worker, addr, peer_host_id != self.host_id
            )
            self._ctx.worker.progress()
            self._endpoints[peer_address] = ep
            fut.set_result(ep)
            return ep
        except Exception as exc:
            err = TransportError(f"cannot connect to peer: {type(exc).__name__}")
            fut.set_exception(err)
            fut.exception()  # mark retrieved: waiters (if any) re-raise it
            raise err from None
        finally:
            del self._connecting[peer_address]

    # ------------------------------------------------------------------ requests
    def post_recv(self, buffer: Any, tag: int) -> UcxOp:
        """Post a worker-level tagged receive into ``buffer`` (must be contiguous)."""
        from ucxx.types import Tag

        arr = as_buffer(buffer)
        op = UcxOp(self._ctx.worker.tag_recv(arr, Tag(tag)), (arr, buffer))
        if self._kick is not None:
            self._kick()
        return op

    def post_send(self, ep: Any, buffer: Any, tag: int) -> UcxOp:
        """Post a tagged send of ``buffer`` (must be contiguous) on endpoint ``ep``."""
        from ucxx.types import Tag

        arr = as_buffer(buffer)
        op = UcxOp(ep.tag_send(arr, Tag(tag)), (arr, buffer))
        if self._kick is not None:
            self._kick()
        return op

    async def wait(self, op: UcxOp, poll_s: float | None = None) -> None:
        """Await completion; raises TransportError on any UCX error (incl. cancellation).

        Blocking progress mode: event-driven (see ucx_wait), costing no CPU while nothing
        happens; ``poll_s=None`` is a hot wait (spins briefly first, then re-checks every
        2 ms as a safety net), else the safety re-check runs every ``poll_s``. Other modes:
        ``poll_s=None`` is ucxx's own wait (polls every loop turn), else a check every
        ``poll_s`` seconds.
        """
        try:
            if self._kick is not None:
                await self._waiters.until_complete(
                    op, hot=poll_s is None, poll_s=poll_s or SAFETY_POLL_S
                )
            elif poll_s is not None:
                while not op.completed:
                    await asyncio.sleep(poll_s)
            await op.req.wait()  # complete by now: raises the request's error, if any
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise TransportError(f"UCX request failed: {type(exc).__name__}") from None

    def cancel(self, op: UcxOp) -> None:
        """Ask UCX to cancel ``op`` (no effect once complete). Completion comes later."""
        if self._cancel_fn is not None and not op.completed:
            self._cancel_fn(op.req.ucxx_ptr)

    def linger(self, op: UcxOp) -> None:
        """Keep ``op`` (and so its buffer) alive until UCX completes it. A tag send cannot
        be cancelled: one the peer never matched (it was stopped) may still be read later,
        and must not read freed memory then."""
        self._lingering = [o for o in self._lingering if not o.completed]
        if not op.completed:
            self._lingering.append(op)

    async def let_go(self, op: UcxOp, grace_s: float = 0.05) -> None:
        """Done with ``op``: settle it, and if UCX still holds it after ``grace_s`` (an
        unmatched send cannot be cancelled) keep it and its buffer alive (``linger``)."""
        if not await self.settle(op, grace_s=grace_s):
            self.linger(op)

    async def send_control(self, ep: Any, frame: bytes, tag: int, timeout_s: float) -> None:
        """Best effort: send a small sealed control frame (verdict, abort), waiting for it at
        most ``timeout_s``; the peer has its own deadline. Raises TransportError only when
        the send cannot even be posted."""
        op = self.post_send(ep, bytearray(frame), tag)
        with contextlib.suppress(TimeoutError, TransportError):
            async with asyncio.timeout(timeout_s):
                await self.wait(op)
        await self.let_go(op)

    async def settle(self, req: UcxOp, grace_s: float | None = None) -> bool:
        """Cancel ``req`` and wait until UCX reports it complete (or ``grace_s`` passes).

        Returns True once UCX no longer touches the request's buffer; False if it is
        still posted after the grace period (the caller must keep the buffer pinned).
        """
        if req.completed:
            return True
        self.cancel(req)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + (grace_s if grace_s is not None else self.config.cancel_grace_s)
        delay_s = 0.0
        while not req.completed and loop.time() < give_up:
            self._ctx.worker.progress()
            self._waiters.wake_completed()
            await asyncio.sleep(delay_s)
            delay_s = min(0.01, delay_s + 0.0005)
        return bool(req.completed)
