"""Activation memory of megatorch's C++ TransformerLayer, exact parts (docs/activation_memory.md).

Measured with scripts/activation_memory.py's measure_layer: the bytes autograd keeps for
backward after one layer's forward, one count per storage, parameters left out; fp32 on CPU
(E = 4 bytes per activation; dropout keeps its fp32 scaled noise, M = 4 bytes per element).
t = the world size (2 or 4 ranks), with the layer's TP group = every rank; u = s·b·h.
"""
import importlib.util
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "activation_memory.py"
_spec = importlib.util.spec_from_file_location("activation_memory", SCRIPT)
am = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(am)

SHAPE = am.Shape(s=64, b=2, h=64, a=4)
E = 4


def world():
    return dist.get_world_size(), dist.group.WORLD


def measure(setting, t, group, dropout=0.1, fused=False):
    return am.measure_layer(am.layer_config(SHAPE, setting, dropout, fused), SHAPE.b, group if t > 1 else None, t)


def test_dropout_keeps_a_4_byte_mask_on_cpu():
    assert am.dropout_mask_bytes(torch.device("cpu")) == 4  # the M used below


@pytest.mark.parametrize("sp", [False, True])
def test_full_recompute_keeps_exactly_the_layer_input(sp):
    t, group = world()
    for tp in [1, t]:
        if sp and tp == 1:
            continue
        m = measure("tp+sp+full" if sp else "full", tp, group)
        rows = SHAPE.s // tp if sp else SHAPE.s
        assert m.bytes == E * rows * SHAPE.b * SHAPE.h  # s·b·h·4 (s/t·b·h·4 under SP)
        assert [st[1:] for st in m.storages] == [((rows, SHAPE.b, SHAPE.h), "float32", "layer input")]


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_sequence_parallel_divides_the_sequence_region_by_t(recompute):
    """bytes(TP) − bytes(TP+SP) = (1 − 1/t)·R, R = 2·E·u (the two LayerNorm inputs) + 2·E·u
    (the inputs of QKV and fc1: their [s/t, b, h] shards, gathered again in backward) + 2·M·u
    (the two hidden-dropout masks) + 4·E·s·b (the LayerNorms' mean and 1/std): the region
    outside the tensor-parallel layers shrinks to R/t, and nothing else changes."""
    t, group = world()
    s, b, h = SHAPE.s, SHAPE.b, SHAPE.h
    u = s * b * h
    tp = measure("none" if recompute == "none" else "selective", t, group)
    tp_sp = measure("tp+sp" if recompute == "none" else "tp+sp+selective", t, group)
    region = 4 * E * u + 2 * 4 * u + 4 * E * s * b
    assert tp.bytes - tp_sp.bytes == region - region // t
    # The same, storage by storage: what SP splits has s/t rows, what it keeps whole has s.
    split = sum(n for n, shape, _, _ in tp_sp.storages if len(shape) == 3 and shape[0] == s // t)
    assert split == region // t
    # Among them the inputs of QKV and fc1: the two LayerNorm outputs, [s/t, b, h] each.
    gemm_inputs = [st for st in tp_sp.storages if st[1] == (s // t, b, h) and st[3] == "NativeLayerNormBackward0"]
    assert len(gemm_inputs) == 2, tp_sp.storages


def test_selective_recompute_drops_the_attention_core():
    """bytes(none) − bytes(selective) is the core attention's own saved tensors, per rank:
    with attention dropout (SDPA's math path) the softmax output, the dropout mask and the
    dropout output (a·s²·b each: (2E + M)·a·s²·b/t) and the scaled copies of Q and K that the
    math path makes (2·E·u/t); without dropout (CPU flash attention, no s² tensor) only its
    log-sum-exp (4·a·s·b/t). Selective keeps Q, K, V (the fused QKV output) either way."""
    t, group = world()
    s, b, h, a = SHAPE.s, SHAPE.b, SHAPE.h, SHAPE.a
    for tp in [1, t]:
        none, selective = measure("none", tp, group), measure("selective", tp, group)
        assert none.bytes - selective.bytes == ((2 * E + 4) * a * s * s * b + 2 * E * s * b * h) // tp
        none, selective = measure("none", tp, group, 0.0), measure("selective", tp, group, 0.0)
        assert none.bytes - selective.bytes == 4 * a * s * b // tp


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_every_setting_equals_the_paper_plus_the_explained_differences(dropout):
    t, group = world()
    for tp in [1, t]:
        for setting in am.SETTINGS:
            if tp == 1 and setting.startswith("tp+sp"):
                continue
            m = measure(setting, tp, group, dropout)
            want = am.megatorch_bytes(setting, SHAPE, tp, 4, 4, "math" if dropout > 0 else "flash")
            assert m.bytes == want, (setting, tp, m.storages)


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_fused_layer_keeps_the_same_tensors_but_1_byte_hidden_masks(dropout):
    """fused_kernels=True (the default): norms, bias-GeLU and bias-dropout-add are megatorch's
    kernels. They save what the ATen chain saves (the LayerNorm input and fp32 statistics,
    the GeLU input, the fc2 input), except that bias-dropout-add keeps a bool keep-mask
    (1 byte, the paper's M) instead of at::dropout's fp32 noise: 2·(4 − 1)·u less (÷ t under SP)."""
    t, group = world()
    for tp in [1, t]:
        for setting in am.SETTINGS:
            if tp == 1 and setting.startswith("tp+sp"):
                continue
            plain, fused = measure(setting, tp, group, dropout), measure(setting, tp, group, dropout, fused=True)
            saving = am.fused_hidden_mask_saving(setting, SHAPE, tp, 4, dropout)
            assert plain.bytes - fused.bytes == saving, (setting, tp, fused.storages)
            bools = [st for st in fused.storages if st[2] == "bool"]
            assert len(bools) == (2 if saving else 0), (setting, tp, fused.storages)


# ---- context parallelism: CP group = every rank, c = the world size, t = 1. Attention
# dropout 0 (CP refuses it), hidden dropout 0.1; the c = 1 layer has no CP group and runs
# SDPA's CPU flash kernel on the whole sequence S = SHAPE.s, the CP layer gets [S/c, b, h].

def measure_cp(setting, c, comm="p2p"):
    config = am.layer_config(SHAPE, setting, 0.1, cp_group=dist.group.WORLD if c > 1 else None,
                             cp_comm_type=comm, attention_dropout=0.0)
    return am.measure_layer(config, SHAPE.b, None, 1, c)


def measure_cp_attention(c, comm="p2p"):
    config = am.layer_config(SHAPE, "none", 0.0, cp_group=dist.group.WORLD if c > 1 else None, cp_comm_type=comm)
    return am.measure_core_attention(config, SHAPE.b, None, 1, c)


def storage_bytes(m):
    return sorted(n for n, _, _, _ in m.storages)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_context_parallel_divides_every_sequence_term_by_c(recompute):
    """Ring attention (p2p): every storage the c = 1 layer keeps — Korthikanti's s·b·h terms
    (layer input, LayerNorm inputs, the QKV and fc1 inputs, Q, K, V, GeLU's input and output,
    the two hidden-dropout masks), the LayerNorm statistics and the flash log-sum-exp — is
    kept at c with exactly 1/c of its bytes. Without recompute one storage more: the output
    projection's [S/c·b, h] copy of the ring's [b, a, S/c, d] output (O, E·u/c), which at
    c = 1 is a view of SDPA's output. Selective and full recompute keep nothing of the
    attention core, so they are exactly c = 1 / c."""
    c, _ = world()
    u = SHAPE.sbh
    one, split = measure_cp(recompute, 1), measure_cp(recompute, c)
    extra = [E * u // c] if recompute == "none" else []
    assert storage_bytes(split) == sorted([n // c for n in storage_bytes(one)] + extra), (one.storages, split.storages)
    assert all(n % c == 0 for n in storage_bytes(one))  # exactly: nothing rounds
    assert split.bytes * c == one.bytes + c * sum(extra)
    # The explained count: the paper's terms at S/c (fp32, 4-byte masks) + L + F (flash), + O.
    assert split.bytes == am.megatorch_cp_bytes(recompute, SHAPE, 1, c, E, 4, "p2p")
    assert one.bytes == am.megatorch_cp_bytes(recompute, SHAPE, 1, 1, E, 4)
    if recompute == "none":
        copy = [st for st in split.storages if st[1] == (SHAPE.s // c * SHAPE.b, SHAPE.h)]
        assert len(copy) == 3  # the QKV, output-projection and fc1 inputs; at c = 1 only two
        assert len([st for st in one.storages if st[1] == (SHAPE.s * SHAPE.b, SHAPE.h)]) == 2


def test_ring_attention_saves_only_local_q_k_v_out_and_lse():
    """The core attention alone. c = 1, SDPA's CPU flash kernel: the fused QKV storage (Q, K, V:
    3·E·u), its output (E·u) and its fp32 log-sum-exp [b, a, S] (4·a·S·b); no S×S tensor. The
    ring at c keeps the same three for the rank's S/c queries and keys: local Q, K, V, the
    merged output and log-sum-exp [b, a, S/c] — no scores and no K, V of other ranks: exactly
    the c = 1 bytes / c."""
    c, _ = world()
    s, b, h, a = SHAPE.s, SHAPE.b, SHAPE.h, SHAPE.a
    d = h // a

    def saved(m):
        return sorted((n, shape, dtype) for n, shape, dtype, _ in m.storages)

    for cc in [1, c]:
        sl = s // cc
        assert saved(measure_cp_attention(cc)) == sorted([
            (3 * E * sl * b * h, (b, a, sl, d), "float32"),  # q, k, v: views of the fused QKV tensor
            (E * sl * b * h, (b, a, sl, d), "float32"),  # the output
            (4 * a * sl * b, (b, a, sl), "float32"),  # the log-sum-exp
        ])
    assert measure_cp_attention(c).bytes * c == measure_cp_attention(1).bytes


def test_ulysses_keeps_head_shards_of_the_whole_sequence_and_two_indices():
    """a2a: after the all-to-all each rank attends a/c heads over the whole sequence, so SDPA
    keeps Q, K, V and the output [b, a/c, S, d] (each E·u/c, one storage apiece, made by the
    reordering index_select) and the log-sum-exp [b, a/c, S] — c = 1's bytes / c — plus
    index_select's two int64 token orders over the whole sequence (I, 8·S bytes each, not ÷ c).
    The layer: c = 1 / c + O + I without recompute, exactly c = 1 / c with recompute."""
    c, _ = world()
    s, b, h, a = SHAPE.s, SHAPE.b, SHAPE.h, SHAPE.a
    d, u = h // a, SHAPE.sbh
    m = measure_cp_attention(c, "a2a")
    assert sorted((n, shape, dtype) for n, shape, dtype, _ in m.storages) == sorted(
        [(E * u // c, (b, a // c, s, d), "float32")] * 4 + [(4 * a * s * b // c, (b, a // c, s), "float32")] +
        [(8 * s, (s,), "int64")] * 2)
    assert m.bytes * c == measure_cp_attention(1).bytes + c * 16 * s
    for recompute in ["none", "selective", "full"]:
        one, split = measure_cp(recompute, 1), measure_cp(recompute, c, "a2a")
        extra = E * u // c + 16 * s if recompute == "none" else 0
        assert split.bytes * c == one.bytes + c * extra, recompute
        assert split.bytes == am.megatorch_cp_bytes(recompute, SHAPE, 1, c, E, 4, "a2a"), recompute


# ---- the planner against these layers: megatorch-plan --flash-attention at c = the world size

PLAN = Path(os.environ.get("MEGATORCH_BIN_DIR", SCRIPT.parents[1] / "build" / "bin")) / "megatorch-plan"


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_planner_flash_attention_equals_the_context_parallel_layer(comm):
    """--flash-attention at c: the c = 1 flash count / c, plus O (and I for a2a) without
    recompute — equal to what each rank's layer keeps, to the byte, for every recompute mode."""
    c, _ = world()
    for recompute in ["none", "selective", "full"]:
        measured = measure_cp(recompute, c, comm).bytes
        planned = am.planned_layer_bytes(PLAN, SHAPE, recompute, "--mask-bytes", "4", "--megatorch-activations",
                                         "--flash-attention", c=c, comm=comm)
        assert planned == measured, recompute
