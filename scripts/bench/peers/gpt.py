"""The benchmark's GPT in plain PyTorch (eager), the model every Python peer trains.

Same architecture and parameter names as megatorch's GPTModel (csrc/models/gpt_model.cpp),
so megatorch's initial weights load into it by name:

    embedding.word.weight [V, h]        token embedding, tied with the output head
    embedding.position.weight [s, h]    learned absolute positions
    layers.<i>.input_norm                LayerNorm
    layers.<i>.attention.qkv             one Linear h -> 3h, rows head by head [q_j; k_j; v_j]
    layers.<i>.attention.proj            Linear h -> h
    layers.<i>.post_attention_norm       LayerNorm
    layers.<i>.mlp.fc1 / fc2             Linear h -> 4h, GeLU(tanh), Linear 4h -> h
    final_norm                           LayerNorm

Activations are [batch, seq, hidden] (PyTorch's convention; megatorch keeps [s, b, h]).
The QKV rows are grouped per head, Megatron's layout, so that any contiguous slice of
rows - a tensor-parallel shard - holds whole heads: the attention below therefore works
unchanged on a column shard (it infers the local head count from the shard's width).

One class covers the whole model and every pipeline stage: `layers` is a range of the
model's layers, `pre_process` adds the embedding, `post_process` the final norm and the
head. A last stage without the embedding holds its own copy of the tied weight
(`output_weight`), as Megatron does; the pipeline peer keeps the two copies equal by
summing their gradients.
"""
import torch
import torch.nn.functional as F
from torch import nn

from config import BenchConfig


class Positions(nn.Module):
    """Adds learned absolute position embeddings. A module of its own so that tensor
    parallelism can treat it as a sequence-parallel region (each rank adds the rows of
    its own tokens when the sequence is split)."""

    def __init__(self, max_positions: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_positions, hidden))

    def forward(self, x):
        return x + self.weight[: x.shape[1]]


class Embedding(nn.Module):
    def __init__(self, cfg: BenchConfig):
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = Positions(cfg.seq_length, cfg.hidden_size)

    def forward(self, ids):
        return self.position(self.word(ids))


class Attention(nn.Module):
    def __init__(self, cfg: BenchConfig):
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = h // cfg.num_attention_heads
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)

    def forward(self, x):
        b, s, _ = x.shape
        # [b, s, heads, 3, d]: "heads" is the local count when qkv is a column shard.
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4).unbind(0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, heads, s, d]
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, cfg: BenchConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.fc2 = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TransformerLayer(nn.Module):
    def __init__(self, cfg: BenchConfig):
        super().__init__()
        self.input_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.post_attention_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attention(self.input_norm(x))
        return x + self.mlp(self.post_attention_norm(x))


class OutputHead(nn.Module):
    """logits = h @ W^T with W passed in (the tied embedding or the stage's copy). A module
    so that tensor parallelism can lay out its input (replicated, or gathered from the
    sequence shards) before the vocabulary-sharded matmul."""

    def forward(self, h, weight):
        return F.linear(h, weight)


class GPT(nn.Module):
    def __init__(self, cfg: BenchConfig, layers=None, pre_process=True, post_process=True):
        super().__init__()
        layers = range(cfg.num_layers) if layers is None else layers
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = Embedding(cfg) if pre_process else None
        # Keyed by the global layer number, so names match the whole model's on every stage.
        self.layers = nn.ModuleDict({str(i): TransformerLayer(cfg) for i in layers})
        if post_process:
            self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
            self.head = OutputHead()
            if not pre_process:
                self.output_weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))

    def tied_weight(self):
        """The weight the head multiplies by (on a stage that has one)."""
        return self.embedding.word.weight if self.pre_process else self.output_weight

    def forward(self, x):
        if self.pre_process:
            x = self.embedding(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.post_process:
            x = self.head(self.final_norm(x), self.tied_weight())
        return x


def lm_loss(logits, labels):
    """Mean next-token cross entropy over the micro-batch (megatorch's per-micro-batch loss)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
