#!/usr/bin/env python3
"""Activation memory of one transformer layer, measured from megatorch's C++ layers,
next to Korthikanti et al. 2022 (docs/reference.md, "Sequence parallelism").

What is measured: the bytes a `megatorch.cpp.TransformerLayer` keeps for backward — every
tensor autograd saves during its forward, seen through
torch.autograd.graph.saved_tensors_hooks, counted once per storage (a saved view keeps
its whole storage alive, so that is what memory holds), parameters left out.

    .venv/bin/python scripts/activation_memory.py                      # t = 1
    torchrun --nproc-per-node=4 scripts/activation_memory.py --out X   # t = 1, 2, 4 (gloo)

With torchrun, t = 2 runs on the pairs [0,1] and [2,3], t = 4 on every rank; rank 0
prints. Run with MEGATORCH_LIBRARY pointing at the build's libmegatorch.so (or from a
repository whose build/lib holds it).

    torchrun --nproc-per-node=4 scripts/activation_memory.py --cp      # context parallelism

--cp measures context parallelism instead: c = 1, 2, 4 (the CP group = c ranks one TP
stride apart, Megatron's tp-cp order), t = 1 and t = 2 with SP, both comm types, attention
dropout 0 (CP refuses it), each rank's layer input [S/c, b, h] ([S/(c·t), b, h] under SP).
Every row must equal the c = 1 row / c plus the terms `cp_differences` names, exactly.

The formulas assume 16-bit activations and 1-byte dropout masks; we run fp32 on CPU.
`korthikanti_bytes(..., act_bytes=4, mask_bytes=M)` is the same count of tensors in fp32,
with M the bytes of a dropout mask as this device keeps it (CPU: at::dropout keeps the
fp32 scaled noise, 4 bytes; CUDA: native_dropout keeps a bool mask, 1 byte).
`megatorch_bytes` adds the differences of megatorch's implementation, term by term; every
measurement must equal it exactly (the last column of the table).
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List

import torch
import torch.distributed as dist
from torch.autograd.graph import saved_tensors_hooks

import megatorch.cpp as mt

SETTINGS = ["none", "tp+sp", "selective", "tp+sp+selective", "full", "tp+sp+full"]


@dataclass
class Shape:
    s: int
    b: int
    h: int
    a: int

    @property
    def sbh(self):
        return self.s * self.b * self.h


@dataclass
class Measurement:
    bytes: int = 0
    storages: List[tuple] = field(default_factory=list)  # (bytes, shape, dtype, producer)


def layer_config(shape: Shape, setting: str, dropout: float, fused: bool = False, cp_group=None,
                 cp_comm_type: str = "p2p", attention_dropout=None) -> "mt.TransformerConfig":
    """Korthikanti's GPT layer: LayerNorm, GeLU, biases, MHA; `setting` picks SP and recompute.
    The tables measure the unfused layer (fused_kernels=False: every saved tensor is an ATen
    op's, as the differences below explain them); the fused layer keeps the same tensors but
    its hidden-dropout masks, 1-byte bools (fused_hidden_mask_saving). `dropout` is the
    hidden dropout and, unless `attention_dropout` is given, the attention dropout too.
    `cp_group`: the context-parallel group (a name or ProcessGroup; None: no CP), whose
    size c splits every sequence (S = shape.s, each rank holding S/c tokens); CP refuses
    attention dropout."""
    recompute = "selective" if "selective" in setting else "full" if "full" in setting else "none"
    return mt.TransformerConfig(hidden_size=shape.h, num_attention_heads=shape.a, seq_length=shape.s,
                                hidden_dropout=dropout,
                                attention_dropout=dropout if attention_dropout is None else attention_dropout,
                                recompute=recompute, sequence_parallel=setting.startswith("tp+sp"), seed=1234,
                                fused_kernels=fused, context_parallel_group=cp_group, cp_comm_type=cp_comm_type)


class _SavedStorages:
    """saved_tensors_hooks that count every saved storage once, parameters (and `skip`) left out."""

    def __init__(self, skip, inputs):
        self.out, self.seen, self.skip, self.inputs = Measurement(), set(), set(skip), inputs

    def pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if storage.nbytes() > 0 and ptr not in self.skip and ptr not in self.seen:
            self.seen.add(ptr)
            producer = next((name for name, x in self.inputs.items() if x.untyped_storage().data_ptr() == ptr), None)
            producer = producer or (type(t.grad_fn).__name__ if t.grad_fn else "no grad_fn")
            self.out.storages.append((storage.nbytes(), tuple(t.shape), str(t.dtype).replace("torch.", ""), producer))
            self.out.bytes += storage.nbytes()
        return t

    def hooks(self):
        return saved_tensors_hooks(self.pack, lambda t: t)


def measure_layer(config, batch: int, group=None, tp_size: int = 1, cp_size: int = 1) -> Measurement:
    """Bytes saved for backward by one TransformerLayer forward in training mode. With
    context parallelism (config.context_parallel_group of size cp_size) the layer input is
    this rank's S/c tokens, [S/c, b, h] ([S/(c·t), b, h] under SP)."""
    layer = mt.TransformerLayer(config, group)
    layer.train()
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    s = config.seq_length // cp_size
    s = s // tp_size if config.sequence_parallel else s
    x = torch.randn(s, batch, config.hidden_size, requires_grad=True)
    saved = _SavedStorages(params, {"layer input": x})
    with saved.hooks():
        y = layer(x)
    y.sum().backward()  # the saved graph is a complete, working one
    return saved.out


def measure_core_attention(config, batch: int, group=None, tp_size: int = 1, cp_size: int = 1) -> Measurement:
    """Bytes saved for backward by the core attention alone (ParallelAttention.core_attention:
    SDPA, or context_parallel_attention under CP) on this rank's q, k, v [S/c, b, a/t, d],
    which are views of one fused QKV tensor as in the layer (its storage counts once)."""
    attention = mt.ParallelAttention(config, group)
    attention.train()
    s, heads, d = config.seq_length // cp_size, config.num_attention_heads // tp_size, config.head_dim
    qkv = torch.randn(s, batch, heads, 3, d, requires_grad=True)
    q, k, v = qkv.unbind(3)
    saved = _SavedStorages({p.untyped_storage().data_ptr() for p in attention.parameters()}, {"q, k, v": qkv})
    with saved.hooks():
        out = attention.core_attention(q, k, v)
    out.sum().backward()
    return saved.out


# ---- Korthikanti et al. 2022, term by term (per rank, per layer)

def korthikanti_bytes(setting: str, shape: Shape, t: int, act_bytes: int = 2, mask_bytes: int = 1) -> float:
    """The paper's count. At act_bytes=2, mask_bytes=1 it is docs/reference.md's table:
    outside the TP region the two LayerNorm inputs and the inputs of QKV and fc1 (4 sbh
    activations) and two hidden dropout masks (2 sbh); inside it (divided by t) Q, K, V and
    the output projection's input (4 sbh), GeLU's input and output (8 sbh), and per head
    the softmax output and the dropout output (2 a s^2 b) and the dropout mask (a s^2 b).
    Sequence parallelism divides the outside terms by t; selective recompute drops the
    a s^2 b terms; full recompute keeps the layer input (the paper's 2 sbh, divided by t
    under SP as Megatron stores the sequence shard)."""
    u, A = shape.sbh, shape.a * shape.s ** 2 * shape.b
    sp = 1 / t if setting.startswith("tp+sp") else 1
    if "full" in setting:
        return act_bytes * u * sp
    outside = (4 * act_bytes + 2 * mask_bytes) * u * sp
    inside = 12 * act_bytes * u / t
    if "selective" not in setting:
        inside += (2 * act_bytes + mask_bytes) * A / t
    return outside + inside


def reference_table_bytes(setting: str, shape: Shape, t: int) -> float:
    """docs/reference.md's rows as written (16-bit); korthikanti_bytes must equal them."""
    s, b, h, a = shape.s, shape.b, shape.h, shape.a
    return {
        "none": s * b * h * (10 + 24 / t + 5 * a * s / (h * t)),
        "tp+sp": s * b * h / t * (34 + 5 * a * s / h),
        "selective": s * b * h * (10 + 24 / t),
        "tp+sp+selective": 34 * s * b * h / t,
        "full": 2 * s * b * h,
        "tp+sp+full": 2 * s * b * h / t,
    }[setting]


# Codes of the differences between megatorch and the paper's count (docs/activation_memory.md).
DIFFERENCES = {
    "L": "LayerNorm keeps its fp32 mean and 1/std per token",
    "Q": "SDPA's math path keeps scaled copies of Q and K",
    "D": "no dropout: no hidden dropout masks",
    "F": "flash attention: no s^2 tensors, a log-sum-exp per query",
}


def megatorch_differences(setting: str, shape: Shape, t: int, act_bytes: int, mask_bytes: int,
                          attention: str, hidden_masks=None) -> dict:
    """What megatorch keeps beyond (or short of) the paper's count, {code: bytes}, each exact.
    attention: "math" (SDPA's math path: CPU with attention dropout) or "flash" (CPU
    flash attention without dropout, or the ring under context parallelism; it stores no
    s^2 tensor). hidden_masks: whether the hidden dropouts keep masks (default: with the
    math path only, where both dropouts share one probability)."""
    if hidden_masks is None:
        hidden_masks = attention == "math"
    s, b, h, a = shape.s, shape.b, shape.h, shape.a
    u, A = shape.sbh, a * s * s * b
    E = act_bytes
    sp = setting.startswith("tp+sp")
    d = {}
    if "full" in setting:
        return d
    # at::layer_norm saves its fp32 mean and 1/std ([s, b, 1] each) besides its input;
    # two LayerNorms. The paper counts only the inputs.
    d["L"] = 2 * 2 * 4 * s * b / (t if sp else 1)
    if attention == "math":
        if "selective" not in setting:
            # SDPA's math path multiplies Q and K by sqrt(1/sqrt(d)) into new tensors that
            # its matmul saves, while the V view keeps the whole fused QKV output alive:
            # Q and K are held twice.
            d["Q"] = 2 * E * u / t
    else:
        # No attention dropout: flash attention keeps no s^2 tensor, only its log-sum-exp
        # per query (which selective recompute drops with the rest); no hidden dropout, no masks.
        if not hidden_masks:
            d["D"] = -2 * mask_bytes * u / (t if sp else 1)
        if "selective" not in setting:
            d["F"] = -(2 * E + mask_bytes) * A / t + 4 * a * s * b / t
    return d


def megatorch_bytes(setting, shape, t, act_bytes, mask_bytes, attention, hidden_masks=None) -> float:
    return korthikanti_bytes(setting, shape, t, act_bytes, mask_bytes) + sum(
        megatorch_differences(setting, shape, t, act_bytes, mask_bytes, attention, hidden_masks).values())


def cp_shape(shape: Shape, c: int) -> Shape:
    """What one CP rank of c holds of a sequence of shape.s tokens: shape.s / c of them."""
    assert shape.s % (2 * c) == 0, (shape, c)
    return Shape(shape.s // c, shape.b, shape.h, shape.a)


# What a layer keeps under context parallelism beyond the c = 1 layer's bytes / c.
CP_DIFFERENCES = {
    "O": "the attention output held twice: the CP attention's [b, a/t, S/c, d] and the output projection's "
         "[S/c, b, h/t] copy of it (at c = 1 the projection's input is a view of SDPA's output)",
    "I": "Ulysses: its two int64 token-order indices over the whole sequence, 8·S bytes each",
}


def cp_differences(setting: str, shape: Shape, t: int, c: int, act_bytes: int, comm: str) -> dict:
    """What one layer keeps per rank at CP c beyond (the c = 1 layer's bytes) / c, {code: bytes},
    each exact (shape.s = S, the whole sequence). Without recompute only: selective recompute
    replays the core attention (the CP attention included) and full recompute the layer, so
    neither keeps anything the core attention saves; what is left is ÷ c exactly.
    O: the ring keeps its output [b, a/t, S/c, d] contiguous for its backward, so the layer's
    permute to [S/c, b, h/t] for the output projection is a copy, which the projection keeps;
    SDPA's CPU flash kernel lays its output out like q (a view of megatorch's [s, b, ...] QKV
    output), so at c = 1 the projection's input is a view of it. Ulysses' all-to-all back
    returns [b, a/t, S/c, d] too. I: Ulysses' index_select saves its index, the int64 token
    order `natural` (for q, k, v) and `order` (for the output), S entries each, neither ÷ c nor ÷ t."""
    if c == 1 or "selective" in setting or "full" in setting:
        return {}
    d = {"O": act_bytes * shape.sbh / (c * t)}
    if comm == "a2a":
        d["I"] = 2 * 8 * shape.s
    return d


def megatorch_cp_bytes(setting, shape, t, c, act_bytes, mask_bytes, comm="p2p", hidden_masks=True) -> float:
    """One layer's saved bytes per rank under context parallelism of size c (attention
    dropout 0, as CP requires): the count at c = 1 (flash attention, no s^2 term) for the
    rank's S/c tokens — every term of it is linear in s, so it is the c = 1 count / c — plus
    cp_differences."""
    return megatorch_bytes(setting, cp_shape(shape, c), t, act_bytes, mask_bytes, "flash", hidden_masks) + sum(
        cp_differences(setting, shape, t, c, act_bytes, comm).values())


def planned_layer_bytes(plan, shape: Shape, setting: str, *flags, c: int = 1, comm: str = "p2p",
                        dp: int = 1) -> float:
    """megatorch-plan's (`plan`, the binary's path) activation bytes for one layer of `shape` and
    one micro-batch in flight, fp32, t = 1, at CP c and DP dp (c·dp GPUs, each rank a micro-batch
    of shape.b sequences; dp > 1 leaves room for expert tensor parallelism, EP·ETP dividing
    CP·DP); `flags` describe how activations are kept (--mask-bytes, --megatorch-activations,
    --math-attention, --flash-attention) and the model (MoE flags, --expert-tensor-parallel-size)."""
    if not os.path.exists(plan):
        raise FileNotFoundError(f"{plan} is not built: run scripts/build.sh")
    out = subprocess.run([str(plan), "--num-layers", "1", "--hidden-size", str(shape.h), "--num-attention-heads",
                          str(shape.a), "--seq-length", str(shape.s), "--vocab-size", "256",
                          "--gpus-per-node", str(c * dp), "--nodes", "1", "--global-batch-size", str(shape.b * dp),
                          "--micro-batch-size", str(shape.b),
                          "--precision", "fp32", "--tensor-model-parallel-size", "1",
                          "--pipeline-model-parallel-size", "1", "--data-parallel-size", str(dp),
                          "--context-parallel-size", str(c), "--cp-comm-type", comm, "--recompute-granularity", setting,
                          "--zero-stage", "0", *flags, "--json"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"megatorch-plan failed: {out.stderr}")
    return json.loads(out.stdout)["top"][0]["memory"]["activation_bytes"]


def fused_hidden_mask_saving(setting: str, shape: Shape, t: int, mask_bytes: int, dropout: float) -> int:
    """Bytes the fused layer keeps less than the unfused one: its bias-dropout-add keeps a
    1-byte bool keep-mask where at::dropout keeps M-byte scaled noise; two hidden dropouts
    per layer, in the sequence region (÷ t under SP). Nothing else differs."""
    if dropout == 0 or "full" in setting:
        return 0
    return 2 * (mask_bytes - 1) * shape.sbh // (t if setting.startswith("tp+sp") else 1)


def dropout_mask_bytes(device: torch.device) -> int:
    """Bytes per element of what dropout keeps for backward on this device (measured)."""
    x = torch.ones(8, device=device, requires_grad=True)
    kept = []
    with saved_tensors_hooks(lambda t: kept.append(t.element_size()) or t, lambda t: t):
        torch.dropout(x * 1, 0.5, True)
    return kept[-1]


# ---- the report

def fmt_bytes(n: float) -> str:
    return f"{n / 2 ** 20:.3f} MiB" if abs(n) >= 2 ** 20 else f"{n / 2 ** 10:.2f} KiB"


def run(shapes, tps, groups, dropout, mask_bytes):
    """One row per (shape, t, setting): measured bytes, the paper's 16-bit and fp32 counts,
    megatorch's explained count and its differences from the paper, the saved storages."""
    rows = []
    for shape in shapes:
        for t in tps:
            if shape.a % t or shape.s % t:
                continue
            for setting in SETTINGS:
                if t == 1 and setting.startswith("tp+sp"):
                    continue  # SP needs a TP group
                m = measure_layer(layer_config(shape, setting, dropout), shape.b, groups[t], t)
                attention = "math" if dropout > 0 else "flash"
                diffs = megatorch_differences(setting, shape, t, 4, mask_bytes, attention)
                rows.append(dict(shape=shape, t=t, setting=setting, measured=m.bytes,
                                 f16=korthikanti_bytes(setting, shape, t, 2, 1),
                                 f32=korthikanti_bytes(setting, shape, t, 4, mask_bytes),
                                 model=megatorch_bytes(setting, shape, t, 4, mask_bytes, attention),
                                 diffs=diffs, storages=m.storages))
                assert abs(korthikanti_bytes(setting, shape, t) - reference_table_bytes(setting, shape, t)) < 1e-6
    return rows


def label(setting, t):
    names = {"none": "TP" if t > 1 else "no parallelism", "tp+sp": "TP + SP", "selective": "TP + selective",
             "tp+sp+selective": "TP + SP + selective", "full": "full recompute", "tp+sp+full": "TP + SP + full"}
    return names[setting] if t > 1 or setting != "selective" else "selective"


def markdown(rows) -> str:
    out = ["| s | b | h | a | t | setting | paper, 16-bit | paper, fp32 | measured | measured / paper fp32 "
           "| measured − paper fp32, term by term | sum exact |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sh = r["shape"]
        exact = "yes" if r["measured"] == round(r["model"]) else f"NO, off by {r['measured'] - r['model']:.0f} B"
        terms = ", ".join(f"{k} {'+' if v >= 0 else '−'}{fmt_bytes(abs(v))}" for k, v in r["diffs"].items()) or "0"
        out.append(f"| {sh.s} | {sh.b} | {sh.h} | {sh.a} | {r['t']} | {label(r['setting'], r['t'])} "
                   f"| {fmt_bytes(r['f16'])} | {fmt_bytes(r['f32'])} | {fmt_bytes(r['measured'])} "
                   f"| {r['measured'] / r['f32']:.3f} | {terms} | {exact} |")
    return "\n".join(out)


def ratios(rows) -> str:
    """Measured ratios between settings next to the paper's (fp32 and 16-bit)."""
    by = {(r["shape"].s, r["shape"].b, r["shape"].h, r["shape"].a, r["t"], r["setting"]): r for r in rows}
    pairs = [("tp+sp", "none", "TP+SP / TP"), ("selective", "none", "selective / none"),
             ("tp+sp+selective", "tp+sp", "TP+SP+sel / TP+SP"), ("full", "none", "full / none")]
    out = ["| s | b | h | a | t | ratio | measured | paper, fp32 | paper, 16-bit |", "|---|---|---|---|---|---|---|---|---|"]
    for (s, b, h, a, t, setting), r in by.items():
        for num, den, name in pairs:
            if setting != den or (s, b, h, a, t, num) not in by:
                continue
            n = by[(s, b, h, a, t, num)]
            out.append(f"| {s} | {b} | {h} | {a} | {t} | {name} | {n['measured'] / r['measured']:.4f} "
                       f"| {n['f32'] / r['f32']:.4f} | {n['f16'] / r['f16']:.4f} |")
    return "\n".join(out)


def breakdown(row) -> str:
    u = row["shape"].sbh
    lines = [f"saved storages, {label(row['setting'], row['t'])} at t={row['t']} "
             f"(s,b,h,a)=({row['shape'].s},{row['shape'].b},{row['shape'].h},{row['shape'].a}):"]
    for nbytes, shape, dtype, producer in row["storages"]:
        lines.append(f"  {nbytes / u:8.4f} bytes/sbh  {str(list(shape)):18s} {dtype:8s} {producer}")
    lines.append("  differences from the paper (fp32): " + (", ".join(
        f"{k} ({DIFFERENCES[k]}) {v / u:+.4f} bytes/sbh" for k, v in row["diffs"].items()) or "none"))
    return "\n".join(lines)


# ---- context parallelism

CP_SETTINGS = {1: ["none", "selective", "full"], 2: ["tp+sp", "tp+sp+selective", "tp+sp+full"]}  # by t
CP_SHAPE = Shape(512, 1, 256, 8)


def cp_layouts(world: int, rank: int) -> dict:
    """(t, c) -> (this rank's TP group, its CP group) for every t·c dividing the world, in
    Megatron's tp-cp order: a TP group is t consecutive ranks, a CP group the c ranks one
    TP stride apart. Every rank creates every group, in the same order."""
    out = {(1, 1): (None, None)}
    for t in [1, 2, 4, 8]:
        for c in [1, 2, 4, 8]:
            if (t, c) == (1, 1) or t * c > world or world % (t * c):
                continue
            tp_groups = {tuple(range(i, i + t)): dist.new_group(list(range(i, i + t))) for i in range(0, world, t)}
            cp_groups = {}
            for base in range(0, world, t * c):
                for tp_rank in range(t):
                    ranks = tuple(base + tp_rank + t * j for j in range(c))
                    cp_groups[ranks] = dist.new_group(list(ranks))
            mine = lambda groups: next(g for ranks, g in groups.items() if rank in ranks)  # noqa: E731
            out[(t, c)] = (mine(tp_groups) if t > 1 else None, mine(cp_groups) if c > 1 else None)
    return out


def measure_cp(shape: Shape, setting: str, t: int, c: int, layouts: dict, comm: str = "p2p",
               hidden_dropout: float = 0.1) -> Measurement:
    """One layer's saved bytes per rank at TP t and CP c (attention dropout 0); c = 1: no CP group."""
    tp_group, cp_group = layouts[(t, c)]
    config = layer_config(shape, setting, hidden_dropout, cp_group=cp_group, cp_comm_type=comm, attention_dropout=0.0)
    return measure_layer(config, shape.b, tp_group, t, c)


def measure_cp_attention(shape: Shape, c: int, layouts: dict, comm: str = "p2p") -> Measurement:
    """The core attention's saved bytes per rank at CP c, t = 1 (c = 1: SDPA without a CP group)."""
    config = layer_config(shape, "none", 0.0, cp_group=layouts[(1, c)][1], cp_comm_type=comm)
    return measure_core_attention(config, shape.b, None, 1, c)


def run_cp(shape: Shape, layouts: dict, mask_bytes: int):
    """Rows (t, c, comm, setting): measured, the explained count at S/c, the c = 1 measurement."""
    rows = []
    for (t, c) in sorted(layouts):
        if t not in CP_SETTINGS:
            continue
        for comm in (["p2p", "a2a"] if c > 1 else ["-"]):
            if comm == "a2a" and (shape.a // t) % c:
                continue
            for setting in CP_SETTINGS[t]:
                kind = "p2p" if comm == "-" else comm
                m = measure_cp(shape, setting, t, c, layouts, kind)
                rows.append(dict(t=t, c=c, comm=comm, setting=setting, measured=m.bytes, storages=m.storages,
                                 model=megatorch_cp_bytes(setting, shape, t, c, 4, mask_bytes, kind),
                                 diffs=cp_differences(setting, shape, t, c, 4, kind)))
    base = {(r["t"], r["setting"]): r["measured"] for r in rows if r["c"] == 1}
    for r in rows:
        r["c1"] = base[(r["t"], r["setting"])]
    attention = []
    for c in sorted(c for (t, c) in layouts if t == 1):
        for comm in (["p2p", "a2a"] if c > 1 else ["-"]):
            if comm == "a2a" and shape.a % c:
                continue
            m = measure_cp_attention(shape, c, layouts, "p2p" if comm == "-" else comm)
            attention.append(dict(c=c, comm=comm, measured=m.bytes, storages=m.storages))
    return rows, attention


def cp_label(setting):
    return {"none": "no recompute", "selective": "selective", "full": "full recompute", "tp+sp": "TP + SP",
            "tp+sp+selective": "TP + SP + selective", "tp+sp+full": "TP + SP + full"}[setting]


def cp_markdown(shape: Shape, rows, attention) -> str:
    out = [f"(s, b, h, a) = ({shape.s}, {shape.b}, {shape.h}, {shape.a}): S = {shape.s} tokens per sequence, "
           f"each CP rank holding S/c; hidden dropout 0.1, attention dropout 0. 'c = 1 / c': the c = 1 "
           f"measurement (same t, same setting, no CP group) divided by c.", "",
           "| t | c | comm | setting | measured | c = 1 / c | measured − c = 1 / c, term by term "
           "| (c = 1) / measured "
           "| explained count exact |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        exact = "yes" if r["measured"] == round(r["model"]) else f"NO, off by {r['measured'] - r['model']:.0f} B"
        terms = ", ".join(f"{k} +{fmt_bytes(v)}" for k, v in r["diffs"].items()) or "0"
        if r["measured"] * r["c"] != r["c1"] + r["c"] * sum(r["diffs"].values()):
            terms += " (NO: the c = 1 row / c and these terms do not add up)"
        out.append(f"| {r['t']} | {r['c']} | {r['comm']} | {cp_label(r['setting'])} | {fmt_bytes(r['measured'])} "
                   f"| {fmt_bytes(r['c1'] / r['c'])} | {terms} | {r['c1'] / r['measured']:.3f} | {exact} |")
    out += ["", "The core attention alone (t = 1; its input q, k, v: views of one [S/c, b, a, 3, d] tensor):", "",
            "| c | comm | saved storages (bytes, shape, dtype, made by) | total | total · c |",
            "|---|---|---|---|---|"]
    for r in attention:
        parts = "; ".join(f"{fmt_bytes(n)} {list(sh)} {dt} ({who})" for n, sh, dt, who in r["storages"])
        out.append(f"| {r['c']} | {r['comm']} | {parts} | {fmt_bytes(r['measured'])} "
                   f"| {fmt_bytes(r['measured'] * r['c'])} |")
    return "\n".join(out)


def main_cp(args, rank, world):
    layouts = cp_layouts(world, rank) if world > 1 else {(1, 1): (None, None)}
    shape = CP_SHAPE
    rows, attention = run_cp(shape, layouts, dropout_mask_bytes(torch.device("cpu")))
    text = [f"Measured on CPU, fp32, torch {torch.__version__}, {world} ranks; context parallelism "
            f"c = {', '.join(sorted({str(r['c']) for r in rows}))}.", "", cp_markdown(shape, rows, attention)]
    if rank == 0:
        report = "\n".join(text)
        print(report)
        if args.breakdown:
            for r in rows:
                if r["t"] == 1 and r["setting"] == "none" and r["comm"] in ("-", "p2p"):
                    print(f"\nsaved storages, t = 1, c = {r['c']}, no recompute:")
                    for nbytes, sh, dtype, producer in r["storages"]:
                        print(f"  {nbytes:10d} B  {str(list(sh)):18s} {dtype:8s} {producer}")
        if args.out:
            with open(args.out, "w") as f:
                f.write(report + "\n")
    bad = [r for r in rows if r["measured"] != round(r["model"])
           or r["measured"] * r["c"] != r["c1"] + r["c"] * sum(r["diffs"].values())]
    return bad


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the markdown tables to this file")
    parser.add_argument("--breakdown", action="store_true", help="print every saved storage of the t-max rows")
    parser.add_argument("--cp", action="store_true",
                        help="measure context parallelism instead: c = 1, 2, 4 (as the world allows), t = 1 and 2")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if args.cp:
        rank, world = 0, 1
        if "RANK" in os.environ:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
            world, rank = dist.get_world_size(), dist.get_rank()
        bad = main_cp(args, rank, world)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if bad:
            print(f"rank {rank}: {len(bad)} CP measurements differ from the explained count or c = 1 / c",
                  file=sys.stderr)
            sys.exit(1)
        return

    rank = 0
    groups = {1: None}  # t -> the TP group this rank measures with
    if "RANK" in os.environ:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        world, rank = dist.get_world_size(), dist.get_rank()
        for t in [2, 4, 8]:
            if t <= world and world % t == 0:
                subgroups = [dist.new_group(list(range(i, i + t))) for i in range(0, world, t)]  # every rank
                groups[t] = subgroups[rank // t]
    tps = sorted(groups)
    shapes = [Shape(512, 1, 256, 8), Shape(256, 2, 512, 8), Shape(1024, 1, 512, 16)]
    mask_bytes = dropout_mask_bytes(torch.device("cpu"))
    rows = run(shapes, tps, groups, 0.1, mask_bytes)
    rows_flash = run(shapes[:1], tps, groups, 0.0, mask_bytes)

    legend = "; ".join(f"{k}: {v}" for k, v in DIFFERENCES.items())
    text = [f"Measured on CPU, fp32, torch {torch.__version__}, t = {', '.join(map(str, tps))}; dropout keeps "
            f"{mask_bytes}-byte elements. 'paper, fp32': the paper's terms with 4-byte activations and "
            f"{mask_bytes}-byte masks. Differences: {legend}.", "",
            "### With dropout 0.1 (attention: SDPA's math path, as the paper counts)", "", markdown(rows), "",
            "### Ratios between settings (dropout 0.1)", "", ratios(rows), "",
            "### Without dropout (attention: CPU flash attention, no s^2 tensors)", "", markdown(rows_flash)]
    if rank == 0:
        report = "\n".join(text)
        print(report)
        if args.breakdown:
            for r in rows + rows_flash:
                if r["t"] == max(tps) and r["shape"] == shapes[0]:
                    print("\n" + breakdown(r))
        if args.out:
            with open(args.out, "w") as f:
                f.write(report + "\n")
    bad = [r for r in rows + rows_flash if r["measured"] != round(r["model"])]
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if bad:
        print(f"rank {rank}: {len(bad)} measurements differ from the explained count", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
