"""Keep a receiver alive when the peer it is copying from dies (same host, no UCX error handling).

Same-host endpoints run with UCX error handling OFF (the only way UCX uses its shared-memory
single-copy path here, see ucx_node.py). A rendezvous receive is then a CMA read
(``process_vm_readv``) of the *sender's* memory, done by the receiver. If the sender is
SIGKILLed between its RTS and that read, the read fails with ESRCH and UCX 1.21 reacts in one
of two ways, both fatal to the receiver (seen with cores, ~1 run in 4 of the sender-killed
test):

1. The receiver's endpoint for that peer is one UCX created itself during wire-up (never
   exposed to us): UCX destroys it. RTS messages from the dead sender still queued in the
   shared-memory FIFO carry that endpoint's id, which without error handling is a raw
   pointer: matching one against a posted receive dereferences freed memory (SIGSEGV in
   ``ucp_proto_rndv_send_reply``). **Fix:** ``UCX_PROTO_INDIRECT_ID=on`` makes endpoint ids
   keys of a checked map, so such an RTS is dropped ("RTS on non-existing endpoint").
2. The endpoint is one we created (after the first verdict the receiver's own endpoint to the
   sender is paired with the sender's): with no error callback UCX logs the failed read at
   FATAL level, and its default log handler aborts (SIGABRT in ``uct_cma_ep_tx_error``).
   **Fix:** a UCS log handler that stops exactly that FATAL message from reaching the
   aborting default handler. UCX has already failed the endpoint's lanes at that point and
   returns an I/O error for the read, so the receive completes with an error, as a TCP
   endpoint with error handling would.

A receive whose RTS was dropped (case 1) stays matched inside UCX forever and cannot be
cancelled; nothing can write into its buffer (the only writer would be our own read of the
dead peer). ``TransferNode.peer_failed`` tells the receiver when a peer is known dead, so it
may release such blocks instead of pinning them forever.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Process-wide UCX settings this module relies on; applied before UCX initialises.
UCX_ENV_DEFAULTS = {"UCX_PROTO_INDIRECT_ID": "on"}

_UCS_LOG_FATAL = 0  # ucs_log_level_t
_RC_STOP, _RC_CONTINUE = 0, 1  # ucs_log_func_rc_t
# Only the failed single-copy read/write of a peer's memory: every other FATAL still aborts.
_VETO_FILES = (b"cma_ep.c",)

_LOG_FUNC = ctypes.CFUNCTYPE(
    ctypes.c_int,  # ucs_log_func_rc_t
    ctypes.c_char_p,  # file
    ctypes.c_uint,  # line
    ctypes.c_char_p,  # function
    ctypes.c_int,  # level
    ctypes.c_void_p,  # component config
    ctypes.c_char_p,  # format
    ctypes.c_void_p,  # va_list
)


def apply_env_defaults() -> None:
    """Set the UCX variables above unless the operator set them. Call before ucxx.init."""
    for key, value in UCX_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


def _loaded_libucs() -> Path | None:
    """The libucs this process already loaded (through ucxx), so we hook the same copy."""
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1]
            if "/libucs.so" in path:
                return Path(path)
    except OSError:
        return None
    return None


class PeerFailureGuard:
    """Installs the UCS log handler described in the module docstring (once per process)."""

    def __init__(self) -> None:
        self.vetoed = 0  # FATAL peer-copy failures kept from aborting the process
        self._lib: Any = None
        self._handler: Any = None  # the ctypes callback must outlive its registration

    def install(self) -> bool:
        """Returns False (and changes nothing) where libucs cannot be found."""
        path = _loaded_libucs()
        if path is None:
            return False
        try:
            lib = ctypes.CDLL(str(path))
            push = lib.ucs_log_push_handler
        except (OSError, AttributeError):
            return False

        def handler(
            file: bytes | None,
            line: int,
            function: bytes | None,
            level: int,
            comp: int | None,
            fmt: bytes | None,
            ap: int | None,
        ) -> int:
            # Runs inside UCX progress: no allocation-heavy work, no logging calls here.
            if level == _UCS_LOG_FATAL and file is not None and file.endswith(_VETO_FILES):
                self.vetoed += 1
                return _RC_STOP
            return _RC_CONTINUE

        self._handler = _LOG_FUNC(handler)
        push.argtypes = [_LOG_FUNC]
        push.restype = None
        push(self._handler)
        self._lib = lib
        return True

    @property
    def installed(self) -> bool:
        return self._handler is not None
