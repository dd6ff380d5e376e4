"""megatorch.cpp's context-parallel surface: TransformerConfig's context_parallel_group and
cp_comm_type, and the layout functions context_parallel_positions / context_parallel_slice
(include/megatorch/transformer/context_parallel.h: the sequence cut into 2c chunks, CP rank
r holding chunks r and 2c-1-r, in that order). The attention itself is tested across ranks
in C++ (tests/cpp/test_mp_context_parallel*.cpp)."""
import pickle

import pytest
import torch
import torch.distributed as dist

import megatorch.cpp as mt
from tolerance import assert_close


def world_group():
    """A one-rank gloo world (as test_torchscript.py makes it) for a real ProcessGroup."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def test_config_defaults_have_no_context_parallelism():
    c = mt.TransformerConfig()
    assert c.context_parallel_group == "" and c.cp_comm_type == "p2p"
    assert c.to_dict()["context_parallel_group"] == "" and c.to_dict()["cp_comm_type"] == "p2p"


def test_config_round_trips_the_cp_fields():
    c = mt.TransformerConfig(hidden_size=32, num_attention_heads=4, context_parallel_group="run.cp", cp_comm_type="a2a")
    assert (c.context_parallel_group, c.cp_comm_type) == ("run.cp", "a2a")
    assert "context_parallel_group='run.cp'" in repr(c) and "cp_comm_type='a2a'" in repr(c)
    for again in [mt.TransformerConfig(**c.to_dict()), pickle.loads(pickle.dumps(c)), c.replace()]:
        assert again.to_dict() == c.to_dict()
    c.cp_comm_type = "P2P"  # case-insensitive, as the other enums
    c.context_parallel_group = None  # None: no context parallelism
    assert (c.context_parallel_group, c.cp_comm_type) == ("", "p2p")
    assert c.replace(cp_comm_type="a2a", context_parallel_group="g").to_dict()["cp_comm_type"] == "a2a"


def test_config_takes_a_process_group_as_its_name():
    group = world_group()
    c = mt.TransformerConfig(context_parallel_group=group)
    assert c.context_parallel_group == group.group_name != ""
    c.context_parallel_group = dist.group.WORLD
    assert c.context_parallel_group == group.group_name
    assert pickle.loads(pickle.dumps(c)).context_parallel_group == group.group_name


def test_config_rejects_bad_cp_values():
    with pytest.raises(ValueError, match="cp_comm_type: expected one of 'p2p', 'a2a', got 'ring'"):
        mt.TransformerConfig(cp_comm_type="ring")
    with pytest.raises(TypeError, match="TransformerConfig.cp_comm_type: cannot take a value of type"):
        mt.TransformerConfig(cp_comm_type=2)
    with pytest.raises(TypeError, match="TransformerConfig.context_parallel_group: expected a group name \\(str\\), "
                                        "a torch.distributed ProcessGroup or None, got <class 'int'>"):
        mt.TransformerConfig(context_parallel_group=3)


def test_validate_checks_the_cp_constraints():
    c = mt.TransformerConfig(hidden_size=32, num_attention_heads=4, seq_length=8)
    c.validate(1, 2)
    c.validate(tp_size=1, cp_size=4)
    with pytest.raises(RuntimeError, match="divisible by 2 x the context-parallel size"):
        c.validate(1, 3)
    c.replace(attention_dropout=0.1).validate(1, 2)  # keyed by position (attention_dropout.h)
    with pytest.raises(RuntimeError, match="Ulysses .* divisible by --context-parallel-size 3"):
        c.replace(cp_comm_type="a2a", seq_length=24).validate(1, 3)  # 4 heads over 3 ranks
    c.replace(cp_comm_type="a2a").validate(1, 4)  # 4 heads over 4 ranks
    c.replace(seq_length=24).validate(1, 3)  # the ring takes any c dividing S/2


def test_positions_two_ranks():
    assert mt.context_parallel_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert mt.context_parallel_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert mt.context_parallel_positions(8, 2, 0).dtype == torch.int64


def test_positions_cover_the_sequence_and_balance_the_causal_work():
    S = 24
    assert mt.context_parallel_positions(S, 1, 0).tolist() == list(range(S))
    for c in [2, 3, 4, 6]:
        L = S // (2 * c)
        held = [mt.context_parallel_positions(S, c, r) for r in range(c)]
        assert sorted(torch.cat(held).tolist()) == list(range(S))  # every token on exactly one rank
        for r, pos in enumerate(held):
            assert pos.tolist() == list(range(r * L, (r + 1) * L)) + list(range((2 * c - 1 - r) * L, (2 * c - r) * L))
            # Increasing: causal masking on global positions is lower-triangular on local ones.
            assert bool((pos[1:] > pos[:-1]).all())
            # Every rank's queries see the same number of keys under a causal mask.
            assert int((pos + 1).sum()) == (2 * c - 1) * L * L + L * (L + 1)


def test_slice_takes_the_positions_along_any_dim():
    x = torch.arange(2 * 16 * 3, dtype=torch.float32).view(2, 16, 3)
    for c in [1, 2, 4]:
        for r in range(c):
            pos = mt.context_parallel_positions(16, c, r)
            assert torch.equal(mt.context_parallel_slice(x, 1, c, r), x.index_select(1, pos))
            assert torch.equal(mt.context_parallel_slice(x.transpose(0, 1), 0, c, r), x.transpose(0, 1)[pos])
    parts = [mt.context_parallel_slice(x, -2, 4, r) for r in range(4)]
    assert torch.equal(torch.cat(parts, 1).sort(1).values, x)


def test_layout_errors_say_what_was_expected():
    with pytest.raises(RuntimeError, match=r"context_parallel_positions: expected the sequence length \(6\) to be "
                                           r"divisible by 2 x the context-parallel size \(2 x 2 = 4\)"):
        mt.context_parallel_positions(6, 2, 0)
    with pytest.raises(RuntimeError, match=r"expected a CP rank in \[0, 2\), got 2"):
        mt.context_parallel_positions(8, 2, 2)
    with pytest.raises(RuntimeError, match="expected a context-parallel size >= 1, got 0"):
        mt.context_parallel_positions(8, 0, 0)
    with pytest.raises(RuntimeError, match=r"context_parallel_slice: expected the sequence length \(6\)"):
        mt.context_parallel_slice(torch.zeros(2, 6), 1, 2, 0)
    with pytest.raises(RuntimeError, match=r"expected dim in \[-2, 2\)"):
        mt.context_parallel_slice(torch.zeros(2, 8), 2, 2, 0)
    assert mt.context_parallel_positions(6, 1, 0).tolist() == list(range(6))  # c = 1 takes any length


def test_a_one_rank_cp_group_reaches_the_cpp_layer():
    """context_parallel_group from Python reaches the C++ model: on a one-rank CP group the
    attention goes through context_parallel_attention (the ring, one step) and gives the loss
    and gradients of the model without CP (SDPA)."""
    group = world_group()
    ids = torch.randint(100, (2, 8), generator=torch.Generator().manual_seed(1))
    results = []
    for cp in [None, group]:
        model = mt.GPTModel(mt.TransformerConfig(hidden_size=32, num_attention_heads=4, num_layers=2, seq_length=8,
                                                 vocab_size=100, seed=3, context_parallel_group=cp))
        loss = model.loss(ids, ids.roll(-1, 1))
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters().items()}))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-6, atol=0)
    for k, g in results[0][1].items():
        assert_close(results[1][1][k], g, msg=k)
