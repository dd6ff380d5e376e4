"""Bad launches are real processes that fail fast with one clear message."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
DEMO = BIN / "comm_demo"
GOOD = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
LAUNCH_VARS = list(GOOD) + ["TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args, env_over, timeout=60):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update({k: v for k, v in env_over.items() if v is not None})
    start = time.monotonic()
    out = subprocess.run([str(DEMO), *args], env=env, capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - start


@pytest.mark.parametrize("over, message", [
    ({"RANK": None}, "expected environment variable RANK (set by torchrun)"),
    ({"WORLD_SIZE": "two"}, "expected environment variable WORLD_SIZE to be an integer, got 'two'"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "expected RANK in [0, WORLD_SIZE) = [0, 2), got 3"),
    ({"MASTER_ADDR": None}, "MASTER_ADDR"),
    ({"MASTER_PORT": "port"}, "MASTER_PORT to be an integer, got 'port'"),
])
def test_missing_or_garbled_environment(over, message):
    out, took = run([], {**GOOD, **over})
    assert out.returncode != 0
    assert message in out.stderr
    assert took < 10


def test_world_not_divisible_by_tp_pp_fails_on_every_rank():
    # Every rank validates before connecting: no rendezvous partner needed.
    for rank in range(3):
        out, took = run(["--tensor-model-parallel-size", "2"],
                        {**GOOD, "RANK": str(rank), "WORLD_SIZE": "3", "MASTER_PORT": str(free_port())})
        assert out.returncode != 0
        assert "expected the world size to be divisible by tensor-model-parallel-size x " \
               "pipeline-model-parallel-size = 2 x 1 = 2, got world size 3" in out.stderr
        assert took < 10


def test_unreachable_master_fails_within_the_timeout():
    out, took = run([], {**GOOD, "RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": str(free_port()),
                         "MEGATORCH_COMM_TIMEOUT_S": "3"})
    assert out.returncode != 0
    assert "could not reach the rendezvous store at MASTER_ADDR:MASTER_PORT = 127.0.0.1:" in out.stderr
    assert took < 3 + 10


def test_bad_sizes_under_torchrun_fail_on_every_rank_at_once():
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "--no-python", str(DEMO), "--pipeline-model-parallel-size", "4"],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    took = time.monotonic() - start
    assert out.returncode != 0
    both = out.stdout + out.stderr
    # torchrun stops the other worker as soon as one fails, so which rank gets to print
    # first varies; that every rank fails alone is shown by the test above.
    assert "= 1 x 4 = 4, got world size 2" in both
    assert took < 60  # torchrun's own start-up and teardown included
