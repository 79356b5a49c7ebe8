"""SLO-aware admission: the pure shedding and expiry rules."""

from __future__ import annotations

import pytest

from shared.policy import PolicyConfigError, example_profile
from shared.policy.admission import (
    SheddingConfig,
    is_expired,
    predicted_ttft_s,
    queue_work_s,
    retry_after_s,
    should_shed,
)


def test_queue_work_sums_eq2_per_request() -> None:
    p = example_profile()
    work = queue_work_s([100, 2000], p, running_remaining_s=0.25)
    assert work == pytest.approx(0.25 + p.prefill_time_s(100) + p.prefill_time_s(2000))
    assert queue_work_s([], p) == 0.0


def test_predicted_ttft_adds_own_prefill() -> None:
    p = example_profile()
    assert predicted_ttft_s(1.5, 512, p) == pytest.approx(1.5 + p.prefill_time_s(512))


def test_shed_threshold_is_multiple_of_slo() -> None:
    cfg = SheddingConfig(ttft_multiple=2.0)
    assert not should_shed(1.99, 1.0, cfg)
    assert should_shed(2.01, 1.0, cfg)
    assert not should_shed(1e9, 1.0, SheddingConfig(ttft_multiple=0.0))


def test_retry_after_covers_the_excess() -> None:
    cfg = SheddingConfig(ttft_multiple=2.0)
    assert retry_after_s(2.1, 1.0, cfg) == 1
    assert retry_after_s(6.5, 1.0, cfg) == 5


def test_expiry_margin() -> None:
    cfg = SheddingConfig(expire_margin_s=5.0)
    assert not is_expired(10.0, 15.0, cfg)
    assert is_expired(10.0, 15.01, cfg)
    assert not is_expired(10.0, 1e9, SheddingConfig(expire_margin_s=None))


@pytest.mark.parametrize(
    "kwargs", [{"ttft_multiple": 0.5}, {"ttft_multiple": float("nan")}, {"expire_margin_s": -1}]
)
def test_bad_config_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(PolicyConfigError):
        SheddingConfig(**kwargs)
