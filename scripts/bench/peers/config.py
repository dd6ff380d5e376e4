"""The one GPT configuration every system in the CPU side-by-side benchmark trains.

Everything that must be equal across systems lives here: the model shape, the data, the
seed, the global batch, the optimizer and the learning-rate schedule. `gpt_pretrain_flags`
turns it into megatorch's (Megatron-LM's) flags; the Python peers read the same object.
"""
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class BenchConfig:
    # Model: GPT-2 style, as gpt_pretrain builds it (csrc/models/gpt_model.cpp): learned
    # absolute positions, pre-LayerNorm, GeLU(tanh) MLP of 4h, biases, tied embeddings,
    # final LayerNorm, no dropout, every weight N(0, 0.02), biases 0, norms 1.
    num_layers: int = 8  # 8, so that PP4 interleaved has v = 2 chunks of one layer
    hidden_size: int = 128
    num_attention_heads: int = 4
    seq_length: int = 128
    vocab_size: int = 257  # byte-level tokens + end of document
    # Batches: the same global batch for every layout; DP ranks and micro-batches split it.
    micro_batch_size: int = 1
    global_batch_size: int = 16
    warmup_steps: int = 3  # run, not timed
    timed_steps: int = 10  # per run; the suite runs each system in two rounds
    # Optimizer: AdamW (decoupled weight decay on matrices and embeddings only, as
    # Megatron), global-norm clipping, cosine decay without warm-up.
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    seed: int = 1234
    data_path: str = str(ROOT / "data" / "default" / "stdlib_docs_text_document")
    split: str = "969,30,1"
    init_std: float = 0.02
    norm_eps: float = 1e-5

    @property
    def train_iters(self) -> int:
        return self.warmup_steps + self.timed_steps

    @property
    def ffn_hidden_size(self) -> int:
        return 4 * self.hidden_size

    def with_(self, **changes) -> "BenchConfig":
        return dataclasses.replace(self, **changes)

    def lr_at(self, iteration: int) -> float:
        """megatorch's LRSchedule::at (csrc/train/lr_schedule.cpp) for the step after
        `iteration` completed steps: cosine from lr to min_lr over train_iters."""
        ratio = min(max(iteration / max(1, self.train_iters), 0.0), 1.0)
        return self.min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (self.lr - self.min_lr)

    def parameter_count(self) -> int:
        h, L, f = self.hidden_size, self.num_layers, self.ffn_hidden_size
        per_layer = 3 * h * h + 3 * h + h * h + h + h * f + f + f * h + h + 4 * h
        return L * per_layer + self.vocab_size * h + self.seq_length * h + 2 * h

    def gpt_pretrain_flags(self) -> list:
        """Everything above as gpt_pretrain flags (the parallel layout is added per run)."""
        return [
            "--num-layers", self.num_layers, "--hidden-size", self.hidden_size,
            "--num-attention-heads", self.num_attention_heads, "--seq-length", self.seq_length,
            "--vocab-size", self.vocab_size,
            "--micro-batch-size", self.micro_batch_size, "--global-batch-size", self.global_batch_size,
            "--train-iters", self.train_iters,
            "--lr", self.lr, "--min-lr", self.min_lr, "--lr-warmup-iters", 0, "--lr-decay-style", "cosine",
            "--weight-decay", self.weight_decay, "--adam-beta1", self.adam_beta1, "--adam-beta2", self.adam_beta2,
            "--adam-eps", self.adam_eps, "--clip-grad", self.clip_grad,
            "--seed", self.seed, "--data-path", self.data_path, "--split", self.split,
            "--eval-iters", 0, "--log-interval", 1000,
        ]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "BenchConfig":
        return BenchConfig(**json.loads(text))


@dataclass(frozen=True)
class Layout:
    """A parallel layout of 1-4 ranks: tp x pp x dp (Megatron's order: tp fastest)."""
    tp: int = 1
    pp: int = 1
    dp: int = 1
    sequence_parallel: bool = False
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved
    virtual_chunks: int = 1  # layer chunks per pipeline rank (interleaved)
    zero_stage: int = 0

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def micro_batches(self, cfg: BenchConfig) -> int:
        """Micro-batches per DP rank and step."""
        return cfg.global_batch_size // (cfg.micro_batch_size * self.dp)

    def gpt_pretrain_flags(self, cfg: BenchConfig) -> list:
        flags = ["--tensor-model-parallel-size", self.tp, "--pipeline-model-parallel-size", self.pp,
                 "--zero-stage", self.zero_stage]
        if self.sequence_parallel:
            flags.append("--sequence-parallel")
        if self.pp > 1:
            flags += ["--schedule", self.schedule]
        if self.virtual_chunks > 1:
            flags += ["--num-layers-per-virtual-pipeline-stage", cfg.num_layers // (self.pp * self.virtual_chunks)]
        return flags

    def describe(self) -> str:
        parts = [f"{n}{k}" for n, k in (("TP", self.tp), ("PP", self.pp), ("DP", self.dp)) if k > 1] or ["1 rank"]
        s = "×".join(parts)
        if self.sequence_parallel:
            s += " SP"
        if self.pp > 1:
            s += f" {self.schedule}" + (f" v={self.virtual_chunks}" if self.virtual_chunks > 1 else "")
        return s


def to_args(flags) -> list:
    return [str(f) for f in flags]
