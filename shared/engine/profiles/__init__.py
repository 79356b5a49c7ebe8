"""Shipped latency profiles (JSON in the format ``fluidpd calibrate`` writes)."""

from __future__ import annotations

from pathlib import Path

from shared.policy.predictors import LatencyProfile

DEFAULT_PROFILE = "llama-3.1-8b-a100-80gb"
PROFILE_DIR = Path(__file__).parent


def load_profile(path_or_name: str = "") -> LatencyProfile:
    """Load a shipped profile by name, or a JSON file by path ('' = the default profile).

    Raises FileNotFoundError naming the path, or the profile's typed format error.
    """
    name = path_or_name or DEFAULT_PROFILE
    shipped = PROFILE_DIR / f"{name}.json"
    return LatencyProfile.load(shipped if shipped.exists() else Path(name))
