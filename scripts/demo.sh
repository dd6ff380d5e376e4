#!/usr/bin/env bash
# The README's main command: setup, build, then GPT pretraining on the bundled data with
# TP=2 x PP=2 on 4 CPU ranks under torchrun (a few minutes on 2 cores), then a few lines
# generated from the trained checkpoint at the same layout. Writes the JSON log, the loss
# plot, one iteration's pipeline timeline and the generations under runs/demo/ (or
# $MEGATORCH_DEMO_DIR). Extra arguments go to gpt_pretrain (CLI11: a flag given twice is
# an error, so override only flags not listed below).
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
"$MT_ROOT/scripts/setup.sh"
"$MT_ROOT/scripts/build.sh"
out="${MEGATORCH_DEMO_DIR:-$MT_ROOT/runs/demo}"
mkdir -p "$out"
rm -f "$out/log.json"
export OMP_NUM_THREADS=1
# ~3.3M parameters: 4 layers, hidden 256; global batch 16 sequences of 128 bytes, as
# micro-batches of 2 through a 1F1B pipeline (8 per step).
flags=(
  # CPU ranks wherever it runs (MEGATORCH_DEMO_DEVICE=cuda on a machine with 4 GPUs).
  --device "${MEGATORCH_DEMO_DEVICE:-cpu}"
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --schedule 1f1b
  --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 128
  --micro-batch-size 2 --global-batch-size 16 --train-iters "${MEGATORCH_DEMO_ITERS:-150}"
  --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 10 --lr-decay-style cosine --weight-decay 0.1
  --clip-grad 1.0 --seed 1234 --data-path "$MT_ROOT/data/default/stdlib_docs_text_document"
  --split 969,30,1 --eval-interval 50 --eval-iters 4 --log-interval 10
  --log-json "$out/log.json" --timeline "$out/timeline.svg" --save "$out/checkpoint"
)
mt_log "torchrun --nproc-per-node=4 build/bin/gpt_pretrain ${flags[*]} $*"
start=$(date +%s)
"$(mt_python)" -m torch.distributed.run --standalone --nproc-per-node=4 --no-python "$MT_BUILD/bin/gpt_pretrain" \
  "${flags[@]}" "$@"
"$(mt_python)" "$MT_ROOT/scripts/plot_log.py" "$out/log.json" "$out/loss.png"
mt_log "trained in $(( $(date +%s) - start )) s"
# Text from the checkpoint just saved (ByteLevel: the bytes the model was trained on),
# sampled with a fixed seed: the same lines at any TP x PP layout.
gen=(--load "$out/checkpoint" --device "${MEGATORCH_DEMO_DEVICE:-cpu}"
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  --prompt "The list type" --prompt "def read(" --prompt "Return a new"
  --max-new-tokens 48 --temperature 0.7 --top-k 40 --seed 1234 --output-json "$out/generated.jsonl")
mt_log "torchrun --nproc-per-node=4 build/bin/megatorch-generate ${gen[*]}"
"$(mt_python)" -m torch.distributed.run --standalone --nproc-per-node=4 --no-python "$MT_BUILD/bin/megatorch-generate" \
  "${gen[@]}"
mt_log "JSON log:          $out/log.json"
mt_log "loss plot:         $out/loss.png"
mt_log "pipeline timeline: $out/timeline.svg"
mt_log "checkpoint:        $out/checkpoint (resume with --load; megatorch-hf export for HuggingFace)"
mt_log "generations:       $out/generated.jsonl (megatorch-generate; docs/inference.md)"
