"""Packed documents on CPU: step time and attention FLOPs with document masking
(--reset-attention-mask) next to full causal attention over the same tokens
(docs/data.md, "Packed documents").

    .venv/bin/python scripts/bench/packed_documents.py [--seq-length 4096 --mean-document-length 512
        --hidden-size 256 --num-layers 2 --reps 5 --out runs/packed_documents]

One sequence of --seq-length tokens cut into documents of random lengths (uniform in
[m/2, 3m/2], m = --mean-document-length, the last one cut by the sequence's end), each ending
with the end-of-document token. Side by side, in one process, fp32:

- the model: a megatorch GPTModel (RoPE, RMSNorm, SwiGLU, 4 heads) forward + backward on
  the row with full causal attention, and with the documents packed (positions and masks
  from megatorch.cpp.pack_documents); the packed loss is checked against the documents
  fed one by one;
- attention alone, [1, 4, s, d] forward + backward: SDPA causal over the whole row; the
  PyTorch peer for documents, SDPA with the dense block-diagonal causal mask (s x s
  booleans); megatorch's document_causal_attention (no mask, one SDPA per document), whose
  output is checked against the peer's.

On a GPU (--device cuda --dtype bfloat16, scripts/gpu_check.sh) the same at the 1.3B
GPT's shape. Attention-core FLOPs (Q K^T and P V, forward) are counted exactly (causal: each query's
visible keys) and as megatorch-plan counts them (the full square of the sequence, or of each
document with --mean-document-length). Median of --reps timed repetitions after one warm-up.
Writes OUT/results.json and prints the table.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import megatorch.cpp as mt

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from bench_util import cpu_name  # noqa: E402

EOD = 256


def document_lengths(seq, mean, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(mean // 2, mean * 3 // 2 + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - seq
    return lengths


def timed(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--mean-document-length", type=int, default=512)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu or cuda (scripts/gpu_check.sh: the 1.3B GPT in bf16)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "runs" / "packed_documents"))
    a = p.parse_args()
    s, heads = a.seq_length, a.num_attention_heads
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    lengths = document_lengths(s, a.mean_document_length, a.seed)
    g = torch.Generator().manual_seed(a.seed)
    tokens = torch.randint(EOD, (1, s), generator=g)
    ends = torch.tensor(lengths).cumsum(0) - 1
    tokens[0, ends] = EOD
    labels = torch.randint(EOD, (1, s), generator=g)
    tokens, labels = tokens.to(device), labels.to(device)
    positions, documents = mt.pack_documents(tokens, EOD)
    assert int(documents.max()) + 1 == len(lengths)

    config = mt.TransformerConfig(hidden_size=a.hidden_size, num_attention_heads=heads, num_layers=a.num_layers,
                                  seq_length=s, vocab_size=EOD + 1, position_embedding_type="rope",
                                  normalization="RMSNorm", activation="swiglu", add_bias_linear=False, seed=3,
                                  params_dtype=dtype, device=device)
    model = mt.GPTModel(config)
    ce = torch.nn.functional.cross_entropy

    def step(**packed):
        def run():
            model.zero_grad()
            logits = model(tokens, **packed)[:, 0, :EOD + 1]
            loss = ce(logits.float(), labels[0], reduction="sum")
            loss.backward()
            sync()
            return loss
        return run

    full_causal, packed = step(), step(position_ids=positions, document_ids=documents)
    packed_loss = packed().item()
    with torch.no_grad():  # the same documents one by one: the packed loss is theirs
        separate, start = 0.0, 0
        for n in lengths:
            out = model(tokens[:, start:start + n])[:, 0, :EOD + 1]
            separate += ce(out.float(), labels[0, start:start + n], reduction="sum").item()
            start += n
    model_times = {"full_causal": timed(full_causal, a.reps), "packed": timed(packed, a.reps)}

    d = a.hidden_size // heads
    q, k, v = (torch.randn(1, heads, s, d, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
    row = documents[0]
    block_mask = (row.unsqueeze(1) == row.unsqueeze(0)) & torch.ones(s, s, dtype=torch.bool, device=device).tril()
    scale = d ** -0.5

    def attention(fn):
        def run():
            for t in (q, k, v):
                t.grad = None
            out = fn()
            out.float().square().sum().backward()
            sync()
            return out
        return run

    sdpa = torch.nn.functional.scaled_dot_product_attention
    kernels = {
        "sdpa_full_causal": lambda: sdpa(q, k, v, is_causal=True, scale=scale),
        "sdpa_dense_block_mask": lambda: sdpa(q, k, v, attn_mask=block_mask, scale=scale),
        "megatorch_document_causal_attention": lambda: mt.document_causal_attention(q, k, v, documents, scale),
    }
    with torch.no_grad():
        diff = (kernels["sdpa_dense_block_mask"]() - kernels["megatorch_document_causal_attention"]()).float().abs().max().item()
    attention_times = {name: timed(attention(fn), a.reps) for name, fn in kernels.items()}

    width = heads * d
    exact = {"full_causal": 4 * width * s * (s + 1) / 2 * a.num_layers,
             "packed": 4 * width * sum(n * (n + 1) / 2 for n in lengths) * a.num_layers}
    planner = {"full_causal": 4 * width * s * s * a.num_layers,
               "packed": 4 * width * s * min(s, a.mean_document_length) * a.num_layers}
    results = {
        "cpu": cpu_name(), "threads": torch.get_num_threads(), "device": str(device), "dtype": a.dtype,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None, "seq_length": s,
        "mean_document_length": a.mean_document_length, "documents": len(lengths),
        "hidden_size": a.hidden_size, "num_layers": a.num_layers, "reps": a.reps,
        "loss": {"packed": packed_loss, "documents_one_by_one": separate,
                 "relative_difference": abs(packed_loss - separate) / abs(separate)},
        "model_step_s": model_times, "model_speedup": model_times["full_causal"] / model_times["packed"],
        "attention_fwd_bwd_s": attention_times,
        "attention_max_abs_difference_vs_dense_mask": diff,
        "attention_forward_flops_exact": exact, "attention_forward_flops_planner": planner,
        "attention_flops_ratio_exact": exact["full_causal"] / exact["packed"],
    }
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    t = attention_times
    where = results["gpu"] or f"{cpu_name()}, {torch.get_num_threads()} threads"
    print(f"{s} tokens in {len(lengths)} documents (mean {a.mean_document_length}), {where}, {a.dtype}")
    print(f"model forward+backward: full causal {model_times['full_causal']:.3f} s, packed "
          f"{model_times['packed']:.3f} s ({results['model_speedup']:.2f}x); packed loss {packed_loss:.6g} vs documents "
          f"one by one {separate:.6g} (rel. {results['loss']['relative_difference']:.1e})")
    print(f"attention fwd+bwd: SDPA causal {t['sdpa_full_causal']:.3f} s, SDPA dense block mask "
          f"{t['sdpa_dense_block_mask']:.3f} s, megatorch by document {t['megatorch_document_causal_attention']:.3f} s "
          f"({t['sdpa_dense_block_mask'] / t['megatorch_document_causal_attention']:.2f}x the dense mask, "
          f"{t['sdpa_full_causal'] / t['megatorch_document_causal_attention']:.2f}x full causal); max |diff| {diff:.1e}")
    print(f"attention forward FLOPs: exact {exact['full_causal']:.3g} -> {exact['packed']:.3g} "
          f"({results['attention_flops_ratio_exact']:.2f}x fewer); megatorch-plan's count {planner['full_causal']:.3g} "
          f"-> {planner['packed']:.3g}")


if __name__ == "__main__":
    main()
