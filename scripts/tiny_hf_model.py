"""A small randomly initialised HuggingFace causal LM, saved as save_pretrained writes it
(config.json + model.safetensors, and the tokenizer's files when --tokenizer is given).

It stands in for a published checkpoint where nothing can be downloaded: docs/train.md's
"continue pretraining a HuggingFace model" walk-through starts from it, and with a real
model (`huggingface-cli download ... --local-dir my-model`) the same commands apply.

    .venv/bin/python scripts/tiny_hf_model.py --arch llama --tokenizer data/tokenizers/default-bpe \\
        --out runs/hf/my-llama
"""
import argparse
import shutil
from pathlib import Path

import torch
import transformers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model")


def build(args, vocab_size):
    common = dict(vocab_size=vocab_size, tie_word_embeddings=args.tied)
    if args.arch == "gpt2":
        config = transformers.GPT2Config(n_embd=args.hidden_size, n_layer=args.num_layers, n_head=args.heads,
                                         n_positions=args.max_positions, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, **common)
        return transformers.GPT2LMHeadModel(config)
    fields = dict(hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size or 3 * args.hidden_size,
                  num_hidden_layers=args.num_layers, num_attention_heads=args.heads,
                  num_key_value_heads=args.kv_heads or args.heads, max_position_embeddings=args.max_positions,
                  rms_norm_eps=1e-5, rope_theta=args.rope_theta, **common)
    if args.arch == "mistral":
        return transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=args.max_positions, **fields))
    if args.arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**fields))
    if args.arch == "mixtral":  # intermediate_size is each expert's
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            num_local_experts=args.experts, num_experts_per_tok=args.topk, sliding_window=None, **fields))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=["llama", "mistral", "qwen2", "mixtral", "gpt2"], default="llama")
    p.add_argument("--out", required=True, help="directory to save_pretrained into")
    p.add_argument("--tokenizer", help="a HuggingFace tokenizer directory: its files are copied, its size is the vocab")
    p.add_argument("--vocab-size", type=int, default=0, help="without --tokenizer")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--ffn-hidden-size", type=int, default=0, help="0: 3 x hidden")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2, help="GQA key/value heads (not GPT-2)")
    p.add_argument("--max-positions", type=int, default=512)
    p.add_argument("--rope-theta", type=float, default=500000.0)
    p.add_argument("--experts", type=int, default=4, help="Mixtral: experts per layer (num_local_experts)")
    p.add_argument("--topk", type=int, default=2, help="Mixtral: experts per token (num_experts_per_tok)")
    p.add_argument("--tied", action="store_true", help="tie the output layer to the embedding")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    vocab_size = args.vocab_size
    if args.tokenizer:
        vocab_size = max(vocab_size, len(transformers.AutoTokenizer.from_pretrained(args.tokenizer)))
    if vocab_size <= 0:
        p.error("give --tokenizer or --vocab-size")
    torch.manual_seed(args.seed)
    model = build(args, vocab_size)
    out = Path(args.out)
    model.save_pretrained(out, safe_serialization=True)
    if args.tokenizer:
        for name in TOKENIZER_FILES:
            if (Path(args.tokenizer) / name).exists():
                shutil.copy(Path(args.tokenizer) / name, out / name)
    params = sum(t.numel() for t in model.parameters())
    print(f"saved a random {type(model).__name__} ({params / 1e6:.2f}M parameters, vocabulary {vocab_size}) to {out}")


if __name__ == "__main__":
    main()
