"""Tensor-parallel operators and megatorch.nn wrappers against plain PyTorch.

A small GPT is built twice: plain PyTorch on every rank (the reference, full weights)
and tensor-parallel from megatorch.nn layers made with from_dense; the loss and every
gradient must agree to 1e-5 relative to the reference's magnitude (fp32, only the summation
order differs: tolerance.assert_close)."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import megatorch
from megatorch.nn import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, vocab_parallel_cross_entropy
from tolerance import assert_catches_injected_errors, assert_close

H, HEADS, FFN, LAYERS, VOCAB, S, B = 32, 4, 64, 2, 96, 8, 2


class PlainBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)


class PlainGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, H)
        self.pos = nn.Parameter(torch.randn(S, H) * 0.02)
        self.blocks = nn.ModuleList(PlainBlock() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(H)


def attention(q, k, v, heads):
    b, s, _ = q.shape
    q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.size(-1))
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)


def plain_loss(m, ids, labels):
    x = m.emb(ids) + m.pos
    for blk in m.blocks:
        a = blk.ln1(x)
        x = x + blk.o(attention(blk.q(a), blk.k(a), blk.v(a), HEADS))
        x = x + blk.fc2(F.gelu(blk.fc1(blk.ln2(x)), approximate="tanh"))
    logits = m.ln_f(x) @ m.emb.weight.t()
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class TPGPT(nn.Module):
    """The same model from megatorch.nn layers sharded out of the plain one."""

    def __init__(self, plain, group):
        super().__init__()
        self.group, self.tp = group, dist.get_world_size(group)
        self.emb = VocabParallelEmbedding.from_dense(plain.emb, group)
        self.pos = nn.Parameter(plain.pos.detach().clone())
        self.blocks = nn.ModuleList()
        for blk in plain.blocks:
            t = nn.Module()
            t.ln1, t.ln2 = (nn.LayerNorm(H) for _ in range(2))
            t.ln1.load_state_dict(blk.ln1.state_dict())
            t.ln2.load_state_dict(blk.ln2.state_dict())
            t.q, t.k, t.v = (ColumnParallelLinear.from_dense(lin, group) for lin in (blk.q, blk.k, blk.v))
            t.o = RowParallelLinear.from_dense(blk.o, group)
            t.fc1 = ColumnParallelLinear.from_dense(blk.fc1, group)
            t.fc2 = RowParallelLinear.from_dense(blk.fc2, group)
            self.blocks.append(t)
        self.ln_f = nn.LayerNorm(H)
        self.ln_f.load_state_dict(plain.ln_f.state_dict())

    def loss(self, ids, labels):
        x = self.emb(ids) + self.pos
        for t in self.blocks:
            a = t.ln1(x)
            x = x + t.o(attention(t.q(a), t.k(a), t.v(a), HEADS // self.tp))
            x = x + t.fc2(F.gelu(t.fc1(t.ln2(x)), approximate="tanh"))
        # The head is column-parallel over the (tied) vocabulary shard; logits stay split.
        logits = torch.ops.megatorch.column_parallel_linear(self.ln_f(x), self.emb.weight, None, self.group.group_name)
        return vocab_parallel_cross_entropy(logits, labels, self.group).mean()


def tp_shard(name, full, shard, rank, tp):
    """The rank's part of a plain parameter, for the matching TP parameter."""
    if shard.shape == full.shape:
        return full
    dim = [d for d in range(full.dim()) if full.shape[d] != shard.shape[d]][0]
    return full.chunk(tp, dim)[rank]


def gpt_parity():
    """(loss, reference loss, [(name, TP gradient, the plain gradient's matching shard, scale)]).

    The key bias's gradient is zero in exact arithmetic (softmax does not change when a row
    of scores moves by q . b): what is left is the rounding of its sum over the B x S tokens
    of dL/dk, so its scale is that sum's absolute terms, not its own (~1e-9) magnitude.
    Every other gradient: scale None (max|want|)."""
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # same plain model on every rank
    plain = PlainGPT()
    ids = torch.randint(VOCAB, (B, S + 1))
    inp, labels = ids[:, :-1], ids[:, 1:]
    key_grads = {}
    for i, blk in enumerate(plain.blocks):
        blk.k.register_full_backward_hook(lambda m, gin, gout, i=i: key_grads.__setitem__(i, gout[0].detach()))
    ref = plain_loss(plain, inp, labels)
    ref.backward()
    model = TPGPT(plain, group)
    loss = model.loss(inp, labels)
    loss.backward()
    plain_params = dict(plain.named_parameters())
    scales = {f"blocks.{i}.k.bias": g.abs().sum((0, 1)) for i, g in key_grads.items()}
    grads = [(name, p.grad, tp_shard(name, plain_params[name].grad, p, rank, tp),
              tp_shard(name, scales[name], p, rank, tp) if name in scales else None)
             for name, p in model.named_parameters()]
    assert sum(s is not None for *_, s in grads) == LAYERS
    return loss.detach(), ref.detach(), grads


def test_gpt_from_wrappers_matches_plain_pytorch():
    loss, ref, grads = gpt_parity()
    assert_close(loss, ref, msg="loss")
    for name, got, want, scale in grads:
        assert_close(got, want, scale=scale, msg=f"grad of {name}")


def test_gpt_parity_rejects_an_injected_error():
    """The tolerance above is not too loose: each real gradient with an error of 1e-4
    relative (all of it scaled, or one element moved by 1e-4 max|want|) fails. The key
    biases' gradients (rounding noise around zero) have no relative error to inject."""
    loss, ref, grads = gpt_parity()
    assert_catches_injected_errors(loss, ref, msg="loss")
    for name, got, want, scale in grads:
        if scale is None:
            assert_catches_injected_errors(got, want, msg=f"grad of {name}")


def test_cross_entropy_label_smoothing_and_ignore_index():
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    full = torch.randn(5, 3, 8 * tp, generator=g, dtype=torch.float64, requires_grad=True)
    target = torch.randint(8 * tp, (5, 3), generator=g)
    target[0, 1] = -100
    shard = full.detach().chunk(tp, -1)[rank].clone().requires_grad_(True)
    megatorch.reset_comm_stats(group.group_name)
    for smoothing in (0.0, 0.1):
        loss = vocab_parallel_cross_entropy(shard, target, group, smoothing, -100)
        ref = F.cross_entropy(full.reshape(-1, 8 * tp), target.reshape(-1), reduction="none", ignore_index=-100,
                              label_smoothing=smoothing).view(5, 3)
        assert_close(loss, ref.float(), msg=f"loss, smoothing {smoothing}")
        weights = torch.arange(15, dtype=torch.float64).view(5, 3)
        (loss * weights).sum().backward()
        (ref * weights).sum().backward()
        assert_close(shard.grad, full.grad.chunk(tp, -1)[rank], msg=f"grad, smoothing {smoothing}")
        shard.grad, full.grad = None, None
    stats = megatorch.comm_stats(group.group_name)
    if tp > 1:  # three all-reduces per loss; backward communicates nothing
        assert stats["all_reduce"]["calls"] == 6
        assert stats["total"]["calls"] == 6
        assert stats["all_reduce"]["bytes"] == 3 * 15 * 4 + (15 * 4 + 2 * 15 * 4 + 15 * 4)


def test_sequence_parallel_column_then_row():
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    fc1, fc2 = nn.Linear(H, FFN), nn.Linear(FFN, H)
    x = torch.randn(S * tp, B, H, requires_grad=True)  # [s, b, h]
    ref = fc2(torch.relu(fc1(x)))
    ref.sum().backward()
    col = ColumnParallelLinear.from_dense(fc1, group, sequence_parallel=True)
    row = RowParallelLinear.from_dense(fc2, group, sequence_parallel=True)
    x_shard = x.detach().chunk(tp, 0)[rank].clone().requires_grad_(True)
    out = row(torch.relu(col(x_shard)))  # [s/tp, b, h]
    out.sum().backward()
    assert_close(out, ref.chunk(tp, 0)[rank], msg="output")
    assert_close(x_shard.grad, x.grad.chunk(tp, 0)[rank], msg="grad of x")
    assert_close(col.weight.grad, fc1.weight.grad.chunk(tp, 0)[rank], msg="grad of fc1.weight")
    # The row bias sits in the sequence-parallel region: its grad is partial per rank.
    bias_grad = row.bias.grad.clone()
    dist.all_reduce(bias_grad)
    assert_close(bias_grad, fc2.bias.grad, msg="grad of fc2.bias")


def _saved_tensors(fn):
    """The tensors autograd saves while fn() runs (torch.autograd.graph.saved_tensors_hooks)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


@pytest.mark.parametrize("bias", [True, False])
def test_sequence_parallel_column_saves_the_shard_and_regathers_it(bias):
    """Under SP the column-parallel op saves its [s/t, b, h] input shard and the weight, not
    the all-gathered [s, b, h] input that gather_from_sp_region + linear saves, and gathers the
    shard again in backward: one all-gather forward; one all-gather and one reduce-scatter of
    the [s, b, h] input gradient backward. Output and gradients equal the composition's."""
    group = dist.group.WORLD
    rank, tp = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(S, B, H, generator=g)
    w = torch.randn(FFN // tp, H, generator=g)
    b = torch.randn(FFN // tp, generator=g) if bias else None
    grad = torch.randn(S * tp, B, FFN // tp, generator=g)

    def leaves():
        return (x.clone().requires_grad_(True), w.clone().requires_grad_(True),
                b.clone().requires_grad_(True) if bias else None)

    rx, rw, rb = leaves()
    ref, ref_saved = _saved_tensors(
        lambda: F.linear(torch.ops.megatorch.gather_from_sp_region(rx, group.group_name), rw, rb))
    # The composition keeps the gathered input (a view of it), tp times the shard.
    assert any(t.numel() == tp * x.numel() and t.untyped_storage().data_ptr() != rw.untyped_storage().data_ptr()
               for t in ref_saved)
    ref.backward(grad)

    mx, mw, mb = leaves()
    megatorch.reset_comm_stats(group.group_name)
    out, saved = _saved_tensors(
        lambda: torch.ops.megatorch.column_parallel_linear(mx, mw, mb, group.group_name, False, True))
    assert [t.shape for t in saved] == [mx.shape, mw.shape]
    assert saved[0].untyped_storage().data_ptr() == mx.untyped_storage().data_ptr()
    assert saved[1].untyped_storage().data_ptr() == mw.untyped_storage().data_ptr()
    fwd = megatorch.comm_stats(group.group_name)
    out.backward(grad)
    stats = megatorch.comm_stats(group.group_name)
    if tp > 1:
        assert (fwd["all_gather"]["calls"], fwd["all_gather"]["bytes"], fwd["total"]["calls"]) == (1, x.nbytes, 1)
        assert (stats["all_gather"]["calls"], stats["all_gather"]["bytes"]) == (2, 2 * x.nbytes)
        assert (stats["reduce_scatter"]["calls"], stats["reduce_scatter"]["bytes"]) == (1, tp * x.nbytes)
        assert stats["total"]["calls"] == 3
    # Bit for bit: the op runs the composition's GEMMs (at::linear forward; backward the mm
    # and sum_to that autograd runs for it, on the same re-gathered values) and collectives.
    assert torch.equal(out, ref)
    for name, got, want in [("x", mx, rx), ("w", mw, rw)] + ([("b", mb, rb)] if bias else []):
        assert torch.equal(got.grad, want.grad), f"grad of {name}: max |diff| {(got.grad - want.grad).abs().max()}"


def test_opcheck_sequence_parallel_column():
    """Fake and functional tensors (torch.compile, opcheck) take the gather + linear composition."""
    g = torch.Generator().manual_seed(6)
    tp = dist.get_world_size()
    args = (torch.randn(2, 3, 4, generator=g, requires_grad=True), torch.randn(2, 4, generator=g, requires_grad=True),
            torch.randn(2, generator=g, requires_grad=True), dist.group.WORLD.group_name, False, True)
    torch.library.opcheck(torch.ops.megatorch.column_parallel_linear.default, args)
    assert torch.ops.megatorch.column_parallel_linear(*args).shape == (2 * tp, 3, 2)


def _op_args(name, tp):
    g = torch.Generator().manual_seed(5)
    group = dist.group.WORLD.group_name
    if name == "column_parallel_linear":
        return (torch.randn(2 * tp, 3, 4, generator=g, requires_grad=True),
                torch.randn(2, 4, generator=g, requires_grad=True), torch.randn(2, generator=g, requires_grad=True),
                group, True, False)
    if name == "row_parallel_linear":
        return (torch.randn(2 * tp, 3, 2, generator=g, requires_grad=True),
                torch.randn(4, 2, generator=g, requires_grad=True), torch.randn(4, generator=g, requires_grad=True),
                group, True, True)
    if name == "vocab_parallel_embedding":
        return (torch.randint(6 * tp, (3, 4), generator=g), torch.randn(6, 5, generator=g, requires_grad=True), group)
    return (torch.randn(3, 4, 6, generator=g, requires_grad=True), torch.randint(6 * tp, (3, 4), generator=g), group,
            0.1, -100)


@pytest.mark.parametrize("name", ["column_parallel_linear", "row_parallel_linear", "vocab_parallel_embedding",
                                  "vocab_parallel_cross_entropy"])
def test_opcheck(name):
    torch.library.opcheck(getattr(torch.ops.megatorch, name).default, _op_args(name, dist.get_world_size()))
