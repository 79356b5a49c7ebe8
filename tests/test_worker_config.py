"""Worker command line: flags and environment -> WorkerConfig, and bad values -> one line."""

from __future__ import annotations

import pytest

from services.worker.config import WorkerConfig
from services.worker.main import config_from_args, main


@pytest.fixture(autouse=True)
def _cluster_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUIDPD_CLUSTER_SECRET", "test-secret")


def test_flags_reach_the_config() -> None:
    cfg = config_from_args(
        "decode",
        [
            "--id",
            "d7",
            "--engine",
            "emulated",
            "--telemetry-interval-s",
            "0.05",
            "--heartbeat-s",
            "2",
        ],
    )
    assert (cfg.worker_id, cfg.role, cfg.engine) == ("d7", "decode", "emulated")
    assert cfg.telemetry_interval_s == 0.05
    assert cfg.heartbeat_s == 2.0


def test_environment_supplies_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLUIDPD_TELEMETRY_INTERVAL_S", "0.1")
    monkeypatch.setenv("FLUIDPD_WORKER_ID", "p3")
    cfg = config_from_args("prefill", [])
    assert (cfg.worker_id, cfg.telemetry_interval_s) == ("p3", 0.1)
    # A flag wins over the environment.
    assert (
        config_from_args("prefill", ["--telemetry-interval-s", "0.3"]).telemetry_interval_s == 0.3
    )


@pytest.mark.parametrize("name", ["telemetry_interval_s", "heartbeat_s", "transfer_timeout_s"])
def test_non_positive_periods_are_rejected(name: str) -> None:
    with pytest.raises(ValueError, match=name):
        WorkerConfig(worker_id="w1", role="prefill", **{name: 0.0})  # type: ignore[arg-type]


def test_bad_value_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main("decode", ["--id", "d1", "--telemetry-interval-s", "0"]) == 2
    err = capsys.readouterr().err
    assert "telemetry_interval_s must be > 0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main("decode", ["--id", "bad.id"]) == 2
    assert "worker_id" in capsys.readouterr().err
    assert main("decode", ["--id", "d1", "--decode-reserve-tokens", "-1"]) == 2
    assert "decode_reserve_tokens must be >= 0" in capsys.readouterr().err


def test_log_level_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import logging

    from services.common.logging import level_from_env

    monkeypatch.delenv("FLUIDPD_LOG_LEVEL", raising=False)
    assert level_from_env() == logging.INFO
    monkeypatch.setenv("FLUIDPD_LOG_LEVEL", "Warning")
    assert level_from_env() == logging.WARNING
    monkeypatch.setenv("FLUIDPD_LOG_LEVEL", "loud")
    with pytest.raises(ValueError, match="FLUIDPD_LOG_LEVEL"):
        level_from_env()
    # A worker started with it says so in one line and exits 2 (before touching the bus).
    assert main("decode", ["--id", "d1"]) == 2
    err = capsys.readouterr().err
    assert "FLUIDPD_LOG_LEVEL='loud'" in err and len(err.strip().splitlines()) == 1


def test_no_cluster_secret_exits_2_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for value in (None, "", "   "):
        if value is None:
            monkeypatch.delenv("FLUIDPD_CLUSTER_SECRET", raising=False)
        else:
            monkeypatch.setenv("FLUIDPD_CLUSTER_SECRET", value)
        assert main("decode", ["--id", "d1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "FLUIDPD_CLUSTER_SECRET" in err[0], err


def test_vllm_style_context_and_memory_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config_from_args("decode", ["--id", "d1", "--max-model-len", "1024"])
    assert cfg.max_model_len == 1024 and cfg.gpu_memory_utilization == 0.0
    monkeypatch.setenv("FLUIDPD_MAX_MODEL_LEN", "512")
    assert config_from_args("decode", ["--id", "d1"]).max_model_len == 512
    cuda = config_from_args(
        "decode", ["--id", "d1", "--device", "cuda", "--gpu-memory-utilization", "0.9"]
    )
    assert cuda.gpu_memory_utilization == 0.9


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--max-model-len", "-1"], "max_model_len must be >= 0"),
        (["--gpu-memory-utilization", "0.9"], "needs the torch engine on a CUDA device"),
        (["--device", "cuda", "--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
        (["--device", "gpu0"], "device must be cpu, cuda or cuda:N, got 'gpu0'"),
    ],
)
def test_bad_context_and_memory_flags_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], why: str
) -> None:
    assert main("decode", ["--id", "d1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert why in err and len(err.splitlines()) == 1


def test_nats_flags_and_environment_make_one_bus_config(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("URL", "USER", "PASSWORD", "CREDS", "TLS_CA"):
        monkeypatch.delenv(f"FLUIDPD_NATS_{name}", raising=False)
    cfg = config_from_args("decode", ["--id", "d1"])
    assert cfg.bus.servers == ("nats://127.0.0.1:4222",)
    assert (cfg.bus.user, cfg.bus.creds_file, cfg.bus.tls_ca_file) == (None, None, None)
    monkeypatch.setenv("FLUIDPD_NATS_URL", "nats://a:4222, nats://b:4222")
    monkeypatch.setenv("FLUIDPD_NATS_USER", "worker")
    monkeypatch.setenv("FLUIDPD_NATS_PASSWORD", "pw-from-env")
    cfg = config_from_args("decode", ["--id", "d1", "--nats-tls-ca", "/ca.pem"])
    assert cfg.bus.servers == ("nats://a:4222", "nats://b:4222")
    assert (cfg.bus.user, cfg.bus.password, cfg.bus.tls_ca_file) == (
        "worker",
        "pw-from-env",
        "/ca.pem",
    )
    assert "pw-from-env" not in repr(cfg)  # secrets stay out of logs
    # A flag wins over the environment; a password without a user is ignored, as before.
    monkeypatch.delenv("FLUIDPD_NATS_USER")
    cfg = config_from_args("decode", ["--id", "d1", "--nats", "nats://c:4222"])
    assert (cfg.bus.servers, cfg.bus.user, cfg.bus.password) == (("nats://c:4222",), None, None)


def test_conflicting_nats_credentials_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--id", "d1", "--nats-user", "u", "--nats-password", "p", "--nats-creds", "/x.creds"]
    assert main("decode", argv) == 2
    err = capsys.readouterr().err
    assert "choose one credential kind" in err and len(err.strip().splitlines()) == 1
    assert main("decode", ["--id", "d1", "--nats", ""]) == 2
    assert "--nats" in capsys.readouterr().err
