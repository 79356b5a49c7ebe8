#!/usr/bin/env bash
# Brings deploy/compose.cpu.yml up for real and checks it end to end, on a Linux host with
# Docker (the engine, and compose v2 as `docker compose`). Run from anywhere:
#
#   scripts/compose_check.sh
#
# Steps, each printed as one PASS/FAIL line:
#   build      docker compose build (one service per image) [+ deploy/Dockerfile.nats]
#   up         docker compose up --wait: every service healthy
#   chat       POST /v1/chat/completions on the router's published port; a non-empty answer
#   switch     the operator user sends {"role":"decode"} to fluidpd.worker.<id>.switch over
#              NATS (what `nats req` does), then `fluidpd ctl status` shows the new role
#   anonymous  a NATS client without credentials is refused
#   down       docker compose down -v (always, by trap, also after a failure)
# Exit 0 when every step passed, 1 otherwise.
#
# A throwaway .env (every secret the compose file requires, via openssl rand -hex) and
# free host ports are generated in a temp dir; nothing is written to the repository.
# A worker refuses a switch that would leave its role with no active worker, and the CPU
# file runs one prefill and one decode worker: the check adds a second prefill worker, p1
# (an override in the temp dir extending p0, logging in as NATS user worker-p1), so that
# p0 may become a decode worker. COMPOSE_CHECK_EXTRA_PREFILL=0 leaves it out.
#
# Environment (all optional; the defaults build on a host that reaches Docker Hub, PyPI and
# the PyTorch index):
#   COMPOSE_CHECK_PYTHON     python with nats-py and this repository's dependencies, for the
#                            NATS clients and `fluidpd ctl` (default: python3)
#   COMPOSE_CHECK_WHEEL_DIR  a local directory holding the torch wheel: served on 127.0.0.1
#                            during the build and passed as FLUIDPD_CPU_TORCH_FIND_LINKS,
#                            with FLUIDPD_BUILD_NETWORK=host so the build reaches it
#   COMPOSE_CHECK_BUILD_NATS 1: build deploy/Dockerfile.nats as fluidpd-nats:local (on
#                            FLUIDPD_CPU_BASE_IMAGE) and run it, for hosts that cannot pull
#                            nats:2.11-alpine
#   COMPOSE_CHECK_WORKER     worker to switch (default p0) ...
#   COMPOSE_CHECK_ROLE       ... to this role (default decode)
#   COMPOSE_CHECK_WAIT_S     seconds `up` waits for health (default 300)
#   Passed through to compose as they are: FLUIDPD_CPU_BASE_IMAGE, FLUIDPD_PYTHON_IMAGE,
#   FLUIDPD_CPU_TORCH_INDEX_URL, FLUIDPD_CPU_TORCH_FIND_LINKS, FLUIDPD_BUILD_NETWORK,
#   FLUIDPD_NATS_IMAGE, FLUIDPD_CPU_MODEL, FLUIDPD_CPU_ENGINE (docs/operations.md).
#   DOCKER_BUILDKIT defaults to 0: BuildKit pulls the `# syntax=` frontend from a registry.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
COMPOSE_FILE="$REPO/deploy/compose.cpu.yml"
PY="${COMPOSE_CHECK_PYTHON:-python3}"
WORKER="${COMPOSE_CHECK_WORKER:-p0}"
ROLE="${COMPOSE_CHECK_ROLE:-decode}"
WAIT_S="${COMPOSE_CHECK_WAIT_S:-300}"
export DOCKER_BUILDKIT="${DOCKER_BUILDKIT:-0}"

TMP="$(mktemp -d)"
PROJECT="fluidpd-check-$$"
WHEEL_SERVER_PID=""
FAILED=0
STARTED=0

log() { echo "compose_check: $*" >&2; }
pass() { echo "PASS $1${2:+ ($2)}"; }
fail() {
  echo "FAIL $1${2:+: $2}"
  FAILED=1
}

compose() {
  local files=(-f "$COMPOSE_FILE")
  if [[ "${COMPOSE_CHECK_EXTRA_PREFILL:-1}" == 1 ]]; then files+=(-f "$TMP/p1.yml"); fi
  docker compose -p "$PROJECT" "${files[@]}" --env-file "$TMP/.env" "$@"
}

# p1: p0's service under its own id, NATS user and metrics port (see the header).
write_extra_prefill() {
  cat >"$TMP/p1.yml" <<EOF
services:
  p1:
    extends: {file: "$COMPOSE_FILE", service: p0}
    command: ["python", "-m", "services.prefill_worker", "--id", "p1"]
    environment:
      FLUIDPD_METRICS_PORT: "9101"
      FLUIDPD_NATS_USER: worker-p1
      FLUIDPD_NATS_PASSWORD: \${FLUIDPD_NATS_WORKER_P1_PASSWORD:?}
EOF
}

# Ports chosen by the kernel: other stacks (or developers) may hold 8000/4222 on this host.
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Every secret the compose file requires (${VAR:?...}): the cluster key and one NATS
# password per user, however many users the file names (per kind or per worker).
write_env() {
  local var
  umask 077
  : >"$TMP/.env"
  for var in $(grep -oE '\$\{(FLUIDPD_CLUSTER_SECRET|FLUIDPD_NATS_[A-Z0-9_]+_PASSWORD):\?' "$COMPOSE_FILE" |
    sed -E 's/^\$\{([A-Z0-9_]+):\?$/\1/' | sort -u); do
    # "p": nats-server parses $VAR in auth.conf as a config value, so a password that starts
    # with a digit (e.g. 8e3f...) is read as a number and the server refuses to start.
    echo "$var=p$(openssl rand -hex 24)" >>"$TMP/.env"
  done
  {
    echo "FLUIDPD_ROUTER_PUBLISH=$(free_port)"
    echo "FLUIDPD_NATS_PUBLISH=$(free_port)"
    echo "FLUIDPD_NATS_MONITOR_PUBLISH=$(free_port)"
  } >>"$TMP/.env"
}

env_value() { sed -n "s/^$1=//p" "$TMP/.env"; }

teardown() {
  local rc=$?
  if [[ "$STARTED" == 1 ]]; then
    if [[ "$FAILED" == 1 ]]; then compose logs --no-color --tail 40 >&2 || true; fi
    if compose down -v --remove-orphans >"$TMP/down.log" 2>&1; then
      pass down
    else
      fail down "$(tail -1 "$TMP/down.log")"
      rc=1
    fi
  fi
  if [[ -n "$WHEEL_SERVER_PID" ]]; then kill "$WHEEL_SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$TMP"
  if [[ "$FAILED" == 1 || "$rc" != 0 ]]; then
    echo "compose_check: FAIL"
    exit 1
  fi
  echo "compose_check: PASS"
}

# The Dockerfile's pip lists this directory as find-links; the classic builder cannot mount
# host paths, so it is served on loopback and the build runs on the host network.
serve_wheels() {
  local port
  port="$(free_port)"
  "$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$COMPOSE_CHECK_WHEEL_DIR" \
    >"$TMP/wheels.log" 2>&1 &
  WHEEL_SERVER_PID=$!
  export FLUIDPD_CPU_TORCH_FIND_LINKS="http://127.0.0.1:$port/"
  export FLUIDPD_BUILD_NETWORK="${FLUIDPD_BUILD_NETWORK:-host}"
  for _ in $(seq 50); do
    curl -fsS -o /dev/null "$FLUIDPD_CPU_TORCH_FIND_LINKS" 2>/dev/null && return 0
    sleep 0.1 # the server has no readiness signal
  done
  log "wheel server on port $port did not start"
  return 1
}

build_nats() {
  docker build -f "$REPO/deploy/Dockerfile.nats" -t fluidpd-nats:local \
    --build-arg "BASE_IMAGE=${FLUIDPD_CPU_BASE_IMAGE:-python:3.11-slim-bookworm}" \
    ${FLUIDPD_BUILD_NETWORK:+--network "$FLUIDPD_BUILD_NETWORK"} "$REPO" >"$TMP/build-nats.log" 2>&1
  export FLUIDPD_NATS_IMAGE=fluidpd-nats:local
}

# One service per image: p0/d0 share the worker image, controller/router the control one;
# building both of a pair builds the same image twice.
services_to_build() {
  compose config --format json | "$PY" -c '
import json, sys
seen, out = set(), []
for name, svc in sorted(json.load(sys.stdin)["services"].items()):
    if "build" in svc and svc.get("image") not in seen:
        seen.add(svc.get("image"))
        out.append(name)
print(" ".join(out))'
}

step_build() {
  local t0=$SECONDS images
  if [[ -n "${COMPOSE_CHECK_WHEEL_DIR:-}" ]] && ! serve_wheels; then
    fail build "wheel server for $COMPOSE_CHECK_WHEEL_DIR"
    return 1
  fi
  if [[ "${COMPOSE_CHECK_BUILD_NATS:-0}" == 1 ]]; then
    if ! build_nats; then
      tail -20 "$TMP/build-nats.log" >&2
      fail build "deploy/Dockerfile.nats"
      return 1
    fi
  fi
  # shellcheck disable=SC2046 # a list of service names
  if ! compose build $(services_to_build) >"$TMP/build.log" 2>&1; then
    tail -30 "$TMP/build.log" >&2
    fail build "docker compose build"
    return 1
  fi
  images="$(compose config --images | sort -u | tr '\n' ' ')"
  pass build "$((SECONDS - t0)) s; images: ${images% }"
}

step_up() {
  local t0=$SECONDS
  STARTED=1
  if ! compose up -d --no-build --wait --wait-timeout "$WAIT_S" >"$TMP/up.log" 2>&1; then
    tail -20 "$TMP/up.log" >&2
    compose ps >&2 || true
    fail up "not healthy within $WAIT_S s"
    return 1
  fi
  pass up "$((SECONDS - t0)) s to healthy: $(compose ps --format '{{.Service}}' | sort | paste -sd ' ')"
}

step_chat() {
  local url model answer
  url="http://127.0.0.1:$(env_value FLUIDPD_ROUTER_PUBLISH)/v1/chat/completions"
  model="${FLUIDPD_CPU_MODEL:-tiny}"
  if ! curl -fsS -m 120 "$url" -H 'content-type: application/json' \
    -d "{\"model\":\"$model\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":8}" \
    >"$TMP/chat.json" 2>"$TMP/chat.err"; then
    fail chat "$(cat "$TMP/chat.err")"
    return 0
  fi
  if answer="$("$PY" -c '
import json, sys
doc = json.load(open(sys.argv[1]))
choice = doc["choices"][0]
assert choice["message"]["role"] == "assistant" and choice["message"]["content"], doc
tokens = doc["usage"]["completion_tokens"]
assert tokens > 0, doc
reason = choice["finish_reason"]
print(f"{tokens} tokens, finish_reason {reason}")
' "$TMP/chat.json" 2>&1)"; then
    pass chat "$answer"
  else
    fail chat "$answer"
  fi
}

# What `nats req fluidpd.worker.<id>.switch '{"role":"..."}'` does, as the operator user.
nats_switch() {
  NATS_URL="$1" NATS_PASSWORD="$(env_value FLUIDPD_NATS_OPERATOR_PASSWORD)" "$PY" -c '
import asyncio, json, os, sys
import nats

async def main() -> None:
    nc = await nats.connect(os.environ["NATS_URL"], user="operator",
                            password=os.environ["NATS_PASSWORD"], allow_reconnect=False)
    try:
        msg = await nc.request(f"fluidpd.worker.{sys.argv[1]}.switch",
                               json.dumps({"role": sys.argv[2]}).encode(), timeout=60)
        print(msg.data.decode())
    finally:
        await nc.close()

asyncio.run(main())
' "$WORKER" "$ROLE"
}

# `fluidpd ctl status --json` as the operator: the role the controller reports for WORKER.
ctl_role() {
  (cd "$REPO" && FLUIDPD_NATS_USER=operator \
    FLUIDPD_NATS_PASSWORD="$(env_value FLUIDPD_NATS_OPERATOR_PASSWORD)" \
    "$PY" -m services.cli.main ctl status --nats "$1" --json) |
    "$PY" -c 'import json, sys; print({w["id"]: w["role"] for w in json.load(sys.stdin)}.get(sys.argv[1], "absent"))' "$WORKER"
}

step_switch() {
  local url reply role t0=$SECONDS
  url="nats://127.0.0.1:$(env_value FLUIDPD_NATS_PUBLISH)"
  if ! reply="$(nats_switch "$url" 2>&1)"; then
    fail switch "request failed: $(echo "$reply" | tail -1)"
    return 0
  fi
  if ! echo "$reply" | grep -q '"ok": *true'; then
    fail switch "worker $WORKER answered $reply"
    return 0
  fi
  # The status comes from telemetry: the new role shows within a few reports.
  for _ in $(seq 30); do
    role="$(ctl_role "$url" 2>"$TMP/ctl.err" || true)"
    if [[ "$role" == "$ROLE" ]]; then
      pass switch "$WORKER -> $ROLE in $((SECONDS - t0)) s; reply $reply; ctl status: $WORKER $role"
      return 0
    fi
    sleep 1
  done
  fail switch "reply $reply, but ctl status says $WORKER is '${role:-?}' $(tail -1 "$TMP/ctl.err")"
}

step_anonymous() {
  local url out
  url="nats://127.0.0.1:$(env_value FLUIDPD_NATS_PUBLISH)"
  if out="$("$PY" -c '
import asyncio, sys
import nats

async def quiet(exc: Exception) -> None:  # the refusal is raised below: no traceback
    pass

async def main() -> None:
    try:
        nc = await nats.connect(sys.argv[1], allow_reconnect=False, connect_timeout=5,
                                error_cb=quiet)
    except Exception as exc:
        print(f"refused: {type(exc).__name__}: {exc}")
        return
    await nc.close()
    sys.exit("connected without credentials")

asyncio.run(main())
' "$url" 2>&1)" && echo "$out" | grep -qi 'authorization'; then
    pass anonymous "$out"
  else
    fail anonymous "$out"
  fi
}

main() {
  trap teardown EXIT
  command -v docker >/dev/null || { fail build "no docker"; exit 1; }
  docker compose version >/dev/null || { fail build "no docker compose (v2)"; exit 1; }
  write_env
  write_extra_prefill
  step_build || exit 1
  step_up || exit 1
  step_chat
  step_switch
  step_anonymous
}

main "$@"
