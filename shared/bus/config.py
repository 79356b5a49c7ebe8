"""Connection settings of the NATS bus (frozen, validated)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit, urlunsplit


@dataclass(frozen=True)
class BusConfig:
    """How to reach NATS. Immutable.

    Credentials: ``user``/``password``, or ``token``, or an nkey seed file, or a ``.creds``
    file (JWT + nkey); at most one kind. TLS: ``tls_ca_file`` (verify the server) and
    optionally ``tls_cert_file``/``tls_key_file`` (client certificate). Reconnects are
    retried forever; the *first* connect is retried until ``initial_connect_deadline_s``
    (None: forever). Secrets are left out of ``repr``. ``inbox_prefix``: where replies to
    this client's requests arrive; "" means ``_INBOX_<user>`` with a user, else
    ``_INBOX`` (least-privilege users may read only their own inbox:
    services/common/nats_auth.py).
    """

    servers: tuple[str, ...] = ("nats://127.0.0.1:4222",)
    name: str = "fluidpd"
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    nkeys_seed_file: str | None = None
    creds_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_hostname: str | None = None
    inbox_prefix: str = ""
    connect_timeout_s: float = 2.0
    initial_connect_deadline_s: float | None = 30.0
    reconnect_wait_s: float = 0.25
    ping_interval_s: float = 10.0
    max_outstanding_pings: int = 3
    drain_timeout_s: float = 5.0
    request_timeout_s: float = 2.0
    pending_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if isinstance(self.servers, str):
            raise ValueError("servers must be a tuple of URLs, not a string")
        if not self.servers:
            raise ValueError("at least one NATS server URL is required")
        if (self.user is None) != (self.password is None):
            raise ValueError("user and password go together")
        kinds = [
            self.user is not None,
            self.token is not None,
            self.nkeys_seed_file is not None,
            self.creds_file is not None,
        ]
        if sum(kinds) > 1:
            raise ValueError("choose one credential kind: user/password, token, nkey or creds")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        for name in (
            "connect_timeout_s",
            "reconnect_wait_s",
            "ping_interval_s",
            "drain_timeout_s",
            "request_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.initial_connect_deadline_s is not None and self.initial_connect_deadline_s <= 0:
            raise ValueError("initial_connect_deadline_s must be > 0 or None")
        if self.max_outstanding_pings < 1 or self.pending_bytes < 1024 * 1024:
            raise ValueError("max_outstanding_pings >= 1 and pending_bytes >= 1 MiB required")

    @classmethod
    def from_url(cls, url: str, **overrides: object) -> BusConfig:
        """Config for one or more comma-separated server URLs. A ``user:pass@`` in a URL
        becomes ``user``/``password`` (so the client also uses that user's reply inbox) and
        is removed from ``servers``; credentials given in ``overrides`` win. Raises
        ValueError as the constructor does."""
        servers: list[str] = []
        creds: tuple[str, str] | None = None
        for raw in url.split(","):
            server = raw.strip()
            if not server:
                continue
            parts = urlsplit(server)
            if parts.username is not None and parts.password is not None:
                creds = creds or (unquote(parts.username), unquote(parts.password))
                server = urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
            servers.append(server)
        has_creds = any(overrides.get(k) is not None for k in ("user", "token", "creds_file"))
        if creds is not None and not has_creds and overrides.get("nkeys_seed_file") is None:
            overrides = {"user": creds[0], "password": creds[1], **overrides}
        return cls(servers=tuple(servers), **overrides)  # type: ignore[arg-type]

    def reply_inbox_prefix(self) -> str:
        """The inbox prefix this client uses (see the class docstring). Pure."""
        if self.inbox_prefix:
            return self.inbox_prefix
        return inbox_prefix_for(self.user) if self.user else "_INBOX"

    def tls_context(self) -> ssl.SSLContext | None:
        """An SSL context when TLS is configured, else None. Reads the files named."""
        if self.tls_ca_file is None and self.tls_cert_file is None:
            return None
        context = ssl.create_default_context(cafile=self.tls_ca_file)
        if self.tls_cert_file is not None and self.tls_key_file is not None:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context


def inbox_prefix_for(user: str) -> str:
    """The reply inbox prefix of NATS user ``user`` (its permissions allow only this one)."""
    return f"_INBOX_{user}"
