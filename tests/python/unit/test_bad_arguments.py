"""build/bin/gpt_pretrain refuses a bad flag or environment value by name, before it builds
anything: a clean exit status (no signal), the flag in the message, no C++ backtrace.
One process (world size 1) per case, so the whole file runs in seconds."""
import os
import socket
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
TRAIN = BIN / "gpt_pretrain"
DATA = ROOT / "data" / "default" / "stdlib_docs_text_document"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "257", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
         "--data-path", str(DATA), "--eval-iters", "1", "--log-interval", "1", "--seed", "11",
         "--device", "cpu"]

pytestmark = pytest.mark.skipif(not TRAIN.exists(), reason=f"{TRAIN} not built (scripts/build.sh)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_flags(args):
    """MODEL with `args` ("--flag value" pairs or bare switches) replacing MODEL's own values
    (a flag given twice would take its last value anyway; this keeps the launch readable)."""
    given = {a for a in args if a.startswith("--")}
    base, i = [], 0
    while i < len(MODEL):
        if MODEL[i] in given:
            i += 2
            continue
        base.append(MODEL[i])
        i += 1
    return [*base, *args]


def run(args, env=None, timeout=120, replace=True):
    """gpt_pretrain as the only rank of a world of one (the variables torchrun would set);
    `args` after MODEL's flags, replacing them unless `replace` is false."""
    e = {k: v for k, v in os.environ.items() if k != "MEGATORCH_COMM_TIMEOUT_S"}
    e.update(dict(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())), **(env or {}))
    argv = with_flags(args) if replace else [*MODEL, *args]
    return subprocess.run([str(TRAIN), *argv], capture_output=True, text=True, timeout=timeout, env=e)


def assert_refused(out, name):
    # > 0: exited with an error; a signal (abort, segfault) shows as a negative code.
    assert out.returncode > 0, (out.returncode, out.stderr[-3000:])
    assert name in out.stderr, out.stderr[-3000:]
    assert "Exception raised from" not in out.stderr, out.stderr[-3000:]
    # The refusal is the value's, not CLI11's (a repeated flag or a value it cannot parse).
    assert "required but received" not in out.stderr, out.stderr[-3000:]


BAD_FLAGS = [
    ("--micro-batch-size", "0"),
    ("--global-batch-size", "-4"),
    ("--train-iters", "-1"),
    ("--seq-length", "0"),
    ("--hidden-size", "0"),
    ("--num-layers", "0"),
    ("--num-attention-heads", "0"),
    ("--lr-decay-iters", "-1"),
    ("--lr", "nan"), ("--lr", "inf"),
    ("--adam-beta1", "1"), ("--adam-beta1", "-0.1"), ("--adam-beta1", "nan"),
    ("--adam-beta2", "1"),
    ("--adam-eps", "0"), ("--adam-eps", "-1e-8"), ("--adam-eps", "inf"),
    ("--weight-decay", "-0.01"),
    ("--clip-grad", "-1"), ("--clip-grad", "inf"), ("--clip-grad", "nan"),
    ("--hidden-dropout", "1"), ("--hidden-dropout", "-0.1"),
    ("--attention-dropout", "1.5"),
    ("--initial-loss-scale", "0"), ("--initial-loss-scale", "inf"),
    ("--loss-scale-window", "0"),
    ("--hysteresis", "0"),
    ("--eval-iters", "-1"),
    ("--log-interval", "0"),
    ("--save-interval", "-1"),
    ("--eval-interval", "-1"),
    ("--tensor-model-parallel-size", "0"),
    ("--pipeline-model-parallel-size", "0"),
    ("--distributed-timeout-minutes", "inf"),
    ("--distributed-timeout-minutes", "-1"), ("--distributed-timeout-minutes", "1e-6"),
    ("--distributed-timeout-minutes", "1e300"),
    ("--split", "969,30,1e2"), ("--split", "+1,2,3"), ("--split", "-1,2,3"), ("--split", "969,,1"),
    ("--split", "1,2,3,4"), ("--split", "0,0,0"), ("--split", "1.2.3"), ("--split", "nan"),
]


@pytest.mark.parametrize("flag, value", BAD_FLAGS, ids=[f"{f}={v}" for f, v in BAD_FLAGS])
def test_bad_flag_refused_by_name(flag, value):
    # One iteration: a value that slipped through fails the test quickly, by exiting 0.
    assert_refused(run([flag, value] if flag == "--train-iters" else ["--train-iters", "1", flag, value]), flag)


def test_parallel_sizes_whose_product_overflows():
    # 2^32 x 2^32 wraps int64 to 0; multiplied, "world % 0" would divide by zero.
    out = run(["--tensor-model-parallel-size", str(2**32), "--pipeline-model-parallel-size", str(2**32)])
    assert_refused(out, "--tensor-model-parallel-size")
    out = run(["--tensor-model-parallel-size", str(2**62), "--pipeline-model-parallel-size", "4"])
    assert_refused(out, "--pipeline-model-parallel-size")


@pytest.mark.parametrize("value", ["garbage", "inf", "nan", "-5", "0", "1e-4", "1e300"])
def test_bad_comm_timeout_environment(value):
    assert_refused(run(["--train-iters", "1"], env={"MEGATORCH_COMM_TIMEOUT_S": value}), "MEGATORCH_COMM_TIMEOUT_S")


def test_eval_only_without_a_checkpoint(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for load in (empty, tmp_path / "missing"):
        out = run(["--eval-only", "--load", str(load)])
        assert_refused(out, "--eval-only")
        assert str(load) in out.stderr
        assert "validation loss" not in out.stdout.lower()


@pytest.mark.parametrize("split", ["969,30,1", "98,2,0", "100,0,0", "1", "969/30/1", "96.9, 3, 0.1"])
def test_good_values_still_train(split):
    """The control: the same launch with good values runs (a refusal above is the flag's)."""
    out = run(["--split", split, "--train-iters", "1", "--eval-iters", "0", "--distributed-timeout-minutes", "0.5",
               "--adam-beta1", "0", "--clip-grad", "0"], env={"MEGATORCH_COMM_TIMEOUT_S": "30"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


def test_schedule_names_are_the_pipelines():
    """--schedule goes through the pipeline's own parser (pipeline::find_schedule_kind), as the
    trainer and megatorch-schedule do: its aliases run, anything else is refused naming the
    accepted schedules."""
    out = run(["--train-iters", "1", "--schedule", "chimera"])
    assert_refused(out, "--schedule")
    assert "expected gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev, got 'chimera'" in out.stderr, \
        out.stderr[-3000:]
    out = run(["--train-iters", "1", "--eval-iters", "0", "--schedule", "PipeDream-Flush"])
    assert out.returncode == 0, out.stderr[-3000:]


def test_a_repeated_flag_takes_its_last_value(tmp_path):
    """Megatron's launch scripts append overrides to shared arguments ($COMMON_ARGS
    --global-batch-size 8): as argparse, the last value wins, a list flag's last list whole,
    and the startup log names each override once."""
    out = run(["--train-iters", "1", "--eval-iters", "0", "--global-batch-size", "8",
               "--data-path", str(tmp_path / "missing"), "--data-path", str(DATA)], replace=False)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "global batch 8 = micro-batch 2 x 4 micro-batches x dp 1" in out.stdout, out.stdout[-2000:]
    line = "[megatorch] gpt_pretrain: --global-batch-size given 2 times; using the last: 8 (overrides 4)"
    assert out.stdout.count(line) == 1, out.stdout[-3000:]
    line = (f"[megatorch] gpt_pretrain: --data-path given 3 times; using the last: {DATA} "
            f"(overrides {DATA}, {tmp_path / 'missing'})")
    assert out.stdout.count(line) == 1, out.stdout[-3000:]


@pytest.mark.parametrize("rank, printed", [("0", 0), ("1", 1)])
def test_overrides_are_logged_once_and_contradictions_still_refused(rank, printed):
    """The override line comes from the rank that prints the startup lines (the last), before
    anything connects; --fp16 with --bf16 is a contradiction, not an override, and stays an error."""
    out = run(["--global-batch-size", "8", "--fp16", "--bf16", "--fp16"], env={"RANK": rank, "WORLD_SIZE": "2"},
              replace=False)
    assert_refused(out, "--bf16 and --fp16 contradict each other")
    line = "[megatorch] gpt_pretrain: --global-batch-size given 2 times; using the last: 8 (overrides 4)"
    assert out.stdout.count(line) == printed, out.stdout[-3000:]
    assert out.stdout.count("--fp16 given 2 times") == printed, out.stdout[-3000:]
