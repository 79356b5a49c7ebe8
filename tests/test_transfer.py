"""KV transfer over real UCX between real processes (tests/support/transfer_peer.py).

Each peer is a worker-like process with its own TransferNode, KVArena and BlockManager;
the test process only drives them over pipes and checks their state.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.transfer import KVFingerprint, TransferRejected, TransferTicket
from shared.transfer.protocol import plan_segments, segments_valid
from shared.transfer.ucx_memory import as_buffer

PEER = Path(__file__).parent / "support" / "transfer_peer.py"
SECRET = "5e" * 32
BLOCK_SIZE = 16


class PeerProc:
    """Client side of one peer process: JSON-line calls and events."""

    def __init__(self, worker_id: str, num_blocks: int = 512, device: str = "cpu") -> None:
        self.worker_id = worker_id
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), worker_id, SECRET, str(num_blocks), device],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._pending: dict[int, cf.Future[dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def wait_ready(self) -> None:
        ev = self.events.get(timeout=60)
        assert ev["event"] == "ready", ev
        assert ev["can_cancel"], "ucxx Request::cancel must be reachable"
        assert ev["peer_guard"], "the UCS log hook (ucx_guard) must be installed"
        self.pid = ev["pid"]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if "id" in msg:
                with self._lock:
                    fut = self._pending.pop(msg["id"])
                fut.set_result(msg)
            else:
                self.events.put(msg)
        with self._lock:  # the process died: fail every outstanding call
            for fut in self._pending.values():
                fut.set_result({"ok": False, "error": "peer_died"})
            self._pending.clear()

    def start(self, cmd: str, **kw: Any) -> cf.Future[dict[str, Any]]:
        fut: cf.Future[dict[str, Any]] = cf.Future()
        rid = next(self._ids)
        with self._lock:
            self._pending[rid] = fut
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"id": rid, "cmd": cmd, **kw}) + "\n")
        self.proc.stdin.flush()
        return fut

    def call(self, cmd: str, timeout: float = 30, **kw: Any) -> dict[str, Any]:
        res = self.start(cmd, **kw).result(timeout)
        assert res["ok"], res
        return res

    def clean_state(self, free_blocks: int) -> None:
        state = self.call("state")
        assert state["integrity"] == "ok", state
        assert state["reservations"] == [], state
        assert state["free_blocks"] == free_blocks, state

    def stop(self) -> None:
        if self.proc.poll() is None:
            with_stdin = self.proc.stdin
            try:
                assert with_stdin is not None
                with_stdin.write(json.dumps({"cmd": "exit"}) + "\n")
                with_stdin.flush()
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def spawn(*worker_ids: str, device: str = "cpu") -> list[PeerProc]:
    peers = [PeerProc(w, device=device) for w in worker_ids]
    for p in peers:
        p.wait_ready()
    return peers


@pytest.fixture(scope="module")
def peers() -> Any:
    ps = spawn("w0", "w1", "w2")
    ps[1].call("scatter")  # w1's reservations are scattered: many segments per transfer
    yield ps
    for p in ps:
        p.stop()


def transfer(
    src: PeerProc,
    dst: PeerProc,
    rid: str,
    num_tokens: int,
    *,
    extra_blocks: int = 0,
    recv_timeout_s: float = 10,
    send_timeout_s: float = 10,
    seed: int = 0,
    **send_kw: Any,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    filled = src.call("fill", seq=f"src-{rid}", num_tokens=num_tokens, seed=seed)
    n = -(-num_tokens // BLOCK_SIZE)
    ticket = dst.call("prepare", request_id=rid, num_tokens=num_tokens, num_blocks=n + extra_blocks)
    recv = dst.start("receive", request_id=rid, timeout_s=recv_timeout_s)
    sent = src.start(
        "send", ticket=ticket["ticket"], seq=f"src-{rid}", timeout_s=send_timeout_s, **send_kw
    )
    return filled, sent.result(30), recv.result(30)


# ----------------------------------------------------------------------- pure parts
def test_fingerprint_digest_covers_every_field() -> None:
    base = KVFingerprint("a", "w", "bf16", 16, "block-major", 0, 2, "theta=1e4", "t")
    variants = [
        KVFingerprint("b", "w", "bf16", 16, "block-major", 0, 2, "theta=1e4", "t"),
        KVFingerprint("a", "w", "bf16", 16, "block-major", 1, 2, "theta=1e4", "t"),
        KVFingerprint("a", "w", "bf16", 16, "block-major", 0, 2, "theta=5e5", "t"),
        KVFingerprint("a", "w", "fp16", 16, "block-major", 0, 2, "theta=1e4", "t"),
    ]
    assert len({base.digest(), *(v.digest() for v in variants)}) == 5
    with pytest.raises(ValueError):
        KVFingerprint("a", "w", "bf16", 16, "x", 2, 2)


def test_node_config_names_a_cuda_device_or_none() -> None:
    from shared.transfer.ucx_memory import bind_cuda_device
    from shared.transfer.ucx_node import TransferNodeConfig

    assert TransferNodeConfig(cuda_device="cuda:1").cuda_device == "cuda:1"
    with pytest.raises(ValueError, match="cuda_device"):
        TransferNodeConfig(cuda_device="cpu")
    bind_cuda_device("cpu")  # CPU memory: nothing to bind, and no CUDA call is made


def test_ticket_is_sealed() -> None:
    ticket = TransferTicket(1 << 20, "r", "w1", b"addr", "h", (3, 4), (1, 1), 0, 20, 16, 64)
    data = ticket.encode(b"k1")
    assert TransferTicket.decode(data, b"k1") == ticket
    with pytest.raises(TransferRejected):
        TransferTicket.decode(data, b"k2")
    forged = bytearray(data)
    forged[-40] ^= 1
    with pytest.raises(TransferRejected):
        TransferTicket.decode(bytes(forged), b"k1")


def test_segments_contiguous_on_both_sides() -> None:
    src, dst = [4, 5, 6, 9, 10], [7, 8, 2, 3, 4]
    segs = plan_segments(src, dst)
    assert segs == [(0, 2), (2, 1), (3, 2)]
    assert segments_valid(segs, dst)
    assert not segments_valid([(0, 3), (3, 2)], dst)  # (7, 8, 2) is not contiguous
    with pytest.raises(AssertionError):
        as_buffer(torch.zeros(4, 4)[:, 1])


# ----------------------------------------------------------------------- real UCX
@settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**16), num_tokens=st.integers(1, 400), extra=st.integers(0, 3))
def test_round_trip_random_block_tables(
    peers: list[PeerProc], seed: int, num_tokens: int, extra: int
) -> None:
    src, dst = peers[0], peers[1]
    src.call("fragment", seed=seed)
    dst.call("fragment", seed=seed + 1)
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    rid = f"rt-{seed}-{num_tokens}-{extra}"
    filled, sent, recv = transfer(
        src,
        dst,
        rid,
        num_tokens,
        extra_blocks=extra,
        seed=seed,
        meta={"first_token": seed, "temperature": 0.0},
    )
    assert sent["ok"] and recv["ok"], (sent, recv)
    assert recv["digests"] == filled["digests"]  # every block byte-exact, in logical order
    assert recv["meta"] == {"first_token": seed, "temperature": 0.0}
    assert len(recv["block_ids"]) == len(filled["block_ids"]) + extra
    assert "same-host" in recv["transport"] and sent["released"]
    src.clean_state(free_src)  # the source sequence was freed on release
    dst.call("free", seq=rid)
    dst.clean_state(free_dst)


@pytest.mark.parametrize("num_tokens", [90, 2000])
def test_round_trip_with_the_device_checksum(peers: list[PeerProc], num_tokens: int) -> None:
    """A sender naming fold64 (what a CUDA arena sends) is verified by a CPU receiver with
    the same function: the envelope's algorithm, not the receiver's device, decides."""
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    rid = f"fold-{num_tokens}"
    filled, sent, recv = transfer(src, dst, rid, num_tokens, checksum_algorithm="fold64")
    assert sent["ok"] and recv["ok"], (sent, recv)
    assert recv["digests"] == filled["digests"]
    src.clean_state(free_src)
    dst.call("free", seq=rid)
    dst.clean_state(free_dst)


def test_wrong_fingerprint_is_rejected(peers: list[PeerProc]) -> None:
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    _, sent, recv = transfer(src, dst, "fp", 100, weights="other-weights")
    assert recv["error"] == "kv_transfer_rejected" and "fingerprint" in recv["reason"]
    assert sent["error"] == "kv_transfer_rejected" and sent["retryable"]
    assert "fp" not in dst.call("state")["sequences"]  # never runnable
    src.clean_state(free_src)
    dst.clean_state(free_dst)


@pytest.mark.parametrize("algorithm", ["xxh3_64", "fold64"])
@pytest.mark.parametrize(
    ("num_tokens", "bad_block"),
    # 90 tokens: hashed inline; 2000 tokens (2 MiB, many segments into w1's scattered
    # blocks): hashed by the receiver's hash thread as segments land. fold64 is the CUDA
    # arenas' checksum, run here through the same functions on CPU tensors.
    [(90, 2), (2000, 100)],
)
def test_one_flipped_byte_is_rejected(
    peers: list[PeerProc], num_tokens: int, bad_block: int, algorithm: str
) -> None:
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    _, sent, recv = transfer(
        src,
        dst,
        f"flip{num_tokens}-{algorithm}",
        num_tokens,
        corrupt_block=bad_block,
        checksum_algorithm=algorithm,
    )
    assert recv["error"] == "kv_transfer_rejected"
    assert recv["reason"] == f"checksum mismatch at logical block {bad_block}"
    assert sent["error"] == "kv_transfer_rejected"
    src.clean_state(free_src)
    dst.clean_state(free_dst)


def test_sender_without_cluster_secret_installs_nothing(peers: list[PeerProc]) -> None:
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    _, sent, recv = transfer(src, dst, "nosecret", 64, secret="77" * 32, send_timeout_s=1)
    assert recv["error"] == "kv_transfer_rejected"
    assert recv["reason"] == "envelope signature invalid"
    assert not sent["ok"]
    assert "nosecret" not in dst.call("state")["sequences"]
    src.clean_state(free_src)
    dst.clean_state(free_dst)


def test_transfer_stopping_midway_hits_deadline_on_both_sides(peers: list[PeerProc]) -> None:
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    _, sent, recv = transfer(
        src, dst, "stall", 6 * BLOCK_SIZE, stall_after=2, recv_timeout_s=1.0, send_timeout_s=1.5
    )
    assert recv["error"] == "kv_transfer_timeout"
    assert "2/6 segments" in recv["reason"]
    # The receiver's rejection verdict reaches the sender first, or its own deadline does.
    assert sent["error"] in ("kv_transfer_rejected", "kv_transfer_timeout")
    assert sent["retryable"]  # its last message was never posted: ownership never moved
    src.call("resume", request_id="stall")
    src.clean_state(free_src)
    dst.clean_state(free_dst)


@pytest.mark.parametrize("mode", ["raise", "hang"])
def test_failure_after_install_frees_the_installed_blocks(peers: list[PeerProc], mode: str) -> None:
    """Everything validated and the table is installed, then settling the control
    receives fails (raises, or outlasts the receive's deadline): the receive fails and the
    installed sequence is freed, not left holding its blocks with nobody to run it."""
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    dst.call("fail_settle", mode=mode)
    rid = f"post-install-{mode}"
    _, sent, recv = transfer(src, dst, rid, 100, recv_timeout_s=1.0, send_timeout_s=3.0)
    assert not recv["ok"]
    assert recv["error"] == ("kv_transfer_timeout" if mode == "hang" else "kv_transfer_error")
    assert not sent["ok"]  # the receiver's failure verdict, or the sender's own deadline
    assert rid not in dst.call("state")["sequences"]
    src.clean_state(free_src)
    dst.clean_state(free_dst)


def test_a_deadline_after_the_ok_verdict_keeps_the_installed_sequence(
    peers: list[PeerProc],
) -> None:
    """The "installed" verdict reached the sender (which drops its copy on it), and the
    receiver's send of it completes only after the receive's deadline: the receive still
    succeeds and keeps the sequence. Freeing it there lost the request on both sides."""
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    dst.call("slow_verdict", hold_s=1.5)
    rid = "late-verdict"
    filled, sent, recv = transfer(src, dst, rid, 100, recv_timeout_s=1.0, send_timeout_s=5.0)
    assert sent["ok"], sent  # the sender saw "installed"
    assert recv["ok"], recv  # and the receiver agrees
    assert recv["digests"] == filled["digests"]
    assert rid in dst.call("state")["sequences"]
    src.clean_state(free_src)  # the source sequence was freed on release
    dst.call("free", seq=rid)
    dst.clean_state(free_dst)


def test_late_write_after_cancel_cannot_land(peers: list[PeerProc]) -> None:
    src, dst = peers[0], peers[1]
    free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
    src.call("fill", seq="late-src", num_tokens=64, seed=5)
    ticket = dst.call("prepare", request_id="late", num_tokens=64)
    recv = dst.start("receive", request_id="late", timeout_s=0.3).result(10)
    assert recv["error"] == "kv_transfer_timeout"
    victim = dst.call("fill_all", seq="victim", seed=6)  # every free block, incl. the old ones
    assert set(ticket["block_ids"]) <= set(victim["block_ids"])
    late = src.call("late_write", ticket=ticket["ticket"], seq="late-src")
    assert late["posted"] == 4 and late["matched"] == 0
    assert dst.call("digests", seq="victim")["digests"] == victim["digests"]
    dst.call("free", seq="victim")
    src.call("free", seq="late-src")
    src.clean_state(free_src)
    dst.clean_state(free_dst)


@pytest.mark.parametrize("paired", [False, True], ids=["first-contact", "paired-endpoints"])
def test_sender_killed_mid_transfer(paired: bool) -> None:
    # The receiver copies (CMA) from the sender's memory; SIGKILL the sender between its
    # RTS messages and those copies. UCX without error handling used to take the receiver
    # down: SIGSEGV on a destroyed wire-up endpoint ("first-contact") or SIGABRT on a
    # failed read through its own endpoint, paired with the sender's after a verdict
    # ("paired-endpoints"). See shared/transfer/ucx_guard.py.
    dst, victim = spawn("k-dst", "doomed")  # own processes: a crash would spare `peers`
    try:
        assert dst.events.empty()
        if paired:  # one full transfer first: dst answered with a verdict over its own ep
            _, sent, recv = transfer(victim, dst, "warm", 4 * BLOCK_SIZE)
            assert sent["ok"] and recv["ok"], (sent, recv)
            dst.call("free", seq="warm")
        dst.call("scatter")  # scattered reservations: one segment per block, so it can stall
        free_dst = dst.call("state")["free_blocks"]
        victim.call("fill", seq="k-src", num_tokens=8 * BLOCK_SIZE, seed=9)
        ticket = dst.call("prepare", request_id="killed", num_tokens=8 * BLOCK_SIZE)
        recv = dst.start("receive", request_id="killed", timeout_s=2.0)
        victim.start("send", ticket=ticket["ticket"], seq="k-src", timeout_s=30, stall_after=3)
        assert victim.events.get(timeout=10)["event"] == "stalled"
        os.kill(victim.pid, signal.SIGKILL)
        res = recv.result(10)
        assert res.get("error") != "peer_died", "the receiver died with the sender"
        # Either our deadline fired, or a copy from the dead sender's memory failed.
        assert res["error"] in ("kv_transfer_timeout", "kv_transport_error"), res
        if res["error"] == "kv_transfer_timeout":
            assert "/8 segments" in res["reason"], res
        assert "killed" not in dst.call("state")["sequences"]
        dst.clean_state(free_dst)
        assert dst.proc.poll() is None
    finally:
        victim.proc.kill()
        victim.proc.wait()
        dst.proc.kill()
        dst.proc.wait()


def test_100_concurrent_transfers_between_3_workers(peers: list[PeerProc]) -> None:
    free0 = [p.call("state")["free_blocks"] for p in peers]
    jobs = []
    for i in range(100):
        src, dst = peers[i % 3], peers[(i + 1) % 3]
        num_tokens = 1 + (i * 7) % 48
        filled = src.call("fill", seq=f"c-src-{i}", num_tokens=num_tokens, seed=i)
        ticket = dst.call("prepare", request_id=f"c{i}", num_tokens=num_tokens)
        jobs.append((src, dst, filled, ticket, f"c{i}"))
    recvs = [dst.start("receive", request_id=rid, timeout_s=20) for _, dst, _, _, rid in jobs]
    sends = [
        src.start("send", ticket=t["ticket"], seq=f"c-src-{i}", timeout_s=20)
        for i, (src, _, _, t, _) in enumerate(jobs)
    ]
    for (_, dst, filled, _, rid), r, s in zip(jobs, recvs, sends, strict=True):
        sent, got = s.result(60), r.result(60)
        assert sent["ok"] and got["ok"], (sent, got)
        assert got["digests"] == filled["digests"]
        dst.call("free", seq=rid)
    for p, free in zip(peers, free0, strict=True):
        p.clean_state(free)


# ----------------------------------------------------------------------- CUDA memory
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_handoff_between_processes_from_cuda_memory() -> None:
    """Both arenas in GPU memory: UCX moves device memory itself (cuda_ipc/cuda_copy), the
    checksums are fold64 on the device, a flipped byte is still caught."""
    src, dst = spawn("g0", "g1", device="cuda")
    try:
        dst.call("scatter")
        free_src, free_dst = src.call("state")["free_blocks"], dst.call("state")["free_blocks"]
        filled, sent, recv = transfer(src, dst, "cuda-rt", 2000, meta={"first_token": 5})
        assert sent["ok"] and recv["ok"], (sent, recv)
        assert recv["digests"] == filled["digests"]
        src.clean_state(free_src)
        dst.call("free", seq="cuda-rt")
        dst.clean_state(free_dst)
        _, sent, recv = transfer(
            src, dst, "cuda-flip", 2000, corrupt_block=50, checksum_algorithm="fold64"
        )
        assert recv["reason"] == "checksum mismatch at logical block 50", recv
        src.clean_state(free_src)
        dst.clean_state(free_dst)
    finally:
        for p in (src, dst):
            p.stop()
