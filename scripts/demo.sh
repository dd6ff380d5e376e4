#!/usr/bin/env bash
# The README's main command: setup, build, then the main job on 4 CPU ranks under
# torchrun. Until the trainer lands, that is the communication demo: the TP x PP rank
# layout and a tensor-parallel all-reduce through f/g, with its byte count.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$MT_ROOT/scripts/setup.sh"
"$MT_ROOT/scripts/build.sh"
export OMP_NUM_THREADS=1
mt_log "torchrun --nproc-per-node=4 build/bin/comm_demo --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"
"$(mt_python)" -m torch.distributed.run --standalone --nproc-per-node=4 --no-python "$MT_BUILD/bin/comm_demo" \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "$@"
