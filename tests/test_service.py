"""The shared service lifecycle: a failed start is undone, a clean exit stops once."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.nats_server import free_port
from services.common.service import Service, announce_ready
from services.controller.config import ControllerConfig
from services.controller.controller import Controller
from shared.bus import BusConfig, BusError


class _Probe(Service):
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.events: list[str] = []

    async def start(self) -> None:
        self.events.append("start")
        if self.fail:
            raise RuntimeError("half started")

    async def stop(self) -> None:
        self.events.append("stop")


async def test_failed_start_is_stopped_and_raises() -> None:
    svc = _Probe(fail=True)
    with pytest.raises(RuntimeError, match="half started"):
        async with svc:
            pytest.fail("the body must not run")
    assert svc.events == ["start", "stop"]


async def test_clean_exit_stops_once() -> None:
    async with _Probe(fail=False) as svc:
        assert svc.events == ["start"]
    assert svc.events == ["start", "stop"]


async def test_controller_that_cannot_reach_nats_is_left_stopped() -> None:
    ctl = Controller(ControllerConfig(bus=BusConfig.from_url(f"nats://127.0.0.1:{free_port()}")))
    # Give up on the first connect after 1 s instead of the production 30 s.
    ctl.bus.config = dataclasses.replace(ctl.bus.config, initial_connect_deadline_s=1.0)
    with pytest.raises((BusError, OSError, TimeoutError)):
        async with ctl:
            pytest.fail("started without NATS")
    await ctl.wait_closed()  # stop() ran: the controller reports itself closed


def test_announce_ready_freezes_the_heap_then_prints(capsys: pytest.CaptureFixture[str]) -> None:
    import gc

    gc.unfreeze()
    try:
        assert gc.get_freeze_count() == 0
        announce_ready("probe_ready x=1")
        assert gc.get_freeze_count() > 0  # every object alive now is out of the GC's reach
        assert capsys.readouterr().out == "probe_ready x=1\n"
    finally:
        gc.unfreeze()
