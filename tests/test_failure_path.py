"""The engine-failure sequence on one decode worker, in-process: ``DecodeRole._fail_all``
(ends every request, frees blocks, stops admitting) then FailurePath
(services/worker/failure.py: ``failed``, integrity check, exit status), that
``FailurePath.stop()`` cancels it, and that a D->P switch whose drain ends in an engine
failure neither flips the role nor re-opens decode admission. The whole path on real
processes is test_fail_engine.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio

from services.worker.config import WorkerConfig
from services.worker.decode.decode_role import DecodeRole
from services.worker.engine_factory import build_engine, fingerprint_of
from services.worker.failure import EXIT_ENGINE_FAILED, FailurePath
from services.worker.role_switch.switch import RoleSwitcher
from services.worker.status import WorkerStatus
from services.worker.token_stream import TokenStreamer
from shared.aio import cancel_and_wait
from shared.engine.block_manager import BlockManager
from shared.messages import (
    AdmitRequest,
    PrefillRequest,
    SamplingParams,
    StreamSequencer,
    SwitchCommand,
    TokenBatch,
)
from shared.policy.roles import ACTIVE, DECODE, DRAIN, FAILED, PREFILL, Role, WorkerState
from shared.transfer.receiver import KVReceiver
from shared.transfer.ucx_node import TransferNode


class Recorder:
    """The runtime's side: the states the failure path wrote."""

    def __init__(self) -> None:
        self.states: list[tuple[WorkerState, str]] = []
        self.state_set = asyncio.Event()

    async def set_state(self, state: WorkerState, reason: str) -> None:
        self.states.append((state, reason))
        self.state_set.set()


def failure_path(rec: Recorder, heartbeat_s: float, bm: BlockManager | None = None) -> FailurePath:
    return FailurePath(
        "d0",
        set_state=rec.set_state,
        block_manager=bm or BlockManager(num_blocks=8, block_size=4),
        transfer_timeout_s=1.0,
        heartbeat_s=heartbeat_s,
    )


async def test_engine_failure_marks_the_worker_failed_then_asks_to_exit() -> None:
    rec = Recorder()
    path = failure_path(rec, heartbeat_s=0.01)
    assert not path.fatal.is_set() and path.exit_status == 0
    path.on_engine_failure(RuntimeError("CUDA error: an illegal memory access"))
    await asyncio.wait_for(path.fatal.wait(), timeout=10.0)
    assert path.exit_status == EXIT_ENGINE_FAILED
    assert rec.states == [(FAILED, "engine failed: RuntimeError")]  # the type, not the text
    await path.stop()


async def test_stop_cancels_a_failure_path_in_progress_and_is_idempotent() -> None:
    rec = Recorder()
    path = failure_path(rec, heartbeat_s=60.0)  # it would stay "failed" for 3 minutes
    path.on_engine_failure(RuntimeError("boom"))
    await asyncio.wait_for(rec.state_set.wait(), timeout=10.0)
    started = time.monotonic()
    await path.stop()
    assert time.monotonic() - started < 5.0  # cancelled, not waited out
    await path.stop()
    assert rec.states == [(FAILED, "engine failed: RuntimeError")]


@dataclass
class FailingDecode:
    """A decode role wired as the runtime wires it (emulated tiny engine, a real UCX
    receiver) whose ``on_engine_failure`` is a FailurePath."""

    role: DecodeRole
    path: FailurePath
    rec: Recorder
    streamer: TokenStreamer


@contextlib.asynccontextmanager
async def failing_decode() -> AsyncIterator[FailingDecode]:
    """The decode role running, its receiver on a transfer node never started: these tests
    receive no KV, and UCX starts once per process — the one in-process test that receives
    (test_migration_intake.py) starts it."""
    cfg = WorkerConfig(
        worker_id="d0", role=DECODE, engine="emulated", num_kv_blocks=32, cluster_secret="s" * 32
    )
    engine = build_engine(cfg)
    rec = Recorder()
    path = failure_path(rec, heartbeat_s=0.01, bm=engine.block_manager)
    streamer = TokenStreamer(StreamSequencer("d0"))
    async with contextlib.AsyncExitStack() as stack:
        executor = stack.enter_context(ThreadPoolExecutor(1))
        receiver = KVReceiver(
            TransferNode(),
            worker_id="d0",
            block_manager=engine.block_manager,
            arena=engine.arena,
            fingerprint=fingerprint_of(engine),
            secret=cfg.secret_bytes,
        )
        role = DecodeRole(
            engine,
            receiver,
            streamer,
            executor,
            lambda: None,
            transfer_timeout_s=1.0,
            max_num_seqs=8,
            on_engine_failure=path.on_engine_failure,
        )
        loop_task = asyncio.ensure_future(role.run())
        try:
            yield FailingDecode(role, path, rec, streamer)
        finally:
            await cancel_and_wait([loop_task])
            await path.stop()


@pytest_asyncio.fixture
async def decode() -> AsyncIterator[FailingDecode]:
    async with failing_decode() as d:
        yield d


def _raise(*_args: Any) -> Any:
    raise RuntimeError("CUDA out of memory (fault injected by the test)")


async def test_after_the_whole_failure_sequence_the_worker_admits_nothing(
    decode: FailingDecode, monkeypatch: pytest.MonkeyPatch
) -> None:
    role, sampling = decode.role, SamplingParams(max_tokens=4)
    assert role.intake.admitting  # open before the fault
    monkeypatch.setattr(role.engine, "step_full", _raise)  # the GPU fault
    now = time.time()
    role.serve_local(
        PrefillRequest(
            request_id="r1",
            router_id="rt",
            prompt_token_ids=(1, 2, 3, 4, 5),
            sampling=sampling,
            decode_worker_id="d0",
            arrival_time_s=now,
            ttft_deadline_s=now + 10.0,
            tokens_subject="tokens.rt",
        )
    )
    await asyncio.wait_for(decode.path.fatal.wait(), timeout=10.0)
    assert decode.path.exit_status == EXIT_ENGINE_FAILED
    assert decode.rec.states == [(FAILED, "engine failed: RuntimeError")]
    batches = [batch for _, batch in decode.streamer.take()]
    assert all(isinstance(b, TokenBatch) for b in batches)
    items = [i for b in batches if isinstance(b, TokenBatch) for i in b.items]
    assert [(i.request_id, i.error_code) for i in items if i.error_code] == [
        ("r1", "engine_failed")
    ]
    reply = role.admit(
        AdmitRequest(
            request_id="late",
            router_id="rt",
            prompt_len=5,
            max_tokens=4,
            prefill_worker_id="p0",
            sampling=sampling,
            tokens_subject="tokens.rt",
        )
    )
    assert not reply.ok and reply.error == "worker is not admitting decode work", reply
    bm = role.bm
    assert bm.num_free_blocks == bm.num_usable_blocks
    bm.check_integrity()


class SwitchParts:
    """What a RoleSwitcher needs beyond the decode role, recorded: the states it announces
    (into a real WorkerStatus), its lease (always granted) and its re-slices."""

    def __init__(self) -> None:
        self.status = WorkerStatus(DECODE)
        self.status.set_state(ACTIVE)
        self.announced: list[WorkerState] = []
        self.resliced: list[Role] = []

    async def set_state(self, state: WorkerState, _reason: str) -> None:
        self.announced.append(state)
        self.status.set_state(state)

    async def acquire(self, _from_role: Role, _to_role: Role) -> str | None:
        return None

    async def release(self, _role: Role) -> None:
        return None

    def reslice(self, role: Role) -> int:
        self.resliced.append(role)
        return 0


async def test_an_engine_failure_during_a_d2p_drain_ends_the_switch_closed(
    decode: FailingDecode, monkeypatch: pytest.MonkeyPatch
) -> None:
    role, parts = decode.role, SwitchParts()
    entered, release = threading.Event(), threading.Event()

    def fail_when_released(*_args: Any) -> Any:
        entered.set()
        release.wait(10.0)
        raise RuntimeError("CUDA error (fault injected by the test)")

    monkeypatch.setattr(role.engine, "step_full", fail_when_released)
    now = time.time()
    role.serve_local(
        PrefillRequest(
            request_id="r1",
            router_id="rt",
            prompt_token_ids=(1, 2, 3, 4, 5),
            sampling=SamplingParams(max_tokens=4),
            decode_worker_id="d0",
            arrival_time_s=now,
            ttft_deadline_s=now + 10.0,
            tokens_subject="tokens.rt",
        )
    )
    assert await asyncio.to_thread(entered.wait, 10.0)  # r1's step is in the engine

    async def follow_role(_role: Role) -> None:
        return None

    switcher = RoleSwitcher(
        "d0",
        parts.status,
        parts,  # type: ignore[arg-type]  # the announcer's set_state
        parts,  # type: ignore[arg-type]  # the lease
        None,  # type: ignore[arg-type]  # a D->P switch never touches the prefill role
        role,
        None,  # type: ignore[arg-type]  # migrate=False: no migrator
        None,  # type: ignore[arg-type]  # nor the bus
        None,  # type: ignore[arg-type]
        follow_role=follow_role,
        active_peers=lambda _role: [],
        reslice=parts.reslice,
        drain_timeout_s=10.0,
        migrate=False,
    )
    reply = await switcher.on_switch(SwitchCommand(role=PREFILL))
    assert reply.ok, reply
    deadline = time.monotonic() + 10.0
    while role.intake.admitting or parts.status.state != DRAIN:  # the drain has begun
        assert time.monotonic() < deadline, "the switch never started draining"
        await asyncio.sleep(0.005)
    release.set()  # the step fails: r1 ends with engine_failed and the drain is "done"
    assert switcher.task is not None
    await asyncio.wait_for(switcher.task, timeout=10.0)
    await asyncio.wait_for(decode.path.fatal.wait(), timeout=10.0)
    assert role.engine_failed
    assert not role.intake.admitting  # stays closed: the worker is on its way out
    assert parts.status.role == DECODE and parts.resliced == []  # no flip
    assert parts.announced == [DRAIN]  # neither "switch" nor "active" after the failure
    assert decode.rec.states == [(FAILED, "engine failed: RuntimeError")]
