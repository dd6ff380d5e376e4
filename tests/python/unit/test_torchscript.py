"""The operators are real TorchScript custom ops: a scripted module that calls them is
saved, loaded back in Python and with torch::jit::load in C++, and gives the same result."""
import os
import subprocess
from pathlib import Path

import torch
import torch.distributed as dist

import megatorch  # noqa: F401

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))


class Block(torch.nn.Module):
    """An MLP with a vocab-parallel head and loss, entirely through megatorch operators."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(16, 8, generator=g) * 0.1)
        self.w2 = torch.nn.Parameter(torch.randn(8, 16, generator=g) * 0.1)
        self.emb = torch.nn.Parameter(torch.randn(32, 8, generator=g) * 0.1)
        self.x = torch.randn(4, 2, 8, generator=g)
        self.target = torch.randint(32, (4, 2), generator=g)
        self.expected = torch.zeros(())

    def forward(self, x: torch.Tensor, target: torch.Tensor, group: str) -> torch.Tensor:
        h = torch.ops.megatorch.column_parallel_linear(x, self.w1, None, group, False, False)
        h = torch.ops.megatorch.row_parallel_linear(torch.relu(h), self.w2, None, group, True, False)
        h = torch.ops.megatorch.copy_to_tp_region(h, group)
        logits = torch.ops.megatorch.column_parallel_linear(h, self.emb, None, group, False, False)
        return torch.ops.megatorch.vocab_parallel_cross_entropy(logits, target, group, 0.0, -100).mean()


def test_script_save_load_python_and_cpp(tmp_path):
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD.group_name
    block = Block()
    eager = block(block.x, block.target, group)
    block.expected = eager.detach().clone()
    scripted = torch.jit.script(block)
    assert "megatorch::vocab_parallel_cross_entropy" in str(scripted.graph)
    path = tmp_path / "block.pt"
    scripted.save(str(path))
    loaded = torch.jit.load(str(path))
    torch.testing.assert_close(loaded(block.x, block.target, group), eager, rtol=0, atol=0)
    out = subprocess.run([str(BIN / "megatorch_jit_check"), str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "jit ok" in out.stdout
