#!/usr/bin/env bash
# The GPU checks in one go, for the day a GPU machine is lent: the CUDA-marked tests and the
# engine benchmark on the GPU. Run from the repository root after `make install` (with the
# CUDA build of torch and `pip install -e '.[gpu]'`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.cuda.get_device_name())'
"$PY" -c 'import flashinfer, rmm; print("flashinfer", flashinfer.__version__, "rmm", rmm.__version__)'
"$PY" -m pytest -q -m gpu tests/test_gpu.py
"$PY" -m services.cli.main bench engine --device cuda --no-hf | tail -n 1
