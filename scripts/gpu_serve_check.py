"""One request through a 1P1D ``fluidpd up`` on the GPU, against ``fluidpd generate``.

A step of scripts/gpu_check.sh (stdlib + the project only). Starts ``fluidpd up`` with one
prefill and one decode worker on ``--device`` (every prompt takes the disaggregated path:
``--short-prompt-tokens 0``, so the KV moves P -> D over UCX from device memory), sends one
greedy completion, runs ``fluidpd generate`` on the same model and device, and compares the
texts. Prints one JSON line; exit 0 when equal, 1 when not or on any failure, 2 on bad
arguments. Always stops the cluster it started.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
READY = "fluidpd up: ready"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _generate(args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "services.cli.main", "generate", "--model", args.model]
    cmd += ["--prompt", args.prompt, "--max-tokens", str(args.max_tokens), "--json"]
    cmd += ["--ignore-eos", "--device", args.device]
    out = subprocess.run(cmd, check=True, capture_output=True, cwd=REPO, env=env, timeout=120)
    result: dict[str, Any] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


def _complete(url: str, args: argparse.Namespace) -> dict[str, Any]:
    body = {
        "model": args.model,
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "fluidpd_timestamps": True,
    }
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        result: dict[str, Any] = json.loads(resp.read())
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-gpu")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog. In the")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--ready-timeout-s", type=float, default=240.0)
    p.add_argument("--log-dir", default="", help="fluidpd up writes <name>.log files here")
    args = p.parse_args(argv)
    # A time box (gpu_check.sh's `timeout`) ends us with SIGTERM: exit through `finally`,
    # which stops the cluster. It runs in a session of its own, so nothing else would, and
    # on the lent machine a process in another session outlives the command.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FLUIDPD_DEVICE": args.device}
    env.pop("FLUIDPD_NATS_URL", None)
    state = tempfile.mkdtemp(prefix="fluidpd-gpu-up-")
    env["FLUIDPD_STATE_FILE"] = str(Path(state) / "up.json")
    port = _free_port()
    cmd = [sys.executable, "-m", "services.cli.main", "up", "--model", args.model]
    cmd += ["--engine", "torch", "--prefill", "1", "--decode", "1", "--port", str(port)]
    cmd += ["--short-prompt-tokens", "0", "--extra-worker-args", f"--device {args.device}"]
    if args.log_dir:
        cmd += ["--log-dir", args.log_dir]
    result: dict[str, Any] = {"step": "serve", "model": args.model, "device": args.device}
    t0 = time.monotonic()
    up = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,  # one process group: stopped as a whole below
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert up.stdout is not None
        for line in up.stdout:
            lines.append(line.rstrip("\n"))
            print(f"[up] {line.rstrip()}", file=sys.stderr)
            if line.startswith(READY):
                ready.set()
        ready.set()  # EOF: up exited; the poll below tells which

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(args.ready_timeout_s) or up.poll() is not None:
            result.update(ok=False, error="fluidpd up did not become ready", tail=lines[-20:])
            return 1
        result["up_ready_s"] = round(time.monotonic() - t0, 1)
        got = _complete(f"http://127.0.0.1:{port}", args)
        want = _generate(args, env)
        text = got["choices"][0]["text"]
        result.update(
            ok=text == want["text"] and got["usage"]["completion_tokens"] == args.max_tokens,
            served_text=text,
            generate_text=want["text"],
            prefill_worker=(got.get("fluidpd") or {}).get("prefill_worker"),
        )
        return 0 if result["ok"] else 1
    except Exception as exc:  # any failure is this step's result, not a traceback
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", tail=lines[-20:])
        return 1
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGTERM)  # up stops its children cleanly on SIGTERM
            try:
                up.wait(8)  # within the 10 s gpu_check.sh gives after its SIGTERM
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()
        print(json.dumps(result))


if __name__ == "__main__":
    raise SystemExit(main())
