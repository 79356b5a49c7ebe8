"""The router's and the controller's --nats* flags make the same BusConfig the worker's do
(services/common/bus_flags.py), and bad combinations exit 2 with one line."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest

from services.common.bus_flags import add_bus_flags, bus_config_from_args
from services.controller.__main__ import config_from_args as controller_config
from services.controller.__main__ import main as controller_main
from services.router.__main__ import build_parser as router_parser
from services.router.__main__ import config_from_args as router_config
from services.router.__main__ import main as router_main
from shared.bus import BusConfig

NATS_ENV = ("URL", "USER", "PASSWORD", "CREDS", "TLS_CA")


def router_bus(argv: list[str]) -> BusConfig:
    return router_config(router_parser().parse_args(argv)).bus


def controller_bus(argv: list[str]) -> BusConfig:
    return controller_config(argv).bus


def reference_bus(argv: list[str]) -> BusConfig:
    parser = argparse.ArgumentParser()
    add_bus_flags(parser)
    return bus_config_from_args(parser.parse_args(argv))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NATS_ENV:
        monkeypatch.delenv(f"FLUIDPD_NATS_{name}", raising=False)


@pytest.mark.parametrize("make", [router_bus, controller_bus])
def test_flags_and_environment_make_the_shared_bus_config(
    monkeypatch: pytest.MonkeyPatch, make: Callable[[list[str]], BusConfig]
) -> None:
    assert make([]) == reference_bus([]) == BusConfig()
    monkeypatch.setenv("FLUIDPD_NATS_URL", "nats://a:4222, nats://b:4222")
    monkeypatch.setenv("FLUIDPD_NATS_USER", "svc")
    monkeypatch.setenv("FLUIDPD_NATS_PASSWORD", "pw-from-env")
    bus = make(["--nats-tls-ca", "/ca.pem"])
    assert bus == reference_bus(["--nats-tls-ca", "/ca.pem"])
    assert bus.servers == ("nats://a:4222", "nats://b:4222")
    assert (bus.user, bus.password, bus.tls_ca_file) == ("svc", "pw-from-env", "/ca.pem")
    # A flag wins over the environment.
    monkeypatch.delenv("FLUIDPD_NATS_USER")
    bus = make(["--nats", "nats://c:4222", "--nats-creds", "/x.creds"])
    assert (bus.servers, bus.user, bus.creds_file) == (("nats://c:4222",), None, "/x.creds")


def test_secrets_stay_out_of_the_configs_repr() -> None:
    argv = ["--nats-user", "u", "--nats-password", "hunter2-secret"]
    assert "hunter2-secret" not in repr(router_config(router_parser().parse_args(argv)))
    assert "hunter2-secret" not in repr(controller_config(argv))


@pytest.mark.parametrize("main", [router_main, controller_main])
@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--nats", ""], "--nats"),
        (["--nats-user", "u"], "--nats-password"),
        (
            ["--nats-user", "u", "--nats-password", "p", "--nats-creds", "/x.creds"],
            "choose one credential kind",
        ),
    ],
)
def test_bad_nats_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
    main: Callable[[list[str]], int],
    argv: list[str],
    why: str,
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1
