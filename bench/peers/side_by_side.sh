#!/usr/bin/env bash
# Side by side in one run: vLLM-CPU and pdserve (PD cluster, colocated node), each
# driven by the same aiperf workload (run_aiperf_sweep.sh) with the client pinned to core 1.
# Prefix caching is off on both sides: every level resends the same seeded prompts.
# Usage (from the project checkout, which must have .venv): side_by_side.sh OUT_DIR [SYSTEMS]
#   SYSTEMS: space-separated subset of "vllm vllm_fp32 pd pd11 pd22 pd_fp32 pd_args pd_router colo colo1 colo2 colopp2 colo_args" and
#   of the prefix-cache runs "vllm_cache vllm_fp32_cache pd_cache colo_cache" (default: vllm pd colo)
#   vllm_fp32: vLLM in fp32 (on a CPU without bf16 units, the dtype pdserve's auto resolves to).
#   *_cache: prefix caching on, and every request starts with one shared 512-token system prompt
#   (run_aiperf_sweep.sh SYSPROMPT; each level draws its own user prompts).
#   LEVELS (env): concurrency:requests pairs, default "1:16 8:48 32:64"
#   PEER_MODEL (env): a Hugging Face folder every system serves (default: SmolLM2's, and
#   pdserve's own default model); e.g. Gemma 3 from bench/peers/convert_gemma3.py
#   TEMPERATURE (env): sent to both servers, default 1 (0: greedy, as runs before 25; run_aiperf_sweep.sh)
# Writes OUT_DIR/summary.md (the aiperf table) and OUT_DIR/cpu_share.md (each core's busy share,
# and the client's and the server's CPU, over each level's measured window: cpu_share.py).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"   # bench/peers: adapted from the shared peer scripts; same workload
PEER_DIR="${PEER_DIR:-$HOME/.cache/pdserve-peers}"; export PEER_DIR
OUT="$1"; SYSTEMS="${2:-vllm pd colo}"
export LEVELS="${LEVELS:-1:16 8:48 32:64}"
PROJ="$(pwd)"; PDS="$PROJ/.venv/bin/pdserve"
mkdir -p "$OUT"
PY="$PEER_DIR/client-venv/bin/python"
taskset -c 1 "$PY" "$HERE/cpu_share.py" record "$OUT/cpu_samples.jsonl" 21600 & SAMPLER=$!
trap 'kill -TERM $SAMPLER 2>/dev/null' EXIT
served_model() { curl -s "$1/v1/models" | sed -n 's/.*"id": *"\([^"]*\)".*/\1/p' | head -n 1; }
wait_health() {  # URL PID SECONDS
  for _ in $(seq 1 $(( $3 * 2 ))); do
    kill -0 "$2" 2>/dev/null || { echo "died"; return 1; }
    curl -sf "$1/health" >/dev/null 2>&1 && curl -sf "$1/v1/models" >/dev/null 2>&1 && \
      curl -sf "$1/v1/chat/completions" -H 'Content-Type: application/json' \
        -d "{\"model\": \"$(served_model "$1")\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 1}" >/dev/null 2>&1 && return 0
    sleep 0.5
  done; return 1
}
# TERM the group, wait up to 20 s for all of it (not only its leader, a bash that exits at once) to
# stop and clean up, then KILL what is left
stop_group() { kill -TERM -- "-$1" 2>/dev/null || kill -TERM "$1" 2>/dev/null; for _ in $(seq 1 40); do kill -0 -- "-$1" 2>/dev/null || break; sleep 0.5; done; kill -KILL -- "-$1" 2>/dev/null; sleep 2; }
for S in $SYSTEMS; do
  echo "== $S $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
  t0=$(date +%s.%N)
  cache="--no-prefix-cache"; SYSPROMPT=0
  case $S in *_cache) cache=""; SYSPROMPT=512;; esac
  export SYSPROMPT
  base=${S%_cache}
  case $base in
    vllm|vllm_fp32)
      va=(); [ -n "$cache" ] && va=(--no-enable-prefix-caching); [ "$base" = vllm_fp32 ] && va+=(--dtype float32)
      setsid "$HERE/start_vllm.sh" 8011 "${va[@]}" || continue
      PORT=8011; PGID=$(cat "$PEER_DIR/vllm.pid"); MODEL="${PEER_MODEL:-$PEER_DIR/smollm2-135m-hf}" ;;
    pd|pd11|pd22|pd_fp32|pd_args|pd_router)
      # pd: `pdserve up` with its defaults; pd11 / pd22: PP 1+1 / PP 2+2 named explicitly;
      # pd_args: pd with the node flags in PD_NODE_ARGS (env), e.g. "--max-batch-tokens 512",
      # and the decode nodes' in PD_DECODE_ARGS, e.g. "--windowed-kv";
      # pd_router: pd with the router flags in PD_ROUTER_ARGS (env), e.g. "--disagg-local-prefill-cost 0".
      # No prefix cache (but in pd_cache): the levels resend the same prompts, and vLLM runs with
      # its cache off too.
      extra=(); [ -n "${PEER_MODEL:-}" ] && extra=(--model "$PEER_MODEL")
      case $S in pd11) extra+=(--prefill-pp 1 --decode-pp 1);; pd22) extra+=(--prefill-pp 2 --decode-pp 2);; esac
      na="$cache"; [ "$S" = pd_fp32 ] && na="$na --dtype float32"
      [ "$S" = pd_args ] && na="$na ${PD_NODE_ARGS:-}"
      [ -n "${na// }" ] && extra+=("--node-args=$na")
      [ "$S" = pd_args ] && [ -n "${PD_DECODE_ARGS:-}" ] && extra+=("--decode-args=$PD_DECODE_ARGS")
      [ "$S" = pd_router ] && extra+=("--router-args=${PD_ROUTER_ARGS:-}")
      setsid "$PDS" up --port 8100 "${extra[@]}" > "$OUT/$S-server.log" 2>&1 & PGID=$!
      PORT=8100
      wait_health http://127.0.0.1:8100 $PGID 300 || { echo "$S did not start"; stop_group $PGID; continue; }
      MODEL=$(served_model http://127.0.0.1:8100) ;;
    colo|colo1|colo2|colopp2|colo_args)
      # colo: `pdserve serve --pp 1` with its defaults (its plan: one compute core, one for I/O);
      # colo1 / colo2: --threads 1 / 2 named explicitly (colo2: both cores compute, nothing left for I/O)
      # colopp2: `pdserve serve --pp 2`, one rank per core, nothing left for I/O
      # colo_args: colo with the node flags in COLO_NODE_ARGS (env), e.g. "--batch-invariant"
      th=(--pp 1); [ -n "${PEER_MODEL:-}" ] && th+=(--model "$PEER_MODEL")
      [ "$S" = colo1 ] && th+=(--threads 1); [ "$S" = colo2 ] && th+=(--threads 2)
      [ "$S" = colopp2 ] && th=(--pp 2 "${th[@]:2}")
      [ "$S" = colo_args ] && th+=(${COLO_NODE_ARGS:-})
      setsid bash -c "'$PDS' serve ${th[*]} $cache --port 8201 & '$PDS' router --port 8200 --worker http://127.0.0.1:8201 & wait" > "$OUT/$S-server.log" 2>&1 & PGID=$!
      PORT=8200
      wait_health http://127.0.0.1:8200 $PGID 300 || { echo "$S did not start"; stop_group $PGID; continue; }
      MODEL=$(served_model http://127.0.0.1:8200) ;;
  esac
  echo "$S ready after $(echo "$(date +%s.%N) - $t0" | bc) s"
  # the served model id is what the client sends; the tokenizer is the same HF folder for all
  "$HERE/run_aiperf_sweep.sh" "$PORT" "$MODEL" "$OUT/$S" 1
  # pdserve's router: its latency model's errors and its route decisions over the whole sweep
  case $base in vllm*) ;; *) curl -s "http://127.0.0.1:$PORT/metrics" > "$OUT/$S-router-metrics.txt" || true;; esac
  stop_group $PGID
done
RUNS=$(for S in $SYSTEMS; do echo "$OUT/$S"; done)
"$PY" "$HERE/summarize_aiperf.py" $RUNS | tee "$OUT/summary.md"
kill -TERM $SAMPLER 2>/dev/null; wait $SAMPLER 2>/dev/null
"$PY" "$HERE/cpu_share.py" summarize "$OUT/cpu_samples.jsonl" $RUNS | tee "$OUT/cpu_share.md"
