"""Shared fixtures: a real nats-server per test or module (tests/support/fixtures.py)."""

import os

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
os.environ.setdefault("UCXPY_PROGRESS_MODE", "blocking")

pytest_plugins = ["tests.support.fixtures"]
