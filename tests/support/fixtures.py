"""Pytest fixtures around a real nats-server (import them into a test module or conftest).

* ``nats_server`` — function-scoped: a fresh server + JetStream store per test.
* ``nats_server_module`` — module-scoped: one server shared by a module's tests (use
  distinct subjects/buckets per test).
* ``nats_server_auth`` — function-scoped, requires user ``fluidpd`` / password
  ``fluidpd-test``.
* ``nats_users`` / ``nats_users_module`` — the shipped least-privilege users (router,
  controller, operator, ``worker-<id>`` for ``TEST_WORKER_IDS``), as ``fluidpd up`` runs
  its server: pass the server itself to tests/support/workers.py's ``start_worker`` /
  ``start_router`` / ``worker_pair`` and each process logs in as its own user; the test's
  own client uses ``client_url`` (the operator).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.nats_auth import generate_users
from shared.messages.subjects import Subjects
from tests.support.nats_server import NatsServer

TEST_USER = "fluidpd"
TEST_PASSWORD = "fluidpd-test"
# Worker ids the end-to-end tests start (each gets its own NATS user).
TEST_WORKER_IDS = (*(f"p{i}" for i in range(4)), *(f"d{i}" for i in range(4)), "pe", "de")


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


def _users_server(store_dir: Path) -> NatsServer:
    return NatsServer(store_dir, users=generate_users(Subjects(), TEST_WORKER_IDS))


@pytest.fixture
def nats_users(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = _users_server(tmp_path_factory.mktemp("nats-js-users"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nats_users_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = _users_server(tmp_path_factory.mktemp("nats-js-users-module"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
