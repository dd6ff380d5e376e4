"""megatorch's initial weights, so that every system starts from the same numbers.

megatorch draws each full weight from its own generator seeded by (seed, parameter name)
- FNV-1a over the seed's 8 bytes, the name and a salt (csrc/tp/init.cpp, name_seed) -
then N(0, init_std); biases are zero, norm weights one. That makes the weights of
gpt_pretrain identical at every parallel layout, and lets us reproduce them here in a
few lines. `prepare.py` checks this reproduction against the C++ GPTModel (through
megatorch.cpp) bit for bit when the build is there.

The weights are a dict keyed by gpt.py's (= megatorch's) names, full (unsharded) tensors;
the embedding has the real vocabulary's rows only (megatorch pads it with zero rows that
never reach the loss).
"""
import torch

from config import BenchConfig

_FNV_OFFSET, _FNV_PRIME, _MASK = 1469598103934665603, 1099511628211, (1 << 64) - 1


def name_seed(seed: int, name: str, salt: int = 0) -> int:
    h = _FNV_OFFSET

    def mix(byte):
        nonlocal h
        h = ((h ^ byte) * _FNV_PRIME) & _MASK

    for i in range(8):
        mix((seed >> (8 * i)) & 0xFF)
    for byte in name.encode():
        mix(byte)
    for i in range(8):
        mix((salt >> (8 * i)) & 0xFF)
    return h


def normal(cfg: BenchConfig, name: str, shape) -> torch.Tensor:
    gen = torch.Generator().manual_seed(name_seed(cfg.seed, name))
    return torch.normal(0.0, cfg.init_std, tuple(shape), generator=gen)


def megatorch_init(cfg: BenchConfig) -> dict:
    h, f = cfg.hidden_size, cfg.ffn_hidden_size
    w = {
        "embedding.word.weight": normal(cfg, "embedding.word.weight", (cfg.vocab_size, h)),
        "embedding.position.weight": normal(cfg, "embedding.position.weight", (cfg.seq_length, h)),
        "final_norm.weight": torch.ones(h),
        "final_norm.bias": torch.zeros(h),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for name, shape in (("attention.qkv", (3 * h, h)), ("attention.proj", (h, h)),
                            ("mlp.fc1", (f, h)), ("mlp.fc2", (h, f))):
            w[p + name + ".weight"] = normal(cfg, p + name + ".weight", shape)
            w[p + name + ".bias"] = torch.zeros(shape[0])
        for norm in ("input_norm", "post_attention_norm"):
            w[p + norm + ".weight"] = torch.ones(h)
            w[p + norm + ".bias"] = torch.zeros(h)
    return w


def load_into(model: torch.nn.Module, weights: dict) -> None:
    """Copies the full weights into a (not yet parallelised) GPT or pipeline stage; a last
    stage's `output_weight` is the embedding's copy."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = weights["embedding.word.weight" if name == "output_weight" else name]
            p.copy_(src)
