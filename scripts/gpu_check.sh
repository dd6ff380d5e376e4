#!/usr/bin/env bash
# One command for a GPU machine: build against MEGATORCH_PYTHON's torch with every core
# into build-gpu/, run the GPU tests, run the GPU benchmarks, and write JSON results into
# the folder given as the first argument, else $OUT, else build-gpu/results/:
#
#   MEGATORCH_PYTHON=python3 scripts/gpu_check.sh [OUT_DIR]
#
# Writes gpu_check.json (machine, torch, each step's status and seconds), gpu_tests.json
# (pytest counts and the skip reasons), pretrain.json + pretrain.md (scripts/bench/
# gpu_pretrain.py: gpt_pretrain on one GPU against the CPU, TP2 x PP2 as 4 processes sharing
# the GPU through Gloo against the CPU, the steady-state step under --sync-debug-iters, GPT
# 1.3B bf16 tokens/s, TFLOP/s and MFU from the trainer's own log, next to the eager and
# torch.compile rows of gpt.json, the same with --fp8-format (delayed and tensorwise) and
# 50 iterations of FP8 losses next to bf16's, and GPT 350M at micro-batch 1 with and without
# --cuda-graph: host vs wall time per step), gpt.json +
# gpt.md (scripts/bench/gpu_gpt.py, GPT 1.3B and Llama ~1B in one run: megatorch's model
# from Python against eager PyTorch, torch.compile, torchtitan, Megatron-Core and torchao's
# float8 training ($MEGATORCH_TORCHAO_PATH); the sync
# check, the goal against pretrain.json) with profile_megatorch_1.3B.json.gz and
# profile_eager_1.3B.json.gz (Chrome traces), packed_documents/results.json
# (scripts/bench/packed_documents.py at the 1.3B shape in bf16: document masks against full
# causal attention), kernels.json (scripts/bench/gpu_kernels.py) and gpu_check.log. Meant to finish in under 8 minutes (MEGATORCH_GPU_CHECK_LIMIT_S,
# default 480): the pretrain step gets MEGATORCH_PRETRAIN_S (default 200; its checks run in
# priority order and what no longer fits is skipped with the reason), the GPT benchmark
# what is left less 60 s (at least 90 s; MEGATORCH_GPT_BENCH_S sets it), the kernel
# benchmark the rest. The build runs on the GPU machine (the three targets, every core):
# the Python extension must match that machine's Python, which this one may not have.
#
# Steps run in order, each a function `step_<name>` listed in STEPS; a step that fails is
# recorded and the next one still runs; the exit status is non-zero if any failed. Another
# benchmark appends itself: write step_<name> (writing $RESULTS/<name>.json) and add it
# to STEPS.
#
# Without a GPU (no CUDA device visible to that torch) it says so, still builds and runs
# what does not need one (the kernel tests' CPU half; the GPU tests skip with their
# reason; the GPT benchmark's CPU fallback at toy sizes), writes gpu_check.json with
# "gpu": false, and exits 0.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
START=$(date +%s)
LIMIT_S=${MEGATORCH_GPU_CHECK_LIMIT_S:-480}
PRETRAIN_S=${MEGATORCH_PRETRAIN_S:-200}
export MEGATORCH_BUILD_DIR="${MEGATORCH_BUILD_DIR:-$MT_ROOT/build-gpu}"
export MEGATORCH_JOBS="${MEGATORCH_JOBS:-$(nproc)}"
RESULTS="${1:-${OUT:-$MEGATORCH_BUILD_DIR/results}}"
mkdir -p "$RESULTS"
RESULTS="$(cd "$RESULTS" && pwd)"
PY="$(mt_python)"
LOG="$RESULTS/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1 PYTHONPATH="$MT_ROOT/torch_ext${PYTHONPATH:+:$PYTHONPATH}"
export MEGATORCH_LIBRARY="$MEGATORCH_BUILD_DIR/lib/libmegatorch.so" MEGATORCH_BIN_DIR="$MEGATORCH_BUILD_DIR/bin"

STEPS=(env build gpu_tests pretrain gpt_bench report packed_bench kernel_bench)
GPU=false
elapsed() { echo $(( $(date +%s) - START )); }

# ---- steps

step_env() {
  "$PY" - "$RESULTS/env.json" <<'EOF'
import json, os, platform, sys
import torch
info = {"python": sys.executable, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "gpu": torch.cuda.is_available(), "host": platform.node(), "cpus": os.cpu_count()}
if info["gpu"]:
    p = torch.cuda.get_device_properties(0)
    info.update(gpu_name=p.name, gpu_count=torch.cuda.device_count(), sm=f"{p.major}.{p.minor}",
                gpu_memory_gib=round(p.total_memory / 2 ** 30, 1))
json.dump(info, open(sys.argv[1], "w"), indent=2)
print(json.dumps(info))
EOF
  GPU=$("$PY" -c 'import json,sys; print("true" if json.load(open(sys.argv[1]))["gpu"] else "false")' "$RESULTS/env.json")
  if [[ $GPU != true ]]; then
    mt_log "NO GPU: torch in $PY sees no CUDA device. Building and running the CPU-side checks only;"
    mt_log "the GPU tests will skip with their reason and kernels.json will say no GPU. Exit status 0."
  fi
}

step_build() {
  # ProcessGroupGloo.hpp needs gloo's headers (Debian libgloo-dev; the torch wheel lacks
  # them). A machine without them (and offline) can be given a copy of /usr/include/gloo
  # in MEGATORCH_GLOO_INCLUDE/gloo or .gloo-include/gloo at the repository root.
  local dir found=""
  for dir in "${MEGATORCH_GLOO_INCLUDE:-}" "$MT_ROOT/.gloo-include" /usr/include /usr/local/include; do
    if [[ -n "$dir" && -f "$dir/gloo/algorithm.h" ]]; then found="$dir"; break; fi
  done
  if [[ -z "$found" ]]; then
    mt_log "gloo headers not found: install libgloo-dev, or copy /usr/include/gloo from a machine that has it into"
    mt_log "$MT_ROOT/.gloo-include/gloo (or \$MEGATORCH_GLOO_INCLUDE/gloo)"
    return 1
  fi
  [[ $found == /usr/include ]] || export CPLUS_INCLUDE_PATH="$found${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
  # The compiler: MEGATORCH_CXX, else the system's g++, not the image's default CXX. The H200
  # image's /opt/gcc/bin/g++ instantiates libstdc++'s extern templates (std::ostream::
  # _M_insert<long>, ...) into the library itself; inside a Python process those copies
  # crash formatting an integer, so every error message with a number segfaulted instead
  # of raising RuntimeError. The system g++ leaves them to the libstdc++ that is loaded.
  local cxx="${MEGATORCH_CXX:-}"
  [[ -z "$cxx" && -x /usr/bin/g++ ]] && cxx=/usr/bin/g++
  if [[ -n "$cxx" ]]; then
    export CXX="$cxx" CUDAHOSTCXX="$cxx"
    mt_log "C++ compiler: $cxx"
  fi
  # The library and its Python extension (megatorch.cpp, for the GPT benchmark) are all the
  # GPU tests and benchmarks load (no Catch2 or examples needed).
  local configure=()
  [[ -f "$MEGATORCH_BUILD_DIR/build.ninja" ]] || configure=(-DMEGATORCH_BUILD_TESTS=OFF -DMEGATORCH_BUILD_EXAMPLES=OFF)
  MEGATORCH_TARGETS="megatorch megatorch_cpp gpt_pretrain" "$MT_ROOT/scripts/build.sh" "${configure[@]}"
}

step_gpu_tests() {
  local status=0
  (cd "$MT_ROOT" && "$PY" -m pytest -q -rs -p no:cacheprovider --junitxml="$RESULTS/gpu_tests.xml" \
     tests/python/unit/test_kernels.py tests/python/unit/test_kernels_adamw.py tests/python/unit/test_moe_model.py \
     tests/python/unit/test_cuda_graph.py) || status=$?
  "$PY" - "$RESULTS/gpu_tests.xml" "$RESULTS/gpu_tests.json" <<'EOF' || true
import json, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = suite.findall("testcase")
def outcome(c):
    for kind in ("failure", "error", "skipped"):
        if c.find(kind) is not None:
            return kind
    return "passed"
out = {k: sum(outcome(c) == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
out["skip_reasons"] = sorted({c.find("skipped").get("message", "") for c in cases if outcome(c) == "skipped"})
out["gpu_cases_run"] = [c.get("name") for c in cases if "cuda" in c.get("name", "") and outcome(c) == "passed"]
json.dump(out, open(sys.argv[2], "w"), indent=2)
print("gpu tests:", json.dumps(out))
EOF
  return $status
}

step_pretrain() {
  # gpt_pretrain itself: GPU vs CPU losses (fp32), 4 ranks sharing the GPU (TP2 x PP2) vs
  # CPU, GPT 1.3B bf16 throughput from the trainer's log. Without a GPU: CPU vs CPU only.
  "$PY" "$MT_ROOT/scripts/bench/gpu_pretrain.py" --bin "$MEGATORCH_BUILD_DIR/bin" \
    --out "$RESULTS/pretrain.json" --budget-s "$PRETRAIN_S"
}

step_gpt_bench() {
  # GPT 1.3B and a Llama ~1B (GQA 4:1, SwiGLU, RoPE, untied output; gpu_gpt.py's llama-1B) at
  # sequence 2048, bf16, in one run: megatorch's model driven from Python, eager PyTorch,
  # torch.compile, torchtitan's Llama and Megatron-Core (local layers) where importable; tokens/s,
  # TFLOP/s, MFU, peak memory, first-step loss, the sync check, the profile of the 1.3B megatorch
  # and eager rows (Chrome traces in $RESULTS) and the goal (gpt_pretrain's row from pretrain.json).
  # Rows in priority order: the megatorch and eager rows of both models first; what does not fit
  # in the budget is skipped with the reason (the standalone run, --budget-s 420, has them all).
  # Without a GPU: its CPU fallback at toy sizes (says so; not GPU numbers).
  local left=$(( LIMIT_S - $(elapsed) - 60 ))
  (( left < 90 )) && left=90
  [[ -n ${MEGATORCH_GPT_BENCH_S:-} ]] && left=$MEGATORCH_GPT_BENCH_S
  "$PY" "$MT_ROOT/scripts/bench/gpu_gpt.py" --out "$RESULTS/gpt.json" --budget-s "$left" --arch gpt,llama \
    --pretrain-json "$RESULTS/pretrain.json"
}

step_report() {
  # pretrain.md with the eager and torch.compile rows of the same run beside gpt_pretrain's.
  "$PY" "$MT_ROOT/scripts/bench/gpu_pretrain.py" --render --out "$RESULTS/pretrain.json" --gpt-json "$RESULTS/gpt.json"
}

step_packed_bench() {
  # Packed documents at the 1.3B GPT's shape (docs/data.md): full causal vs document masks.
  [[ $GPU == true ]] || { echo "no GPU: the CPU numbers are docs/data.md's"; return 0; }
  "$PY" "$MT_ROOT/scripts/bench/packed_documents.py" --device cuda --dtype bfloat16 --seq-length 4096 \
    --mean-document-length 512 --hidden-size 2048 --num-layers 24 --num-attention-heads 16 --reps 3 \
    --out "$RESULTS/packed_documents"
}

step_kernel_bench() {
  # torch.compile budget: what is left, less a margin
  local left=$(( LIMIT_S - $(elapsed) - 20 ))
  (( left < 0 )) && left=0
  "$PY" "$MT_ROOT/scripts/bench/gpu_kernels.py" --out "$RESULTS/kernels.json" --budget-s "$left"
}

# ---- run them

declare -A STATUS SECONDS_TAKEN
overall=0
for step in "${STEPS[@]}"; do
  t0=$(date +%s)
  mt_log "step $step (at $(elapsed) s)"
  set +e
  ( set -o pipefail; "step_$step" 2>&1 | tee -a "$LOG" )
  rc=$?
  set -e
  # step_env sets GPU in this shell: re-read it after the subshell.
  [[ $step == env && -f "$RESULTS/env.json" ]] &&
    GPU=$("$PY" -c 'import json,sys; print("true" if json.load(open(sys.argv[1]))["gpu"] else "false")' "$RESULTS/env.json")
  STATUS[$step]=$rc
  SECONDS_TAKEN[$step]=$(( $(date +%s) - t0 ))
  if (( rc != 0 )); then
    mt_log "step $step FAILED (exit $rc); see $LOG"
    overall=1
  fi
  [[ $step == build && $rc != 0 ]] && { mt_log "no library: skipping the remaining steps"; break; }
done

steps_json=""
for step in "${STEPS[@]}"; do
  [[ -z "${STATUS[$step]+x}" ]] && continue
  steps_json+="${steps_json:+, }\"$step\": {\"exit\": ${STATUS[$step]}, \"seconds\": ${SECONDS_TAKEN[$step]}}"
done
total=$(elapsed)
cat >"$RESULTS/gpu_check.json" <<EOF
{"gpu": $GPU, "seconds": $total, "limit_seconds": $LIMIT_S, "ok": $([[ $overall == 0 ]] && echo true || echo false),
 "build_dir": "$MEGATORCH_BUILD_DIR", "python": "$PY",
 "steps": {$steps_json}}
EOF
mt_log "results in $RESULTS: $(cd "$RESULTS" && ls | tr '\n' ' ')"
(( total > LIMIT_S )) && mt_log "took $total s, over the $LIMIT_S s target"
if [[ $GPU != true ]]; then
  mt_log "NO GPU on this machine: built and ran the CPU-side checks; no GPU numbers (gpu_check.json: \"gpu\": false)."
  exit $overall
fi
mt_log "done in $total s"
exit $overall
