#!/usr/bin/env bash
# One prepared GPU check of chunkzero's ZeroDDP on one CUDA GPU (bf16, world size 1), sized to return
# its table on the first try: about 8 minutes on an H200, so that a 15-minute device budget leaves room
# to rerun it (or some of its parts, GPU_CHECK_PARTS) once.
#
#   bash benchmarks/gpu_check.sh            # one CUDA GPU; the interpreter: $PYTHON, else python3 (installs nothing)
#   bash benchmarks/gpu_check.sh --smoke    # anywhere: CPU, gloo, tiny models, the same parts and files (< 1 min idle)
#
# Budget per part, seconds (outer = the part's process group is killed; inner = the part's own limit,
# below it, within which it stops early and still writes its rows):
#   part          outer  inner  what
#   env             30     -    torch, CUDA, GPU, host memory (one row)
#   streams         70     60   gpu_streams.py: prefetch=1 vs prefetch=0 bitwise, 20 steps, on every stream path
#                               one GPU runs (offload_optim_frac, offload_param_frac, placement="auto"), + a control
#   gpt2-124M       90     80   bench_engine.py: torch autocast + fused AdamW, FSDP2, ZeroDDP, offload_optim 0.5 / 1.0
#   placement       90     80   gpu_placement.py --part speed: static vs auto at 50% / 25% of the model data
#   gpt2-355M       90     80   as gpt2-124M, the GPT-2 medium shape
#   largest        120   per rung  the largest byte-level GPT with offload_optim_frac=1.0, sized from MemAvailable and
#                               the GPU's free memory now (>= 22 bytes per parameter on the host), down the ladder
#   plan            80     -    gpu_plan.py: chunkzero plan's peak against a 3-step chunkzero train's
#                               torch.cuda.max_memory_allocated (gpt2, bf16, 8 x 1024 tokens, one worker)
#   total          570 s, plus ~1 s per part to rebuild the table
# --smoke: the same parts, but gpt2-124M, gpt2-355M and the one-rung largest share one bench_engine.py
# run (--parts: outer 60 s per part + 15, inner 60 s each; the ranks are forks of one server that imported
# torch once), so the whole smoke costs a handful of torch imports rather than one per part.
#
# World size 1 only: one GPU cannot run NCCL at W > 1 (NCCL needs one device per rank), so no NCCL
# collective beyond a one-rank barrier runs and no reduction on the communication stream; at W = 1 the
# engine's gathers and reductions are local copies. What one GPU exercises: the device<->host copies of
# the offloaded optimizer (gradients device->host on the communication stream) and parameters (host->device
# at each gather), prefetch, and placement="auto"'s moves.
#
# Output folder: $OUT when set, else runs/gpu_check/: gpu_check.jsonl (every row, appended as measured),
# gpu_check.md (the tables, rebuilt from the JSONL after every part: a killed part keeps the rows it wrote),
# gpu_check.log (every part's output).
# Environment: PYTHON, GPU_CHECK_PARTS (comma-separated subset of the parts above), GPU_CHECK_LADDER
# ("n_layer n_embd n_head;..." smallest first), GPU_CHECK_HOST_BYTES_PER_PARAM (default 24, at least 22).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SMOKE=0
[[ "${1:-}" == "--smoke" ]] && SMOKE=1
PY=${PYTHON:-python3}
DEST=${OUT:-$ROOT/runs/gpu_check}
mkdir -p "$DEST"
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
JSONL=$DEST/gpu_check.jsonl
MD=$DEST/gpu_check.md
LOG=$DEST/gpu_check.log
: >"$JSONL"
: >"$LOG"
START=$(date +%s)
PARTS=${GPU_CHECK_PARTS:-env,streams,gpt2-124M,placement,gpt2-355M,largest,plan}
HOST_BPP=${GPU_CHECK_HOST_BYTES_PER_PARAM:-24}
((HOST_BPP < 22)) && HOST_BPP=22
HEADER="# chunkzero GPU check ($(date -u +%Y-%m-%dT%H:%MZ)$( ((SMOKE)) && echo ', --smoke: CPU plumbing only'))

World size 1: one GPU cannot run NCCL at W > 1, so no NCCL collective (beyond a one-rank barrier) and no
reduction on the communication stream is measured here; gathers and reductions are local copies at W = 1."

log() { echo "[gpu_check +$(($(date +%s) - START))s] $*" | tee -a "$LOG" >&2; }
want() { [[ ",$PARTS," == *",$1,"* ]]; }
row() { printf '%s\n' "$1" >>"$JSONL"; }  # one whole line per write (the rows written here are plain JSON)
table() { "$PY" benchmarks/gpu_rows.py table "$JSONL" "$MD" "$HEADER" 2>>"$LOG" || log "could not write $MD"; }

# A part: `run_part NAME OUTER_S cmd...`. cmd runs in a process group of its own (setsid) under
# `timeout`, which signals the whole group at OUTER_S (TERM, then KILL 5 s later); whatever is left in
# the group afterwards is killed too, so no child outlives its part holding the GPU. Then a `part` row
# (status, seconds, rows written) and the table rebuilt from the JSONL.
CHILD=0
kill_child() { ((CHILD)) && kill -KILL -- "-$CHILD" 2>/dev/null; CHILD=0; }
trap 'kill_child; table; exit 130' INT TERM
trap 'kill_child' EXIT
run_part() {
  local name=$1 outer=$2 t0 rc status
  shift 2
  t0=$(date +%s)
  log "$name: start (outer limit ${outer}s)"
  setsid timeout -k 5 "$outer" "$@" >>"$LOG" 2>&1 </dev/null &
  CHILD=$!
  wait "$CHILD"
  rc=$?
  kill_child
  case $rc in
    0) status=done ;;
    124 | 137) status="killed at the outer limit" ;;
    *) status="failed" ;;
  esac
  local n
  n=$(grep -c "\"part\": \"$name\"" "$JSONL" 2>/dev/null)
  row "{\"part\": \"$name\", \"kind\": \"part\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $(($(date +%s) - t0)), \"limit_s\": $outer, \"rows\": ${n:-0}}"
  table
  log "$name: $status (exit $rc, ${n:-0} rows)"
  return $rc
}

# ---- env (always): one row; tells whether CUDA is there
ENV_PY='
import json, os, platform, sys
import torch
sys.path.insert(0, "benchmarks")
import gpu_rows
cuda = torch.cuda.is_available()
row = {"part": "env", "kind": "env", "python": sys.executable, "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name(0) if cuda else "no GPU", "cpus": os.cpu_count(), "host": platform.node()}
if cuda:
    free, total = torch.cuda.mem_get_info(0)
    row.update(gpu_free_gib=round(free / 2**30, 1), gpu_total_gib=round(total / 2**30, 1))
mem = dict(l.split(":", 1) for l in open("/proc/meminfo"))
row.update({k + "_gib": round(int(mem[k].split()[0]) / 2**20, 1) for k in ("MemTotal", "MemAvailable")})
row["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
gpu_rows.add(sys.argv[1], row)
print(int(cuda))'
# --smoke runs on the CPU whatever the machine has: its env row reads torch's version from the package
# metadata instead of importing torch (about 2 s of CPU saved on a small VM)
ENV_SMOKE_PY='
import json, os, platform, sys
from importlib.metadata import version
sys.path.insert(0, "benchmarks")
import gpu_rows
row = {"part": "env", "kind": "env", "python": sys.executable, "torch": version("torch"), "cuda": None,
       "device": "not checked (--smoke runs on the CPU)", "cpus": os.cpu_count(), "host": platform.node()}
mem = dict(l.split(":", 1) for l in open("/proc/meminfo"))
row.update({k + "_gib": round(int(mem[k].split()[0]) / 2**20, 1) for k in ("MemTotal", "MemAvailable")})
row["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
gpu_rows.add(sys.argv[1], row)
print(0)'
((SMOKE)) && ENV_PY=$ENV_SMOKE_PY
HAS_CUDA=$(setsid timeout -k 5 30 "$PY" -c "$ENV_PY" "$JSONL" 2>>"$LOG" | tail -1)
[[ $HAS_CUDA == 1 ]] || HAS_CUDA=0
table

if ((SMOKE)); then
  BACKEND=gloo
  SHAPE_124M=(1 64 2 512 64 2)  # n_layer n_embd n_head vocab seq batch (bench_engine.py --parts entries)
  SHAPE_355M=(2 64 2 512 64 2)
  REPS=(--warmup 1 --repeats 1 --steps 1)
  SYSTEMS_124M=zero:prefetch=1:offload_optim_frac=1.0  # one system each: the smoke checks the plumbing
  SYSTEMS_355M=zero:prefetch=1:offload_optim_frac=0.5
  STREAMS_ARGS=(--smoke)
  PLACEMENT_ARGS=(--smoke --configs auto:0.5)
  LADDER=("1 64 2")  # one rung: the smoke checks the sizing and the rows, not the ceiling
  LARGE_SEQ=64
  EXTRA=(--threads 1)
else
  if [[ $HAS_CUDA != 1 ]]; then
    log "no CUDA device: run with --smoke off a GPU"
    row '{"part": "env", "kind": "note", "text": "no CUDA device found: nothing measured (use --smoke to check the plumbing)"}'
    table
    exit 1
  fi
  BACKEND=nccl
  SHAPE_124M=(--n-layer 12 --n-embd 768 --n-head 12 --vocab 50257 --seq 1024 --batch 8)
  SHAPE_355M=(--n-layer 24 --n-embd 1024 --n-head 16 --vocab 50257 --seq 1024 --batch 8)
  REPS=(--warmup 2 --repeats 3 --steps 2)
  SYSTEMS_124M=autocast,fsdp2,zero:prefetch=1,zero:prefetch=1:offload_optim_frac=0.5,zero:prefetch=1:offload_optim_frac=1.0
  SYSTEMS_355M=$SYSTEMS_124M
  STREAMS_ARGS=(--steps 20 --n-layer 6 --n-embd 768 --n-head 12 --seq 256 --batch 4)
  PLACEMENT_ARGS=(--n-layer 12 --n-embd 1536 --n-head 12 --batch 4 --seq 1024 --steps 3 --try-timeout 40)
  # byte-level GPTs "n_layer n_embd n_head", smallest first: 1.2B, 2.5B, 4.1B, 6.4B, 8.1B, 9.7B, 12.6B
  LADDER=("24 2048 16" "32 2560 20" "36 3072 24" "32 4096 32" "40 4096 32" "48 4096 32" "40 5120 40")
  LARGE_SEQ=1024
  EXTRA=()
fi
if [[ -n ${GPU_CHECK_LADDER:-} ]]; then
  IFS=';' read -ra LADDER <<<"$GPU_CHECK_LADDER"
fi
# every system steps with torch's fused AdamW (on the host too: 6x the for-loop kernel, bench_cpu_adam.py)
COMMON=(--backend "$BACKEND" --world-size 1 --precisions bf16 --model gpt --peak-tflops 989 --adamw fused "${EXTRA[@]}")

# ---- largest, the sizing: from the host's MemAvailable and the GPU's free memory now. Fills CANDIDATES
# ("L D H n host_need host_avail dev_need dev_free", largest first) and writes a row for each rung that
# does not fit.
size_ladder() {
  local host_avail dev_free=0 i L D H verdict ok n hn ha dn df
  host_avail=$(awk '/MemAvailable/ {print $2 * 1024}' /proc/meminfo)
  if ((HAS_CUDA)); then
    dev_free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i 0 2>/dev/null | awk '{print $1 * 2^20}')
    [[ -n $dev_free ]] || dev_free=$(timeout 30 "$PY" -c 'import torch; print(torch.cuda.mem_get_info(0)[0])' 2>>"$LOG")
    [[ -n $dev_free ]] || dev_free=0
  fi
  # host: HOST_BPP bytes per parameter (fp32 master, gradient and Adam moments, pinned, rounded up), within
  # 85% of MemAvailable; device: 8 bytes per parameter (the fp32 module built there, then the bf16
  # shards) + 4 GiB, within 90% of the free memory (CPU: no device limit).
  CANDIDATES=()
  for ((i = ${#LADDER[@]} - 1; i >= 0; i--)); do
    read -r L D H <<<"${LADDER[$i]}"
    verdict=$(awk -v l="$L" -v d="$D" -v s="$LARGE_SEQ" -v bpp="$HOST_BPP" -v host="$host_avail" -v dev="$dev_free" -v cuda="$HAS_CUDA" 'BEGIN {
      n = l * (12 * d * d + 13 * d) + (256 + s) * d + 2 * d
      hn = bpp * n; dn = 8 * n + 4 * 2^30
      ok = (hn <= 0.85 * host) && (!cuda || dn <= 0.9 * dev)
      printf "%d %d %.1f %.1f %.1f %.1f\n", ok, n, hn / 2^30, host / 2^30, dn / 2^30, dev / 2^30 }')
    read -r ok n hn ha dn df <<<"$verdict"
    if ((ok)); then
      CANDIDATES+=("$L $D $H $n $hn $ha $dn $df")
    else
      row "{\"part\": \"largest\", \"kind\": \"rung\", \"n_layer\": $L, \"n_embd\": $D, \"n_params\": $n, \"host_need_gib\": $hn, \"host_available_gib\": $ha, \"device_need_gib\": $dn, \"device_free_gib\": $df, \"result\": \"not tried: does not fit\"}"
    fi
  done
}
rung_base() {  # the JSON fields of a rung row, from a CANDIDATES entry
  local L D H n hn ha dn df
  read -r L D H n hn ha dn df <<<"$1"
  echo "\"part\": \"largest\", \"kind\": \"rung\", \"n_layer\": $L, \"n_embd\": $D, \"n_params\": $n, \"host_need_gib\": $hn, \"host_available_gib\": $ha, \"device_need_gib\": $dn, \"device_free_gib\": $df"
}
largest_note() {
  row "{\"part\": \"largest\", \"kind\": \"note\", \"text\": \"largest byte-level GPT that trained with offload_optim_frac=1.0 (sequence $LARGE_SEQ, batch 1): $1\"}"
  table
  log "largest with full offload: $1"
}
# a bench_engine.py --parts entry: `engine_part NAME INNER_S SYSTEMS n_layer n_embd n_head vocab seq batch`
engine_part() {
  printf '{"part": "%s", "timeout": %s, "systems": "%s", "n_layer": %s, "n_embd": %s, "n_head": %s, "vocab": %s, "seq": %s, "batch": %s}' "$@"
}

want streams && run_part streams 70 "$PY" benchmarks/gpu_streams.py "${STREAMS_ARGS[@]}" --budget-s 60 \
  --jsonl "$JSONL" --part streams

if ((SMOKE)); then
  # The engine parts share one bench_engine.py run (--parts): its ranks are forks of one server that
  # imported torch once, instead of a fresh interpreter per part. Each part keeps its own limit inside
  # the run's and writes its rows and its part row as it ends; the run's process group is killed at
  # the outer limit. The GPU run below keeps one process group and one limit per part.
  want placement && run_part placement 90 "$PY" benchmarks/gpu_placement.py --part speed "${PLACEMENT_ARGS[@]}" \
    --budget-s 80 --jsonl "$JSONL" --part-name placement
  ENGINE_PARTS=()
  want gpt2-124M && ENGINE_PARTS+=("$(engine_part gpt2-124M 60 "$SYSTEMS_124M" "${SHAPE_124M[@]}")")
  want gpt2-355M && ENGINE_PARTS+=("$(engine_part gpt2-355M 60 "$SYSTEMS_355M" "${SHAPE_355M[@]}")")
  RUNG=
  if want largest; then
    size_ladder
    if ((${#CANDIDATES[@]})); then
      RUNG=${CANDIDATES[0]}
      read -r L D H _ <<<"$RUNG"
      ENGINE_PARTS+=("$(engine_part largest 60 zero:prefetch=1:offload_optim_frac=1.0 "$L" "$D" "$H" 256 "$LARGE_SEQ" 1)")
    fi
  fi
  if ((${#ENGINE_PARTS[@]})); then
    PARTS_JSON="[$(IFS=,; echo "${ENGINE_PARTS[*]}")]"
    INNER=$((60 * ${#ENGINE_PARTS[@]}))
    run_part engine-parts $((INNER + 15)) "$PY" benchmarks/bench_engine.py "${COMMON[@]}" "${REPS[@]}" \
      --timeout "$INNER" --jsonl "$JSONL" --parts "$PARTS_JSON"
  fi
  if want largest; then
    LARGEST=none
    if [[ -n $RUNG ]]; then
      read -r L D H n _ <<<"$RUNG"
      if grep -q '"part": "largest", "kind": "part", "status": "done"' "$JSONL"; then
        result=trains
        LARGEST="$L x $D ($n parameters)"
      else
        result="failed (see gpu_check.log)"
      fi
      row "{$(rung_base "$RUNG"), \"result\": \"$result\"}"
    fi
    largest_note "$LARGEST"
  fi
else
  want gpt2-124M && run_part gpt2-124M 90 "$PY" benchmarks/bench_engine.py "${COMMON[@]}" --systems "$SYSTEMS_124M" \
    "${SHAPE_124M[@]}" "${REPS[@]}" --timeout 80 --jsonl "$JSONL" --part gpt2-124M
  want placement && run_part placement 90 "$PY" benchmarks/gpu_placement.py --part speed "${PLACEMENT_ARGS[@]}" \
    --budget-s 80 --jsonl "$JSONL" --part-name placement
  want gpt2-355M && run_part gpt2-355M 90 "$PY" benchmarks/bench_engine.py "${COMMON[@]}" --systems "$SYSTEMS_355M" \
    "${SHAPE_355M[@]}" "${REPS[@]}" --timeout 80 --jsonl "$JSONL" --part gpt2-355M

  # ---- largest: down the ladder, each rung its own part (process group, inner limit below the outer)
  if want largest; then
    LADDER_S=120
    L_START=$(date +%s)
    size_ladder
    LARGEST=none
    for cand in "${CANDIDATES[@]}"; do
      read -r L D H n _ <<<"$cand"
      left=$((LADDER_S - ($(date +%s) - L_START)))
      if ((left < 25)); then
        row "{$(rung_base "$cand"), \"result\": \"not tried: the part's time is spent\"}"
        continue
      fi
      inner=$((left - 10))
      ((inner > 100)) && inner=100
      t0=$(date +%s)
      run_part largest $((inner + 8)) "$PY" benchmarks/bench_engine.py "${COMMON[@]}" \
        --systems zero:prefetch=1:offload_optim_frac=1.0 --n-layer "$L" --n-embd "$D" --n-head "$H" --vocab 256 \
        --seq "$LARGE_SEQ" --batch 1 --warmup 1 --repeats 1 --steps 1 --timeout "$inner" --jsonl "$JSONL" \
        --part largest
      rc=$?
      result=$( ((rc == 0)) && echo trains || echo "failed (exit $rc; see gpu_check.log)")
      row "{$(rung_base "$cand"), \"result\": \"$result\", \"seconds\": $(($(date +%s) - t0))}"
      if ((rc == 0)); then
        LARGEST="$L x $D ($n parameters)"
        break
      fi
    done
    largest_note "$LARGEST"
  fi
fi

# ---- plan: chunkzero plan's predicted peak against a 3-step chunkzero train's measured one (one row)
want plan && run_part plan 80 "$PY" benchmarks/gpu_plan.py "$JSONL" "$DEST" $( ((SMOKE)) && echo --smoke)

row "{\"part\": \"total\", \"kind\": \"part\", \"status\": \"finished\", \"seconds\": $(($(date +%s) - START)), \"rows\": $(wc -l <"$JSONL")}"
table
log "finished in $(($(date +%s) - START))s; results in $DEST"
