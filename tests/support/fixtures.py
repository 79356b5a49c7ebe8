"""Pytest fixtures around a real nats-server (import them into a test module or conftest).

* ``nats_server`` — function-scoped: a fresh server + JetStream store per test.
* ``nats_server_module`` — module-scoped: one server shared by a module's tests (use
  distinct subjects/buckets per test).
* ``nats_server_auth`` — function-scoped, requires user ``fluidpd`` / password
  ``fluidpd-test``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.nats_server import NatsServer

TEST_USER = "fluidpd"
TEST_PASSWORD = "fluidpd-test"


@pytest.fixture
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats-js"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nats_server_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats-js-module"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_server_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(
        tmp_path_factory.mktemp("nats-js-auth"), user=TEST_USER, password=TEST_PASSWORD
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
