#!/usr/bin/env bash
# CPU side-by-side benchmark: megatorch's gpt_pretrain next to PyTorch-native parallelism
# (DTensor TP/SP, torch.distributed.pipelining, DDP, ZeroRedundancyOptimizer, FSDP2) and
# DeepSpeed ZeRO 1-3, on 4 Gloo ranks with one intra-op thread each; the same GPT, data,
# seed, initial weights and global batch for everyone. Then megatorch at one rank against
# a plain LibTorch and a plain PyTorch model, growth with hidden size and depth, and the
# measured pipeline bubble. Results: OUT/results.json and OUT/report.md (docs/benchmarks.md
# describes them).
#
#   scripts/bench/cpu_peers.sh [OUT]                      # default OUT: runs/cpu_peers
#   scripts/bench/cpu_peers.sh OUT --parts main --only TP2  # a part of it (suite.py --help)
#
# Needs the build (scripts/build.sh); installs requirements-bench.txt (DeepSpeed) into the
# venv. About 16 minutes on an idle 2-core machine (it waits while the machine is busy).
# A second run into the same OUT replaces the records it makes and keeps the others, so
# one part can be redone after a disturbance.
source "$(dirname "${BASH_SOURCE[0]}")/../common.sh"

OUT="${1:-$MT_ROOT/runs/cpu_peers}"
shift $(( $# > 0 ? 1 : 0 ))
PY="$(mt_python)"

[[ -x "$MT_BUILD/bin/gpt_pretrain" ]] || { mt_log "no $MT_BUILD/bin/gpt_pretrain: run scripts/build.sh first"; exit 1; }
if ! "$PY" -c 'import deepspeed' >/dev/null 2>&1; then
  mt_log "installing requirements-bench.txt (DeepSpeed) into $($PY -c 'import sys; print(sys.prefix)')"
  # DeepSpeed missing from the index or failing to install is a result, not a stop: its rows say so.
  "$PY" -m pip install -q -r "$MT_ROOT/requirements-bench.txt" || mt_log "DeepSpeed did not install; its rows will fail"
fi

mkdir -p "$OUT"
export PYTHONPATH="$MT_ROOT/torch_ext${PYTHONPATH:+:$PYTHONPATH}"
# The C++ library and its Python extension come from this build.
export MEGATORCH_LIBRARY="${MEGATORCH_LIBRARY:-$MT_BUILD/lib/libmegatorch.so}"
"$PY" "$MT_ROOT/scripts/bench/peers/suite.py" --out "$OUT" "$@"
"$PY" "$MT_ROOT/scripts/bench/peers/report.py" "$OUT/results.json" > "$OUT/report.md"
cat "$OUT/report.md"
mt_log "results: $OUT/results.json, tables: $OUT/report.md"
