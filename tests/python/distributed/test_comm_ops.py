"""torch.ops.megatorch mappings with groups made by torch.distributed.new_group.

Inputs are rank-valued (rank q holds f(q)), so every rank can write down the exact
expected forward and backward of every mapping from the table below."""
import os

import pytest
import torch
import torch.distributed as dist

import megatorch

S, B, H = 4, 2, 3


def groups():
    """The world group, and (at 4 ranks) the pair [0,1] / [2,3] this rank is in."""
    world = dist.get_world_size()
    out = [("world", dist.group.WORLD)]
    if world > 2 and world % 2 == 0:
        pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)]  # collective: every rank
        out.append(("pairs", pairs[dist.get_rank() // 2]))
    return out


GROUPS = None


def group_params():
    global GROUPS
    if GROUPS is None:  # made on first use, by every rank at the same point
        GROUPS = groups()
    return GROUPS


def f(q, shape):
    """Rank q's value: element index along each dim, offset by 1000 q."""
    s, b, h = shape
    return (torch.arange(s).view(s, 1, 1) * 100 + torch.arange(h).view(1, 1, h) + torch.zeros(1, b, 1)
            + 1000 * q).double()


def chunk(t, n, r, dim):
    return t.chunk(n, dim)[r]


def cat(ts, dim):
    return torch.cat(ts, dim)


# name: (forward(inputs of all ranks, n, r), backward(grads of all ranks, n, r),
#        fwd collective, bwd collective); bytes checked against the payload rule.
TABLE = {
    "copy_to_tp_region": (lambda xs, n, r: xs[r], lambda gs, n, r: sum(gs), None, "all_reduce"),
    "reduce_from_tp_region": (lambda xs, n, r: sum(xs), lambda gs, n, r: gs[r], "all_reduce", None),
    "scatter_to_tp_region": (lambda xs, n, r: chunk(xs[r], n, r, -1), lambda gs, n, r: cat(gs, -1), None,
                             "all_gather"),
    "gather_from_tp_region": (lambda xs, n, r: cat(xs, -1), lambda gs, n, r: chunk(gs[r], n, r, -1), "all_gather",
                              None),
    "scatter_to_sp_region": (lambda xs, n, r: chunk(xs[r], n, r, 0), lambda gs, n, r: cat(gs, 0), None,
                             "all_gather"),
    "gather_from_sp_region": (lambda xs, n, r: cat(xs, 0), lambda gs, n, r: chunk(sum(gs), n, r, 0), "all_gather",
                              "reduce_scatter"),
    "reduce_scatter_to_sp_region": (lambda xs, n, r: chunk(sum(xs), n, r, 0), lambda gs, n, r: cat(gs, 0),
                                    "reduce_scatter", "all_gather"),
}


@pytest.mark.parametrize("name", list(TABLE))
@pytest.mark.parametrize("which", ["world", "pairs"] if int(os.environ.get("WORLD_SIZE", 1)) >= 4 else ["world"])
def test_mapping_forward_backward_and_bytes(name, which):
    pg = dict(group_params())[which]
    gname, n, r = pg.group_name, dist.get_world_size(pg), dist.get_rank(pg)
    fwd, bwd, fwd_op, bwd_op = TABLE[name]
    shape = (S * n, B, H * n)
    x = f(r, shape).requires_grad_(True)
    megatorch.reset_comm_stats(gname)

    y = getattr(torch.ops.megatorch, name)(x, gname)
    assert torch.equal(y, fwd([f(q, shape) for q in range(n)], n, r))
    after_fwd = megatorch.comm_stats(gname)
    grads = [f(q + 7, y.shape) for q in range(n)]
    y.backward(grads[r])
    assert torch.equal(x.grad, bwd(grads, n, r))
    stats = megatorch.comm_stats(gname)

    expect_fwd = {fwd_op: x.numel() * 8} if fwd_op and n > 1 else {}
    expect_all = dict(expect_fwd)
    if bwd_op and n > 1:
        expect_all[bwd_op] = expect_all.get(bwd_op, 0) + y.numel() * 8
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        assert after_fwd[op]["bytes"] == expect_fwd.get(op, 0), (op, after_fwd)
        assert stats[op]["bytes"] == expect_all.get(op, 0), (op, stats)
    assert stats["total"]["calls"] == len(expect_all)


@pytest.mark.parametrize("name", list(TABLE))
def test_opcheck(name):
    gname = dist.group.WORLD.group_name
    n = dist.get_world_size()
    x = torch.randn(2 * n, 3, 2 * n, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.megatorch, name).default, (x, gname))


def tp_block(x: torch.Tensor, w: torch.Tensor, group: str) -> torch.Tensor:
    """A Megatron MLP skeleton: f, a column-parallel matmul, g."""
    h = torch.ops.megatorch.copy_to_tp_region(x, group)
    h = torch.ops.megatorch.gather_from_sp_region(h, group)
    h = torch.relu(h @ w)
    return torch.ops.megatorch.reduce_scatter_to_sp_region(h, group)


def _inputs():
    n, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(1234 + r)
    x = torch.randn(2, 3, 8, generator=g, requires_grad=True)
    w = torch.randn(8, 4 * n, generator=g, requires_grad=True)
    return x, w


def test_torch_compile_matches_eager():
    gname = dist.group.WORLD.group_name
    x, w = _inputs()
    ref = tp_block(x, w, gname)
    ref.sum().backward()
    ref_grads = (x.grad.clone(), w.grad.clone())
    x.grad = None
    w.grad = None
    compiled = torch.compile(tp_block, backend="aot_eager", fullgraph=True)
    out = compiled(x, w, gname)
    out.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    torch.testing.assert_close((x.grad, w.grad), ref_grads, rtol=0, atol=0)


def test_torchscript_save_load(tmp_path_factory):
    gname = dist.group.WORLD.group_name
    x, w = _inputs()
    scripted = torch.jit.script(tp_block)
    path = tmp_path_factory.mktemp(f"rank{dist.get_rank()}") / "tp_block.pt"
    torch.jit.script(ScriptedBlock()).save(str(path))
    loaded = torch.jit.load(str(path))
    eager = tp_block(x, w, gname)
    torch.testing.assert_close(scripted(x, w, gname), eager, rtol=0, atol=0)
    torch.testing.assert_close(loaded(x, w, gname), eager, rtol=0, atol=0)
    assert "megatorch::copy_to_tp_region" in str(loaded.inlined_graph)  # a real custom op, not Python


class ScriptedBlock(torch.nn.Module):
    def forward(self, x: torch.Tensor, w: torch.Tensor, group: str) -> torch.Tensor:
        return tp_block(x, w, group)


def test_a_name_registered_again_reaches_the_new_group():
    """The operators resolve a group name through a per-thread cache, checked against
    c10d's registry on every call: a name registered again reaches the new group, and a
    destroyed group's name fails by name."""
    c10d = torch._C._distributed_c10d
    world, rank = dist.get_world_size(), dist.get_rank()
    everyone = dist.new_group(list(range(world)))  # collective: every rank, same order
    alone = [dist.new_group([r]) for r in range(world)][rank]
    name = everyone.group_name
    x = torch.ones(2, 3, dtype=torch.float64, requires_grad=True)
    torch.ops.megatorch.copy_to_tp_region(x, name).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, world))  # backward all-reduced over every rank

    c10d._unregister_process_group(name)
    c10d._register_process_group(name, alone)
    x.grad = None
    torch.ops.megatorch.copy_to_tp_region(x, name).sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))  # this rank's group of one: nothing added

    c10d._unregister_process_group(name)
    c10d._register_process_group(name, everyone)
    dist.destroy_process_group(everyone)
    with pytest.raises(RuntimeError, match=f"registered under the name '{name}'"):
        torch.ops.megatorch.copy_to_tp_region(x, name)
