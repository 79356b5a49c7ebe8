"""The ``--config`` / ``--configs`` list of the simulator and replay benchmarks, parsed once.

``bench sim``, ``bench sim-sweep`` and ``bench replay`` each know their own configurations
(services/sim/config.py, services/bench/replay.py); how a list of them is spelled on the
command line is the same for all three. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

ALL = "all"  # every configuration the benchmark knows, in its own order


def config_names(text: str, known: Sequence[str], extra: Sequence[str] = ()) -> list[str]:
    """The configurations ``text`` names: ``all`` is every one of ``known``; otherwise the
    comma-separated names, in the order given (blanks around a name are ignored), each of
    ``known`` or of ``extra`` (named only on request, never part of ``all``: a yardstick
    such as the simulator's ``oracle-live``).

    Raises ValueError, naming the known ones, on an unknown name or an empty list."""
    if text.strip() == ALL:
        return list(known)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known and name not in extra]
    if unknown or not names:
        what = f"unknown config {unknown[0]!r}" if unknown else "no config named"
        raise ValueError(f"{what}; known: {', '.join([*known, *extra])}")
    return names
