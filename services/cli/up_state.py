"""The small JSON file in which ``fluidpd up`` records its cluster for ``fluidpd ctl``.

Path: ``$FLUIDPD_STATE_FILE``, else ``$XDG_RUNTIME_DIR/fluidpd/up.json``, else
``~/.cache/fluidpd/up.json``. Content: ``{"nats_url", "router_url", "pid", "pids"}`` and,
when ``fluidpd up`` turned NATS auth on, the operator's ``nats_user``/``nats_password``
(hence mode 0600).
A record whose ``pid`` (the ``fluidpd up`` process) is gone counts as absent.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any


def state_path() -> Path:
    """Where the state file lives (pure apart from reading the environment)."""
    if os.environ.get("FLUIDPD_STATE_FILE"):
        return Path(os.environ["FLUIDPD_STATE_FILE"])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "fluidpd" if runtime else Path.home() / ".cache" / "fluidpd"
    return base / "up.json"


def write_state(doc: dict[str, Any], path: Path | None = None) -> Path:
    """Atomically write ``doc`` (creating the directory, mode 0600). Raises OSError."""
    target = path or state_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2), encoding="utf-8")
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)
    return target


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_state(path: Path | None = None) -> dict[str, Any] | None:
    """The recorded cluster, or None (no file, unreadable, or its ``fluidpd up`` is gone)."""
    try:
        doc = json.loads((path or state_path()).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not _alive(doc.get("pid")):
        return None
    return doc


def remove_state(path: Path | None = None) -> None:
    """Delete the state file if it is ours (same ``pid``). Never raises."""
    target = path or state_path()
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(target.read_text(encoding="utf-8"))
        if isinstance(doc, dict) and doc.get("pid") == os.getpid():
            target.unlink()
