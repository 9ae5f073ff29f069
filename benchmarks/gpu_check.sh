#!/usr/bin/env bash
# One prepared GPU check for chunkzero's ZeroDDP (issue 11, item 5): one GPU, NCCL at world size 1, bf16.
#
#   bash benchmarks/gpu_check.sh            # on a machine with one CUDA GPU: at most ~8 minutes
#   bash benchmarks/gpu_check.sh --smoke    # anywhere (CPU, gloo, tiny models): checks the plumbing
#
# Parts (each under its own timeout, so the whole script ends within its budget even if one hangs):
#   1. GPT-2 124M shape (12 x 768, vocab 50257, 1024 positions), 8 x 1024 tokens per step
#   2. GPT-2 355M shape (24 x 1024, 16 heads), 8 x 1024 tokens per step
#      each: plain torch bf16 autocast + AdamW(fused=True), FSDP2 (fully_shard per block) and ZeroDDP
#      (prefetch=1; offload_optim_frac 0.5 and 1.0), interleaved by benchmarks/bench_engine.py:
#      tokens/s, peak torch.cuda.max_memory_allocated (after construction), MFU against 989 TFLOP/s.
#   3. The largest byte-level GPT (vocab 256, sequence 1024, batch 1) that trains one step with full
#      optimizer offload (offload_optim_frac=1.0): sizes from a ladder, the largest that host memory
#      (16 bytes per parameter on the host) should hold tried first, then smaller ones until one trains.
# GPU_CHECK_BUDGET_S (default 470) is the whole script's budget in seconds; GPU_CHECK_LADDER overrides the
# ladder of part 3. Results: gpu_check.md (markdown tables), gpu_check.json (every measurement) and gpu_check.log under
# $OUT when set, else runs/gpu_check/. PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
PY=${PYTHON:-python3}
DEST=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$DEST"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MD=$DEST/gpu_check.md
LOG=$DEST/gpu_check.log
: >"$MD"
: >"$LOG"
START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-470}

log() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG" >&2; }
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# A part: `part NAME SECONDS cmd...` runs cmd in its own process group under a timeout capped by the
# time left; its stdout (a markdown table) goes into gpu_check.md, stderr into the log.
part() {
  local name=$1 secs=$2
  shift 2
  local cap=$(($(left) - 10))
  ((secs > cap)) && secs=$cap
  if ((secs < 20)); then
    log "$name: skipped (budget spent)"
    echo -e "\n### $name\n\nskipped: the time budget was spent\n" >>"$MD"
    return 2
  fi
  log "$name: start (timeout ${secs}s)"
  setsid timeout -k 5 "$secs" "$@" >"$WORK/$name.md" 2>>"$LOG"
  local rc=$?
  { echo -e "\n### $name\n"; cat "$WORK/$name.md"; } >>"$MD"
  if ((rc != 0)); then
    log "$name: failed (exit $rc$( ((rc == 124)) && echo ', timed out'))"
    echo -e "\n$name: **failed** (exit $rc; see gpu_check.log)\n" >>"$MD"
  else
    log "$name: done"
  fi
  return $rc
}

HAS_CUDA=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>>"$LOG" || echo 0)
{
  echo "# chunkzero GPU check ($(date -u +%Y-%m-%dT%H:%MZ))"
  echo
  echo '```'
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU")' 2>&1
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "cpus $(nproc), host memory $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 2^20}' /proc/meminfo)"
  uptime
  echo '```'
} >>"$MD" 2>&1

if ((SMOKE)); then
  [[ $HAS_CUDA == 1 ]] && BACKEND=nccl || BACKEND=gloo
  SHAPE_124M=(--n-layer 1 --n-embd 64 --n-head 2 --vocab 512 --seq 64 --batch 2)
  SHAPE_355M=(--n-layer 2 --n-embd 64 --n-head 2 --vocab 512 --seq 64 --batch 2)
  REPS=(--warmup 1 --repeats 2 --steps 1)
  LADDER=("1 64 2" "2 64 2" "2 128 4")
  LARGE_SEQ=64
  T1=240 T2=240 TRY=150
else
  if [[ $HAS_CUDA != 1 ]]; then
    log "no CUDA device: run with --smoke off a GPU"
    echo -e "\nno CUDA device found: nothing measured (use --smoke to check the plumbing)\n" >>"$MD"
    exit 1
  fi
  BACKEND=nccl
  SHAPE_124M=(--n-layer 12 --n-embd 768 --n-head 12 --vocab 50257 --seq 1024 --batch 8)
  SHAPE_355M=(--n-layer 24 --n-embd 1024 --n-head 16 --vocab 50257 --seq 1024 --batch 8)
  REPS=(--warmup 3 --repeats 4 --steps 3)
  # byte-level GPTs, "n_layer n_embd n_head": 1.2B, 2.5B, 4.1B, 6.4B, 8.1B, 9.7B parameters
  LADDER=("24 2048 16" "32 2560 20" "36 3072 24" "32 4096 32" "40 4096 32" "48 4096 32")
  LARGE_SEQ=1024
  T1=110 T2=140 TRY=180
fi
if [[ -n ${GPU_CHECK_LADDER:-} ]]; then  # e.g. "1 64 2;2 64 3": rungs "n_layer n_embd n_head", smallest first
  IFS=';' read -ra LADDER <<<"$GPU_CHECK_LADDER"
fi
SYSTEMS=autocast,fsdp2,zero:prefetch=1,zero:prefetch=1:offload_optim_frac=0.5,zero:prefetch=1:offload_optim_frac=1.0
# every system steps with torch's fused AdamW (on the host too: 6x the for-loop kernel, bench_cpu_adam.py)
COMMON=(--backend "$BACKEND" --world-size 1 --precisions bf16 --model gpt --peak-tflops 989 --adamw fused)

part gpt2-124M "$T1" "$PY" benchmarks/bench_engine.py "${COMMON[@]}" --systems "$SYSTEMS" "${SHAPE_124M[@]}" \
  "${REPS[@]}" --timeout "$T1" --json "$WORK/gpt2-124M.json"
part gpt2-355M "$T2" "$PY" benchmarks/bench_engine.py "${COMMON[@]}" --systems "$SYSTEMS" "${SHAPE_355M[@]}" \
  "${REPS[@]}" --timeout "$T2" --json "$WORK/gpt2-355M.json"

# ---- 3. the largest byte-level GPT with full optimizer offload: the biggest rung host memory should
# hold (16 bytes per parameter on the host, 80% of MemTotal) first, then down the ladder.
HOST_BYTES=$(awk '/MemTotal/ {print $2 * 1024}' /proc/meminfo)
fits() { # n_layer n_embd -> 0 if 16 * params <= 0.8 * host memory
  awk -v l="$1" -v d="$2" -v h="$HOST_BYTES" 'BEGIN { exit !(16 * (12 * l * d * d + 1280 * d) <= 0.8 * h) }'
}
CANDIDATES=()
for ((i = ${#LADDER[@]} - 1; i >= 0; i--)); do
  read -r L D H <<<"${LADDER[$i]}"
  fits "$L" "$D" && CANDIDATES+=("${LADDER[$i]}")
done
echo -e "\n### largest byte-level GPT with offload_optim_frac=1.0 (sequence $LARGE_SEQ, batch 1)\n" >>"$MD"
LARGEST=none
for rung in "${CANDIDATES[@]}"; do
  read -r L D H <<<"$rung"
  name="offload-${L}x${D}"
  if part "$name" "$TRY" "$PY" benchmarks/bench_engine.py "${COMMON[@]}" --systems zero:prefetch=1:offload_optim_frac=1.0 \
    --n-layer "$L" --n-embd "$D" --n-head "$H" --vocab 256 --seq "$LARGE_SEQ" --batch 1 --warmup 1 --repeats 1 --steps 1 \
    --timeout "$TRY" --json "$WORK/$name.json"; then
    LARGEST="$L layers x $D ($name)"
    break
  elif (($? == 2)); then
    break # the budget is spent
  fi
done
echo -e "\n**largest that trained with full optimizer offload: $LARGEST**\n" >>"$MD"
log "largest with full offload: $LARGEST"

# ---- 4. placement="auto" (issue 13's own figures, benchmarks/gpu_placement.py), with the time left
PLACEMENT_ARGS=(--part speed --try-timeout 100)
((SMOKE)) && PLACEMENT_ARGS+=(--smoke)
part placement-auto 240 "$PY" benchmarks/gpu_placement.py "${PLACEMENT_ARGS[@]}"

# ---- summary: offload's drop in device memory and tokens/s against ZeroDDP without offload; one JSON
"$PY" - "$WORK" "$DEST/gpu_check.json" "$LARGEST" >>"$MD" 2>>"$LOG" <<'EOF'
import glob, json, os, sys
work, dest, largest = sys.argv[1:4]
runs = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(os.path.join(work, "*.json")))}
size = lambda n: f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
json.dump(runs, open(dest, "w"), indent=1)
for name, run in runs.items():
    if largest.endswith(f"({name})") and run["rows"]:
        r = run["rows"][0]
        print(f"largest with full offload: {r['n_params']:,} parameters, {r['tokens_per_s']:.0f} tokens/s, "
              f"peak CUDA {r['peak_cuda_mib'] or 0:.0f} MiB, peak host RSS {r['peak_rss_mib']:.0f} MiB, "
              f"MFU {100 * r.get('mfu', 0.0):.1f}%")
print("\n### offload against ZeroDDP without offload\n")
print("| model | offload_optim_frac | peak CUDA MiB | drop MiB | tokens/s | × tokens/s without offload | MFU |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name, run in runs.items():
    rows = {r["system"]: r for r in run["rows"]}
    base = rows.get("zero:prefetch=1")
    for frac in ("0.5", "1.0"):
        r = rows.get(f"zero:prefetch=1:offload_optim_frac={frac}")
        if r is None:
            continue
        peak = r["peak_cuda_mib"] or 0.0
        drop = f"{(base['peak_cuda_mib'] or 0.0) - peak:.0f}" if base else "–"
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "–"
        print(f"| {name} ({size(r['n_params'])}) | {frac} | {peak:.0f} | {drop} | {r['tokens_per_s']:.0f} | {ratio} | "
              f"{100 * r.get('mfu', 0.0):.1f}% |")
EOF
log "finished in $(($(date +%s) - START))s; results in $DEST"
echo -e "\nfinished in $(($(date +%s) - START)) s\n" >>"$MD"
