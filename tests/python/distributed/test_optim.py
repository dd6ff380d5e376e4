"""megatorch.optim.DistributedOptimizer on a plain torch.nn model under torchrun: every
ZeRO stage (stage 3 through megatorch.nn.FullyShard) trains like torch.optim.AdamW on one
process with the full batch: the parameters after training agree to 1e-5 relative to each
tensor's magnitude (tolerance.assert_close; the gradients' sums run in another order)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import megatorch
from megatorch.nn import FullyShard
from megatorch.optim import DistributedOptimizer
from tolerance import assert_catches_injected_errors, assert_close

STEPS = 8
LR, WD = 1e-2, 0.05


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))


def global_batch(step, world):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(4 * world, 12, generator=g), torch.randint(0, 3, (4 * world,), generator=g)


def reference(world):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        x, y = global_batch(step, world)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def train(stage):
    """(model, optimizer, the one-process reference) after STEPS steps at `stage`, the
    ZeRO-3 units gathered."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    model = make_model()
    if stage == 3:
        model = FullyShard(model, group)
    opt = DistributedOptimizer(model.parameters(), group, zero_stage=stage, lr=LR, weight_decay=WD, bucket_size=100)
    for step in range(STEPS):
        x, y = global_batch(step, world)
        rows = slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        assert opt.step()
    ref = reference(world)
    inner = model.module if stage == 3 else model
    if stage == 3:  # bring the shards back together to compare
        for u in range(len(model._units)):
            opt._opt.gather_unit(u)
    return inner, opt, ref


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_matches_adamw_on_one_process(stage):
    inner, opt, ref = train(stage)
    for (name, got), want in zip(inner.named_parameters(), ref.parameters()):
        assert_close(got.detach(), want.detach(), msg=name)
    stats = opt.memory_stats()
    assert set(stats) >= {"param_bytes", "grad_bytes", "master_param_bytes", "optimizer_state_bytes",
                          "padding_bytes", "total_bytes"}
    psi = sum(p.numel() for p in ref.parameters())
    # fp32 AdamW: the states (8 bytes per element) are sharded from stage 1 on; padding aside.
    owned = stats["optimizer_state_bytes"] // 8
    if stage == 0:
        assert owned == psi
    else:
        total = torch.tensor([owned])
        dist.all_reduce(total)
        assert total.item() == psi


@pytest.mark.parametrize("stage", [1, 3])
def test_parameters_reject_an_injected_error(stage):
    """The comparison above is not too loose: each trained parameter with an error of 1e-4
    relative (all scaled, or one element moved by 1e-4 max|want|) fails it."""
    inner, _, ref = train(stage)
    for (name, got), want in zip(inner.named_parameters(), ref.parameters()):
        assert_catches_injected_errors(got.detach(), want.detach(), msg=name)


def test_state_dict_round_trip_and_errors():
    group = dist.group.WORLD
    model = make_model()
    opt = DistributedOptimizer(model.parameters(), group, zero_stage=1, lr=LR)
    x, y = global_batch(0, dist.get_world_size())
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    state = opt.state_dict()
    assert int(state["step"]) == 1
    opt.load_state_dict(state)
    with pytest.raises(RuntimeError, match="expected zero_stage in 0..3"):
        DistributedOptimizer(make_model().parameters(), group, zero_stage=5)
    with pytest.raises(ValueError, match="FullyShard"):
        DistributedOptimizer(make_model().parameters(), group, zero_stage=3)


class TinyLM(nn.Module):
    """The usual GPT layout: blocks in a ModuleList (never called itself) and the head
    tied to the embedding (one parameter used by two modules)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.embed = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def test_fully_shard_module_list_and_tied_weights():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    def batch(step):
        g = torch.Generator().manual_seed(200 + step)
        ids = torch.randint(0, 11, (2 * world, 5), generator=g)
        return ids, ids.roll(1, dims=1)

    ref = TinyLM()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    model = FullyShard(TinyLM(), group)
    # Units: the root (holding the tied weight, the embedding's and the head's only
    # parameter, so neither is a unit), the three blocks, the norm.
    assert len(model._units) == 1 + 3 + 1
    assert [p.shape for p in model._units[0]] == [torch.Size([11, 8])]
    opt = DistributedOptimizer(model.parameters(), group, zero_stage=3, lr=LR, weight_decay=WD, bucket_size=50)
    for step in range(STEPS):
        ids, labels = batch(step)
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(ids).flatten(0, 1), labels.flatten()).backward()
        ref_opt.step()
        rows = slice(2 * rank, 2 * rank + 2)
        opt.zero_grad()
        nn.functional.cross_entropy(model(ids[rows]).flatten(0, 1), labels[rows].flatten()).backward()
        assert opt.step()
    for u in range(len(model._units)):
        opt._opt.gather_unit(u)
    for (name, got), want in zip(model.module.named_parameters(), ref.parameters()):
        assert_close(got.detach(), want.detach(), msg=name)


def test_model_parallel_groups_and_counted_in_norm():
    """Each rank its own data-parallel group, the world as a model-parallel group holding
    replicated copies (as TP replicates norms): counted once, the global norm equals the
    one-process norm; counted on every rank it would be sqrt(world) times larger."""
    rank, world = dist.get_rank(), dist.get_world_size()
    alone = [dist.new_group([r]) for r in range(world)][rank]
    x, y = global_batch(0, 1)
    ref = make_model()
    nn.functional.cross_entropy(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf")).item()
    for counted, factor in ((rank == 0, 1.0), (True, world ** 0.5)):
        model = make_model()
        params = list(model.parameters())
        opt = DistributedOptimizer(params, alone, lr=LR, model_parallel_groups=[dist.group.WORLD],
                                   counted_in_norm=[counted] * len(params), decay=[p.dim() > 1 for p in params])
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        assert opt.grad_norm() == pytest.approx(want * factor, rel=1e-5)
    with pytest.raises(ValueError, match="one counted_in_norm flag per parameter"):
        DistributedOptimizer(make_model().parameters(), alone, counted_in_norm=[True])


class TwoHeads(nn.Module):
    """A unit returning a tuple: both outputs must gather the unit before their backward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        return self.a(x), self.b(x), "not a tensor"


def test_fully_shard_tuple_outputs_run_the_cpp_unit_schedule():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD

    def build():
        torch.manual_seed(3)
        return nn.Sequential(nn.Linear(4, 6), TwoHeads())

    def loss_of(model, x):
        a, b, tag = model(x)
        assert tag == "not a tensor"
        return (a * b).sum()

    ref = build()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    model = FullyShard(build(), group)
    opt = DistributedOptimizer(model.parameters(), group, zero_stage=3, lr=LR, weight_decay=WD, bucket_size=30)
    for step in range(4):
        x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(300 + step))
        ref_opt.zero_grad()
        (loss_of(ref, x) / world).backward()
        ref_opt.step()
        opt.zero_grad()
        loss_of(model, x[2 * rank:2 * rank + 2]).backward()
        assert opt.step()
    # Between uses each unit is back to its shard: nothing stays gathered.
    assert all(p.untyped_storage().nbytes() == 0 for u in model._units[1:] for p in u)
    for u in range(len(model._units)):
        opt._opt.gather_unit(u)
    for (name, got), want in zip(model.module.named_parameters(), ref.parameters()):
        assert_close(got.detach(), want.detach(), msg=name)


def test_gradient_accumulation_fusion_gives_the_same_parameters():
    """megatorch.cpp.GPTModel, tensor-parallel over the world, two micro-batches per step:
    with gradient_accumulation_fusion its layers' weight-gradient GEMMs add into the
    optimizer's buffer, and the parameters after three SGD steps are those of the unfused
    run within rounding (rtol 1e-5 of each tensor's magnitude)."""
    import megatorch.cpp as mt
    group = dist.group.WORLD
    world = dist.get_world_size()
    # Tensor parallel over every rank: each rank is a data-parallel group of its own.
    singles = [dist.new_group([r]) for r in range(world)]
    params = {}
    for fused in (False, True):
        config = mt.TransformerConfig(hidden_size=8 * world, num_attention_heads=world, num_layers=2, seq_length=8,
                                      vocab_size=64, seed=7, hidden_dropout=0.0, attention_dropout=0.0)
        model = mt.GPTModel(config, group=group)
        # SGD: its update is linear in the gradient, so a rounding difference stays one (Adam's
        # m / sqrt(v) makes a last-bit difference of a near-zero gradient a visible step).
        opt = DistributedOptimizer(model.parameters(), singles[dist.get_rank()], zero_stage=0, lr=LR, weight_decay=WD,
                                   clip_grad=1.0, sgd=True, gradient_accumulation_fusion=fused,
                                   model_parallel_groups=[group])
        for step in range(3):
            opt.zero_grad()
            for k in range(2):
                g = torch.Generator().manual_seed(10 * step + k)
                ids = torch.randint(0, 64, (2, 9), generator=g)
                opt.set_grad_sync(k == 1)
                (model.loss(ids[:, :-1], ids[:, 1:]) / 2).backward()
            assert opt.step()
        params[fused] = {k: v.detach().clone() for k, v in model.named_parameters().items()}
    assert params[True].keys() == params[False].keys()
    # Within rounding: a GEMM that accumulates into the buffer (beta = 1) may round its
    # sums differently from a GEMM plus an add on some BLAS paths (AMD EPYC's), and the
    # clipped norm carries a last-bit difference into every parameter.
    for name, value in params[False].items():
        assert_close(params[True][name], value, msg=name)
