"""The peers of scripts/bench/gpu_gpt.py: a plain PyTorch GPT with megatorch's architecture,
and the mixed-precision AdamW every peer trains with.

``ReferenceGPT`` is what a PyTorch user writes (nanoGPT's shape, batch-first [b, s, h]):
``nn.Linear``, ``F.layer_norm`` / ``F.rms_norm``, ``F.gelu(approximate="tanh")`` or SwiGLU,
RoPE in plain ops, attention through ``F.scaled_dot_product_attention`` (flash on GPUs),
cross entropy in fp32. Its parameters carry megatorch's names and layouts (the fused QKV
weight laid out group by group, [q heads of the group, k, v], so GQA is the same;
``output_layer`` when the embeddings are untied; the padded vocabulary), so
``load_state_dict(megatorch_model.state_dict())`` gives the same model and the same loss —
which ``same_loss_as`` checks, proving the two are the same architecture and the same FLOPs.

``shared_init_`` gives every implementation of the benchmark the same initial weights
without copying a model: each parameter, named as megatorch names it, is drawn from its
own generator seeded by the name (norm weights 1, biases 0, matrices N(0, init_std)).
Megatron-Core's and torchtitan's builders map their names (and torchtitan's split QKV and
interleaved RoPE) onto these, so every row of a size starts from the same first-step loss.

``MasterAdamW`` is how the peers get megatorch's precision recipe (bf16 parameters,
gradients and activations; fp32 master weights and AdamW states): torch's fused AdamW
over fp32 copies, the bf16 gradients copied in and the bf16 parameters copied out, each
with one multi-tensor call.
"""
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTShape:
    """The architecture, in megatorch.cpp.TransformerConfig's field names."""
    hidden_size: int
    num_attention_heads: int
    num_layers: int
    seq_length: int
    vocab_size: int                      # already a multiple of 128: no padding anywhere
    num_query_groups: int = 0            # 0: MHA
    ffn_hidden_size: int = 0             # 0: 4h (GeLU) or 8h/3 rounded up to 64 (SwiGLU), as megatorch
    arch: str = "gpt"                    # "gpt": LayerNorm, GeLU(tanh), learned positions, biases;
                                         # "llama": RMSNorm, SwiGLU, RoPE, no biases
    tie_embeddings: bool = True          # False: a separate output layer [V, h] ("output_layer")
    norm_epsilon: float = 1e-5
    init_std: float = 0.02

    @property
    def llama(self) -> bool:
        return self.arch == "llama"

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return (8 * self.hidden_size // 3 + 63) // 64 * 64 if self.llama else 4 * self.hidden_size

    def megatorch_fields(self) -> dict:
        """Keyword arguments of megatorch.cpp.TransformerConfig for this architecture."""
        out = dict(hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
                   num_query_groups=self.num_query_groups, ffn_hidden_size=self.ffn, num_layers=self.num_layers,
                   seq_length=self.seq_length, vocab_size=self.vocab_size, norm_epsilon=self.norm_epsilon,
                   init_std=self.init_std, attention_dropout=0.0, hidden_dropout=0.0,
                   tie_embeddings=self.tie_embeddings)
        if self.llama:
            out.update(normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                       add_bias_linear=False)
        else:
            out.update(normalization="LayerNorm", activation="gelu_tanh", position_embedding_type="learned_absolute",
                       add_bias_linear=True)
        return out

    def num_parameters(self) -> int:
        """Every parameter once (a tied embedding once, an untied output layer counted): what PaLM's 6N
        counts."""
        h, L, V, s, f = self.hidden_size, self.num_layers, self.vocab_size, self.seq_length, self.ffn
        d, a, g = self.head_dim, self.num_attention_heads, self.groups
        bias = not self.llama
        qkv = h * (a + 2 * g) * d + (bias and (a + 2 * g) * d)
        proj = a * d * h + (bias and h)
        fc1 = h * f * (2 if self.llama else 1) + (bias and f * (2 if self.llama else 1))
        fc2 = f * h + (bias and h)
        norm = h * (1 if self.llama else 2)
        layer = qkv + proj + fc1 + fc2 + 2 * norm
        positions = 0 if self.llama else s * h
        output = 0 if self.tie_embeddings else V * h
        return L * layer + V * h + output + positions + norm

    def canonical_sizes(self) -> dict:
        """megatorch's parameter names and sizes for this shape (the names shared_init_ draws by)."""
        h, V, s, f = self.hidden_size, self.vocab_size, self.seq_length, self.ffn
        d, a, g = self.head_dim, self.num_attention_heads, self.groups
        glu, bias = self.llama, not self.llama
        out = {}
        if not self.llama:
            out["position_embedding"] = (s, h)
        out["embedding.weight"] = (V, h)
        if not self.tie_embeddings:
            out["output_layer"] = (V, h)
        for i in range(self.num_layers):
            p = f"layers.{i}."
            layer = {"input_norm.weight": (h,), "attention.qkv.weight": ((a + 2 * g) * d, h),
                     "attention.proj.weight": (h, a * d), "post_attention_norm.weight": (h,),
                     "mlp.fc1.weight": (f * (2 if glu else 1), h), "mlp.fc2.weight": (h, f)}
            if bias:
                layer.update({"input_norm.bias": (h,), "attention.qkv.bias": ((a + 2 * g) * d,),
                              "attention.proj.bias": (h,), "post_attention_norm.bias": (h,),
                              "mlp.fc1.bias": (f,), "mlp.fc2.bias": (h,)})
            out.update({p + k: v for k, v in layer.items()})
        out["final_norm.weight"] = (h,)
        if bias:
            out["final_norm.bias"] = (h,)
        return out

    def flops_per_token(self) -> float:
        """PaLM appendix B, as megatorch's trainer counts it (csrc/train/trainer.cpp): 6N + 12·L·h·s,
        the attention term in full (not halved for the causal mask)."""
        return 6.0 * self.num_parameters() + 12.0 * self.num_layers * self.hidden_size * self.seq_length


def rope_tables(s: int, d: int, base: float, device) -> tuple:
    """cos and sin [s, 1, d] for rotate-half RoPE, as megatorch's rope_frequencies."""
    inv = 1.0 / torch.pow(base, torch.arange(0, d, 2, dtype=torch.float64, device=device) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float64, device=device), inv)
    angles = torch.cat([angles, angles], -1).float()
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x, cos, sin):  # x [b, s, heads, d]
    x1, x2 = x.chunk(2, -1)
    rotated = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class Norm(nn.Module):
    def __init__(self, shape: GPTShape, **kw):
        super().__init__()
        self.rms, self.eps = shape.llama, shape.norm_epsilon
        self.weight = nn.Parameter(torch.ones(shape.hidden_size, **kw))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(shape.hidden_size, **kw))

    def forward(self, x):
        if self.rms:
            return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)
        return F.layer_norm(x, (x.size(-1),), self.weight, self.bias, self.eps)


class Attention(nn.Module):
    def __init__(self, shape: GPTShape, **kw):
        super().__init__()
        self.shape = shape
        a, g, d = shape.num_attention_heads, shape.groups, shape.head_dim
        self.qkv = nn.Linear(shape.hidden_size, (a + 2 * g) * d, bias=not shape.llama, **kw)
        self.proj = nn.Linear(a * d, shape.hidden_size, bias=not shape.llama, **kw)

    def forward(self, x, rope=None):
        b, s, _ = x.shape
        a, g, d = self.shape.num_attention_heads, self.shape.groups, self.shape.head_dim
        per = a // g
        qkv = self.qkv(x).view(b, s, g, per + 2, d)  # group by group: [q heads of the group, k, v]
        q = qkv[:, :, :, :per].reshape(b, s, a, d)
        k, v = qkv[:, :, :, per], qkv[:, :, :, per + 1]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           enable_gqa=g != a)
        return self.proj(y.transpose(1, 2).reshape(b, s, a * d))


class MLP(nn.Module):
    def __init__(self, shape: GPTShape, **kw):
        super().__init__()
        self.glu = shape.llama
        self.fc1 = nn.Linear(shape.hidden_size, shape.ffn * (2 if self.glu else 1), bias=not self.glu, **kw)
        self.fc2 = nn.Linear(shape.ffn, shape.hidden_size, bias=not self.glu, **kw)

    def forward(self, x):
        h = self.fc1(x)
        if self.glu:
            gate, up = h.chunk(2, -1)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(h, approximate="tanh"))


class Block(nn.Module):
    def __init__(self, shape: GPTShape, **kw):
        super().__init__()
        self.input_norm = Norm(shape, **kw)
        self.attention = Attention(shape, **kw)
        self.post_attention_norm = Norm(shape, **kw)
        self.mlp = MLP(shape, **kw)

    def forward(self, x, rope=None):
        x = x + self.attention(self.input_norm(x), rope)
        return x + self.mlp(self.post_attention_norm(x))


class ReferenceGPT(nn.Module):
    def __init__(self, shape: GPTShape, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.shape = shape
        self.embedding = nn.Embedding(shape.vocab_size, shape.hidden_size, **kw)
        if not shape.llama:
            self.position_embedding = nn.Parameter(torch.empty(shape.seq_length, shape.hidden_size, **kw))
        self.layers = nn.ModuleList(Block(shape, **kw) for _ in range(shape.num_layers))
        self.final_norm = Norm(shape, **kw)
        if not shape.tie_embeddings:
            self.output_layer = nn.Parameter(torch.empty(shape.vocab_size, shape.hidden_size, **kw))
        self.rope = None
        if shape.llama:
            self.rope = rope_tables(shape.seq_length, shape.head_dim, 10000.0, device)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    p.normal_(0.0, shape.init_std)
                elif name.endswith("bias"):
                    p.zero_()

    def hidden(self, ids):
        x = self.embedding(ids)
        if not self.shape.llama:
            x = x + self.position_embedding[: ids.size(1)]
        for layer in self.layers:
            x = layer(x, self.rope)
        return x

    def head_loss(self, x, labels):
        weight = self.embedding.weight if self.shape.tie_embeddings else self.output_layer
        logits = F.linear(self.final_norm(x), weight)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.reshape(-1))

    def loss(self, ids, labels):
        return self.head_loss(self.hidden(ids), labels)

    forward = loss

    def compile_regional(self, **kw):
        """torch.compile each layer (one compilation, reused by every layer) and the head with
        the loss: PyTorch's recommended way to compile a deep stack of identical blocks."""
        for layer in self.layers:
            layer.compile(**kw)
        self.head_loss = torch.compile(self.head_loss, **kw)
        return self


class MasterAdamW:
    """AdamW on fp32 master copies of 16-bit parameters (torch's fused kernel); fp32 parameters
    are updated in place. zero_grad sets .grad to None, as torch's optimizers do."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1):
        self.params = [p for p in params if p.requires_grad]
        self.low = [p for p in self.params if p.dtype != torch.float32]
        self.master = [p.detach().float().clone() for p in self.low]
        for m in self.master:
            m.grad = torch.zeros_like(m)
        fp32 = [p for p in self.params if p.dtype == torch.float32]
        device = self.params[0].device
        fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.opt = torch.optim.AdamW(self.master + fp32, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     **fused)

    @torch.no_grad()
    def step(self):
        if self.low:
            torch._foreach_copy_([m.grad for m in self.master], [p.grad for p in self.low])
        self.opt.step()
        if self.low:
            torch._foreach_copy_(self.low, self.master)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_bytes(self) -> int:
        return sum(m.numel() * 4 * 4 for m in self.master)  # master, its grad, exp_avg, exp_avg_sq


def canonical_value(name: str, size, shape: GPTShape, seed: int, device) -> torch.Tensor:
    """The fp32 initial value of megatorch's parameter `name`: norm weights 1, biases 0, every
    matrix N(0, init_std) from a generator seeded by (seed, name) on `device` (the same values
    whichever model asks, and whatever order it asks in)."""
    if name.endswith("norm.weight"):
        return torch.ones(size, device=device)
    if name.endswith(".bias"):
        return torch.zeros(size, device=device)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(size, device=device).normal_(0.0, shape.init_std, generator=gen)


@torch.no_grad()
def shared_init_(targets, shape: GPTShape, seed: int = 1234) -> int:
    """Fills parameters from canonical_value. `targets`: (canonical name, parameter) pairs, or
    (canonical name, parameter, transform) where transform maps the canonical fp32 value (in
    megatorch's layout) to the parameter's (a slice, a permutation). Returns how many were set;
    raises if a name is not one of megatorch's or a size does not match."""
    sizes = shape.canonical_sizes()
    n = 0
    for target in targets:
        name, param = target[0], target[1]
        transform = target[2] if len(target) > 2 else None
        if name not in sizes:
            raise KeyError(f"shared_init_: {name} is not a parameter of megatorch's model for this shape")
        value = canonical_value(name, sizes[name], shape, seed, param.device)
        if transform is not None:
            value = transform(value)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"shared_init_: {name}: value {tuple(value.shape)} for a parameter {tuple(param.shape)}")
        param.copy_(value)
        n += 1
    return n


def same_loss_as(megatorch_model, shape: GPTShape, ids, labels, rtol=1e-4) -> dict:
    """Loads megatorch's weights into a ReferenceGPT (fp32, same device) and compares the losses:
    the proof that the peers are the same model. Returns {"megatorch", "reference", "rel_diff"}."""
    state = {k: v.detach().float() for k, v in megatorch_model.state_dict().items()}
    ref = ReferenceGPT(shape, device=ids.device, dtype=torch.float32)
    missing, unexpected = ref.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"reference and megatorch parameters differ: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        a = float(megatorch_model.loss(ids, labels))
        b = float(ref.loss(ids, labels))
    rel = abs(a - b) / max(abs(b), 1e-12)
    if not rel <= rtol or math.isnan(rel):
        raise RuntimeError(f"megatorch loss {a} vs reference {b}: relative difference {rel:.2e} > {rtol}")
    return {"megatorch": a, "reference": b, "rel_diff": rel}
