"""The NATS connection flags every service takes, and the ``BusConfig`` they make.

``--nats`` (FLUIDPD_NATS_URL, comma-separated URLs), ``--nats-user`` / ``--nats-password``
(FLUIDPD_NATS_USER / FLUIDPD_NATS_PASSWORD), ``--nats-creds`` (FLUIDPD_NATS_CREDS, a .creds
file) and ``--nats-tls-ca`` (FLUIDPD_NATS_TLS_CA). An empty value means "not set". Defined
once here so that the services' command lines cannot drift apart; each service keeps the
result as one ``bus: BusConfig`` field of its frozen config.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from shared.bus.config import BusConfig

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def add_bus_flags(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """Add the NATS flags to ``parser``, their defaults from ``env`` (os.environ). Mutates
    ``parser``."""
    env = os.environ if env is None else env
    parser.add_argument("--nats", default=env.get("FLUIDPD_NATS_URL", DEFAULT_NATS_URL))
    parser.add_argument("--nats-user", default=env.get("FLUIDPD_NATS_USER", ""))
    parser.add_argument("--nats-password", default=env.get("FLUIDPD_NATS_PASSWORD", ""))
    parser.add_argument("--nats-creds", default=env.get("FLUIDPD_NATS_CREDS", ""))
    parser.add_argument("--nats-tls-ca", default=env.get("FLUIDPD_NATS_TLS_CA", ""))


def bus_config(
    url: str = DEFAULT_NATS_URL,
    user: str = "",
    password: str = "",
    creds_file: str = "",
    tls_ca_file: str = "",
) -> BusConfig:
    """The BusConfig for these settings ("" = not set; a password counts only with a user).

    Raises ValueError (one line, for the caller's exit 2) on an empty URL, a user without a
    password, or settings that cannot go together (e.g. a user and a creds file).
    """
    if not url.strip(","):
        raise ValueError("the NATS URL (--nats, FLUIDPD_NATS_URL) must not be empty")
    if user and not password:
        raise ValueError("--nats-user needs --nats-password (FLUIDPD_NATS_PASSWORD)")
    return BusConfig.from_url(
        url,
        **({"user": user, "password": password} if user else {}),
        **({"creds_file": creds_file} if creds_file else {}),
        **({"tls_ca_file": tls_ca_file} if tls_ca_file else {}),
    )


def bus_config_from_args(args: argparse.Namespace) -> BusConfig:
    """``bus_config`` of the flags ``add_bus_flags`` added. Raises ValueError like it."""
    return bus_config(
        args.nats, args.nats_user, args.nats_password, args.nats_creds, args.nats_tls_ca
    )
