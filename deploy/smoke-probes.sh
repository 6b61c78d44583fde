#!/usr/bin/env bash
# A smoke check of the operator's surface on the embedded model, on this machine: the probes'
# bodies, four real jobs, every worker hung (SIGSTOP) until readiness fails and heals, the
# metrics, then governor drain and SIGTERM. Needs .venv (deploy/setup.sh) and curl.
#
#   deploy/smoke-probes.sh [OUT_DIR]      (default: a new temporary folder)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
echo "== output in $OUT (daemon.log: JSON logs, metrics.txt)"
.venv/bin/governor serve --listen 127.0.0.1:7781 --metrics-listen 127.0.0.1:9481 --max-inflight 2 \
  --n-ctx 512 --log-format json --probe-interval 1 --probe-timeout 2 --lanes true \
  2> $OUT/daemon.log &
PID=$!
for i in $(seq 1 120); do curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:9481/healthz/ready | grep -q 200 && break; sleep 0.5; done
echo "== ready after start"; curl -s -w ' [%{http_code}]\n' 127.0.0.1:9481/healthz/ready
echo "== live"; curl -s -w ' [%{http_code}]\n' 127.0.0.1:9481/healthz/live
for p in "Once upon a time" "The capital of France is" "List three colours:"; do
  .venv/bin/governor-cli --addr 127.0.0.1:7781 generate "$p" --max-new-tokens 24 > /dev/null 2>> $OUT/cli.log
done
.venv/bin/governor-cli --addr 127.0.0.1:7781 generate --chat "Say hi" --max-new-tokens 16 --temperature 0 >/dev/null 2>>$OUT/cli.log
# Hang one worker: its probe times out, readiness fails, liveness holds.
WORKERS=$(pgrep -P $PID -f llama_worker | tr '\n' ' ')
echo "== workers: $WORKERS"
for w in $WORKERS; do kill -STOP $w; done
for i in $(seq 1 40); do curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:9481/healthz/ready | grep -q 503 && break; sleep 0.25; done
echo "== ready with every worker stopped (SIGSTOP)"; curl -s -w ' [%{http_code}]\n' 127.0.0.1:9481/healthz/ready
echo "== live meanwhile"; curl -s -w ' [%{http_code}]\n' 127.0.0.1:9481/healthz/live
# A stopped worker never confirms the probe's cancel: killed and replaced after 10 s.
for i in $(seq 1 120); do curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:9481/healthz/ready | grep -q 200 && break; sleep 0.5; done
echo "== ready again after the replacement (waited ~$((i/2)) s)"; curl -s -w ' [%{http_code}]\n' 127.0.0.1:9481/healthz/ready
echo "== new worker pids: $(pgrep -P $PID -f llama_worker | tr '\n' ' ')"
curl -s 127.0.0.1:9481/metrics > $OUT/metrics.txt
echo "== drain"; .venv/bin/governor drain --metrics-listen 127.0.0.1:9481 --wait 10; echo "exit $?"
echo "== ready while draining"; curl -s -w ' [%{http_code}]\n' 127.0.0.1:9481/healthz/ready
kill -TERM $PID; wait $PID; echo "daemon exit $?"
