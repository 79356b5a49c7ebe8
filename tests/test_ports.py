"""Ports are bound by the process that listens and read back, never picked ahead.

A port picked with ``free_port`` and bound later by a child can be taken by another
process in between (on a loaded machine a router lost its port that way and exited with
EADDRINUSE). The private nats-server (``-p -1``) and a router with ``--port 0`` bind a port
of the kernel's choice, and the cluster reads it from their logs.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from services.common.cluster import Cluster
from services.common.cluster_spec import ClusterSpec
from services.common.nats_server import RANDOM_PORT, LocalNatsServer, listening_port
from tests.support.nats_server import NatsServer

NATS_LOG = (
    "[1] 2026/12/04 22:02:12.341 [INF] Starting http monitor on 127.0.0.1:37513\n"
    "[1] 2026/12/04 22:02:12.341 [INF] Listening for client connections on 127.0.0.1:32975\n"
    "[1] 2026/12/04 22:02:12.342 [INF] Server is ready\n"
)


def test_listening_port_reads_the_client_port_not_the_monitor_port() -> None:
    assert listening_port(NATS_LOG) == 32975
    assert listening_port("[INF] Starting nats-server\n[INF] Server is ready\n") is None


def test_port_zero_asks_nats_server_for_a_random_port(tmp_path: Path) -> None:
    server = LocalNatsServer(store_dir=tmp_path, binary=Path("/bin/nats-server"), name="n1")
    argv = server.argv()
    assert argv[argv.index("-p") + 1] == str(RANDOM_PORT)
    assert argv[argv.index("-n") + 1] == "n1"
    fixed = LocalNatsServer(store_dir=tmp_path, port=4222, binary=Path("/bin/nats-server"))
    assert fixed.argv()[fixed.argv().index("-p") + 1] == "4222"
    with pytest.raises(ValueError, match="port"):
        LocalNatsServer(store_dir=tmp_path, port=70000)


def test_cluster_spec_accepts_port_zero_and_rejects_out_of_range() -> None:
    assert ClusterSpec(port=0).port == 0
    with pytest.raises(ValueError, match=r"0\.\.65535"):
        ClusterSpec(port=-1)


def _listening_ports(pid: int) -> set[int]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def test_cluster_reports_the_ports_its_children_really_listen_on(tmp_path: Path) -> None:
    spec = ClusterSpec(
        prefill=1, decode=1, model="tiny", engine="emulated", port=0, nats_auth=True,
        with_controller=False, log_dir=tmp_path, stop_grace_s=5.0,
    )  # fmt: skip
    cluster = Cluster(spec)
    assert cluster.router_url.endswith(":0")  # nothing is known before the router is up
    try:
        cluster.start()
        cluster.wait_ready(90)
        pids = cluster.pids()
        router_port = int(cluster.router_url.rsplit(":", 1)[1])
        nats_port = int(cluster.nats_url.rsplit(":", 1)[1])
        assert cluster.router_url == f"http://127.0.0.1:{router_port}"
        assert router_port in _listening_ports(pids["router"])
        assert nats_port in _listening_ports(pids["nats"])
        assert cluster.health_ok()
        # A new worker id makes the cluster rewrite the auth config and reload nats-server:
        # the config must name the port it really has, or the worker cannot log in.
        cluster.add_worker("p9", "prefill")
        cluster.wait_ready(90)
        assert nats_port in _listening_ports(pids["nats"])
    finally:
        cluster.stop()


def test_test_nats_server_keeps_its_random_port_across_restart(tmp_path: Path) -> None:
    server = NatsServer(tmp_path, monitor=True)
    try:
        server.start()
        port, monitor_port = server.port, server.monitor_port
        assert port > 0 and monitor_port is not None and monitor_port != port
        assert server.pid is not None and port in _listening_ports(server.pid)
        server.restart()  # JetStream state survives on the same address, as in production
        assert (server.port, server.monitor_port) == (port, monitor_port)
        assert server.pid is not None and port in _listening_ports(server.pid)
    finally:
        server.stop()
