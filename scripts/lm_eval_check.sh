#!/usr/bin/env bash
# A third-party client against FluidPD: lm-evaluation-harness (PyPI lm-eval 0.4.x) runs a
# small local log-likelihood task (services/bench/lm_eval_task: 40 multiple-choice items
# written for this project) twice on smollm2-135m:
#   1. local-completions -> the router of a `fluidpd up` cluster (1 prefill + 1 decode
#      worker; the task needs `echo` + `logprobs` on /v1/completions),
#   2. lm-eval's own HF backend on the same GGUF weights (transformers loads GGUF with the
#      `gguf` package),
# and compares the accuracies. No network once lm-eval is installed (offline datasets/hub).
#
# lm-eval is not a project dependency: it goes into its own venv ($LMEVAL_VENV, created on
# first use with `pip install lm-eval`), which sees the project's venv packages (torch,
# transformers, gguf) through a .pth file, so the project's venv is left untouched.
#
#   scripts/lm_eval_check.sh                # from the repository root
#   PY=/path/to/project/python LMEVAL_VENV=/tmp/lmeval PORT=8011 scripts/lm_eval_check.sh
#
# Last line: a JSON summary {"served_acc": ..., "hf_acc": ..., "equal": ...}; exit 1 if the
# accuracies differ.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$(command -v python)}
LMEVAL_VENV=${LMEVAL_VENV:-/tmp/fluidpd-lmeval-venv}
PORT=${PORT:-8011}
OUT=${OUT:-$(mktemp -d /tmp/fluidpd-lmeval.XXXXXX)}
TASKS=services/bench/lm_eval_task
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

if [ ! -x "$LMEVAL_VENV/bin/lm_eval" ]; then
  base=$("$PY" -c 'import sys; print(sys.base_prefix)')/bin/python3
  "$base" -m venv "$LMEVAL_VENV"
  site=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
  vsite=$("$LMEVAL_VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')
  echo "$site" > "$vsite/zz_fluidpd_venv.pth"
  "$LMEVAL_VENV/bin/pip" install -q "lm-eval[api]==0.4.*"
fi

# The weights and an HF tokenizer directory for lm-eval's tokenizer (both from the GGUF).
GGUF=$("$PY" -c 'from shared.engine.loader import resolve; print(resolve("smollm2-135m"))')
TOKDIR=$OUT/tokenizer
"$LMEVAL_VENV/bin/python" - "$GGUF" "$TOKDIR" <<'PYEOF'
import sys
from pathlib import Path
from transformers import AutoTokenizer
gguf = Path(sys.argv[1])
AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(sys.argv[2])
PYEOF

export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

"$PY" -m services.cli.main up --model smollm2-135m --port "$PORT" --log-dir "$OUT/logs" \
  > "$OUT/up.log" 2>&1 &
UP=$!
trap 'kill -TERM $UP 2>/dev/null; wait $UP 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
  kill -0 $UP 2>/dev/null || { cat "$OUT/up.log"; exit 1; }
  sleep 1
done

run_lm_eval() {  # name, model, model_args, extra lm_eval flags...
  local name=$1 model=$2 args=$3
  shift 3
  "$LMEVAL_VENV/bin/lm_eval" --model "$model" --model_args "$args" --tasks fluidpd_mc \
    --include_path "$TASKS" --batch_size 1 --log_samples --output_path "$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1 || { tail -40 "$OUT/$name.log"; exit 1; }
  tail -4 "$OUT/$name.log"
}
t0=$(date +%s)
run_lm_eval served local-completions \
  "model=smollm2-135m,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer_backend=huggingface,tokenizer=$TOKDIR,tokenized_requests=True,num_concurrent=1,max_retries=3"
t1=$(date +%s)
kill -TERM $UP; wait $UP || true; trap - EXIT  # the cluster's cores go to the HF run
run_lm_eval hf hf "pretrained=$(dirname "$GGUF"),gguf_file=$(basename "$GGUF"),tokenizer=$TOKDIR,dtype=float32" \
  --device cpu
t2=$(date +%s)

"$PY" - "$OUT" $((t1 - t0)) $((t2 - t1)) <<'PYEOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def acc(name):
    files = sorted(out.joinpath(name).rglob("results_*.json"))
    return json.loads(files[-1].read_text())["results"]["fluidpd_mc"]["acc,none"]
def logliks(name):  # doc id -> [log-likelihood of each choice]
    files = sorted(out.joinpath(name).rglob("samples_fluidpd_mc_*.jsonl"))
    rows = [json.loads(line) for line in files[-1].read_text().splitlines()]
    return {r["doc_id"]: [float(x[0]) for x in r["filtered_resps"]] for r in rows}
served, hf = acc("served"), acc("hf")
a, b = logliks("served"), logliks("hf")
diff = max(abs(x - y) for d in a for x, y in zip(a[d], b[d], strict=True))
picks = sum(max(range(len(a[d])), key=a[d].__getitem__) != max(range(len(b[d])), key=b[d].__getitem__) for d in a)
summary = {"task": "fluidpd_mc", "n": len(a), "served_acc": served, "hf_acc": hf,
           "equal": served == hf, "max_abs_loglik_diff": diff, "different_picks": picks,
           "served_s": int(sys.argv[2]), "hf_s": int(sys.argv[3]), "out": str(out)}
print(json.dumps(summary))
sys.exit(0 if served == hf else 1)
PYEOF
