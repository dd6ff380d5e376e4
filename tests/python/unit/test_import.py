"""The package loads the library from anywhere and exposes the operators."""
import os
import subprocess
import sys

import pytest
import torch

import megatorch

MAPPINGS = ["copy_to_tp_region", "reduce_from_tp_region", "scatter_to_tp_region", "gather_from_tp_region",
            "scatter_to_sp_region", "gather_from_sp_region", "reduce_scatter_to_sp_region"]


def test_operators_exist_with_their_schemas():
    for name in MAPPINGS:
        op = getattr(torch.ops.megatorch, name).default
        assert str(op._schema) == f"megatorch::{name}(Tensor input, str group) -> Tensor"


def test_import_from_any_directory(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGATORCH_LIBRARY"}
    out = subprocess.run([sys.executable, "-c", "import megatorch, torch; print(megatorch.library_path()); "
                          "print(torch.ops.megatorch.copy_to_tp_region)"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "libmegatorch.so" in out.stdout


def test_library_override_must_exist(tmp_path):
    env = dict(os.environ, MEGATORCH_LIBRARY=str(tmp_path / "nope.so"))
    out = subprocess.run([sys.executable, "-c", "import megatorch"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "MEGATORCH_LIBRARY" in out.stderr and "nope.so" in out.stderr


def test_stats_of_an_unused_group_are_zero():
    stats = megatorch.comm_stats("never-used")
    assert set(stats) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "send", "recv", "barrier",
                          "all_to_all", "total"}
    assert all(v == {"calls": 0, "bytes": 0} for v in stats.values())


def test_unknown_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="registered under the name 'no-such-group'"):
        torch.ops.megatorch.reduce_from_tp_region(torch.ones(2), "no-such-group")
