"""Typed errors of the policy layer (configs, latency profiles)."""

from __future__ import annotations

from shared.errors import FluidPDError


class PolicyConfigError(FluidPDError, ValueError):
    """A policy config or latency profile field is out of range, missing or unknown.

    Also a ValueError so that generic config loaders can catch it as one.
    """

    code = "policy_config_error"
    http_status = 400


class ProfileFormatError(PolicyConfigError):
    """A latency-profile JSON document is not in the format ``LatencyProfile.to_json`` writes."""

    code = "latency_profile_format_error"
