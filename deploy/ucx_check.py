"""Which transports the installed UCX has, checked at image build (and by tests).

Runs the ``ucx_info`` that ships with the libucx wheel (ucxx's UCX) and lists its memory
domains' transports, plus the transport modules present on disk. Module presence is what
a build can check: at ``docker build`` there is no GPU, so ``ucx_info -d`` lists no CUDA
transport even when the module is there, and no NIC, so no RDMA one either.

    python deploy/ucx_check.py --transports tcp,self --modules cuda

Exit 0 with one JSON line (transports, modules, rdma: whether an InfiniBand/RoCE module
exists); 1 with one line naming what is missing; 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path


def ucx_root() -> Path:
    """The libucx wheel's directory (bin/ucx_info, lib/ucx/libuct_*.so)."""
    import libucx  # the wheel ucxx depends on

    return Path(libucx.__file__).parent


def transports(root: Path) -> list[str]:
    env = {**os.environ, "LD_LIBRARY_PATH": str(root / "lib"), "UCX_WARN_UNUSED_ENV_VARS": "n"}
    out = subprocess.run(
        [str(root / "bin" / "ucx_info"), "-d"], capture_output=True, text=True, env=env, timeout=60
    ).stdout
    return sorted(set(re.findall(r"^#\s+Transport:\s+(\S+)", out, re.M)))


def modules(root: Path) -> list[str]:
    """Transport modules on disk: libuct_<name>.so -> name (cuda, ib, cma, ...)."""
    return sorted(
        m.group(1)
        for p in (root / "lib" / "ucx").glob("libuct_*.so")
        if (m := re.fullmatch(r"libuct_(\w+)\.so", p.name))
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--transports", default="", help="comma list ucx_info -d must show")
    p.add_argument("--modules", default="", help="comma list of libuct_<name>.so that must exist")
    args = p.parse_args(argv)
    root = ucx_root()
    have_tl, have_mod = transports(root), modules(root)
    missing = [
        f"transport {t}" for t in filter(None, args.transports.split(",")) if t not in have_tl
    ]
    missing += [f"module {m}" for m in filter(None, args.modules.split(",")) if m not in have_mod]
    report = {
        "ucx": str(root),
        "transports": have_tl,
        "modules": have_mod,
        # No ib module: across nodes KV moves over TCP whatever UCX_TLS says.
        "rdma": any(m.startswith(("ib", "rdmacm")) for m in have_mod),
    }
    if missing:
        print(f"ucx_check: missing {', '.join(missing)} in {json.dumps(report)}", file=sys.stderr)
        return 1
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
