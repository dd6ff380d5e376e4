"""A flag given twice takes its last value, as in Megatron's argparse (launch scripts append
overrides to shared arguments), and the override is named once on stderr. The parser itself:
tests/cpp/test_cli_last_wins.cpp; gpt_pretrain's startup line: test_bad_arguments.py; the one
cumulative flag, megatorch-generate's --prompt: test_generate.py (six --prompt, six answers).
Each case here is one fast process."""
import json
import os
import subprocess
from pathlib import Path

import pytest

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))


def run(tool, *args):
    path = BIN / tool
    if not path.exists():
        pytest.skip(f"{path} not built (scripts/build.sh)")
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    return subprocess.run([str(path), *args], capture_output=True, text=True, timeout=120, env=env)


def test_schedule_takes_the_last_value_of_each_flag():
    # -p and --pipeline-model-parallel-size are one option; the second list of flags overrides the first.
    out = run("megatorch-schedule", "-p", "4", "--num-microbatches", "8", "--json", "--schedule", "gpipe",
              "--pipeline-model-parallel-size", "2", "--num-microbatches", "4", "--schedule", "1f1b")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # the override lines stay off stdout
    assert len(report["peak_inflight"]) == 2
    assert report["peak_inflight"] == [2, 1]  # 1F1B, not GPipe's m in flight
    assert report["makespan"] == (4 + 1) * 3
    lines = out.stderr.splitlines()
    for line in ["megatorch-schedule: --pipeline-model-parallel-size given 2 times; using the last: 2 (overrides 4)",
                 "megatorch-schedule: --num-microbatches given 2 times; using the last: 4 (overrides 8)",
                 "megatorch-schedule: --schedule given 2 times; using the last: 1f1b (overrides gpipe)"]:
        assert lines.count(line) == 1, out.stderr
    assert len(lines) == 3, out.stderr


def test_flags_given_once_print_nothing_more():
    out = run("megatorch-schedule", "-p", "2", "-m", "4", "--json")
    assert out.returncode == 0 and out.stderr == "", out.stderr


def test_plan_keeps_contradicting_flags_an_error():
    base = ["--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
            "--vocab-size", "1000", "--nodes", "1", "--gpus-per-node", "2", "--global-batch-size", "8"]
    out = run("megatorch-plan", *base, "--top", "5", "--json", "--top", "1")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["top"]) == 1
    assert out.stderr.count("megatorch-plan: --top given 2 times; using the last: 1 (overrides 5)") == 1, out.stderr
    out = run("megatorch-plan", *base, "--fp16", "--bf16")
    assert out.returncode != 0
    assert "--fp16 and --bf16 contradict each other" in out.stderr, out.stderr
