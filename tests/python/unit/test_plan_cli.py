"""build/bin/megatorch-plan: flags, --json, --explain, errors, calibration round trip, and its
activation memory against what the real megatorch layer saves (scripts/activation_memory.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
CLI = str(BIN / "megatorch-plan")


def run(*args):
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=300)


def plan_json(*args):
    out = run(*args, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_preset_ranks_fitting_layouts():
    report = plan_json("--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "64", "--top", "4")
    assert report["model"]["parameters"] > 8e9
    assert report["cluster"]["gpus"] == 8
    top = report["top"]
    assert len(top) == 4 and top[0]["why_lost"] == "best"
    steps = [t["time"]["step_s"] for t in top]
    assert steps == sorted(steps)
    for t in top:
        lay = t["layout"]
        assert lay["tensor_model_parallel_size"] * lay["pipeline_model_parallel_size"] * lay["data_parallel_size"] == 8
        assert t["memory"]["total_bytes"] <= 80e9
    assert top[1]["why_lost"].startswith("+")


def test_fixed_knobs_are_honoured():
    report = plan_json("--model", "gpt3-175b", "--nodes", "16", "--global-batch-size", "512",
                       "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
                       "--virtual-pipeline-model-parallel-size", "2", "--zero-stage", "1", "--micro-batch-size", "1",
                       "--recompute-granularity", "selective", "--sequence-parallel")
    for t in report["top"]:
        assert t["layout"] == {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 8,
                               "data_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "zero_stage": 1,
                               "micro_batch_size": 1, "recompute_granularity": "selective", "sequence_parallel": True}
    assert len(report["top"]) == 1
    time = report["top"][0]["time"]
    assert time["bubble_fraction"] > 0  # from the simulator: p = 8, m = 256, v = 2
    assert time["step_s"] == pytest.approx(time["pipeline_s"] + time["dp_comm_s"])


def test_explain_prints_the_breakdown():
    out = run("--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "32", "--explain")
    assert out.returncode == 0, out.stderr
    for word in ["optimizer states", "activations", "pipeline bubble", "DP/ZeRO comm", "TP/SP comm", "why it lost"]:
        assert word in out.stdout


def test_inconsistent_layout_is_rejected():
    out = run("--model", "megatron-1t", "--nodes", "128", "--tensor-model-parallel-size", "8",
              "--pipeline-model-parallel-size", "64", "--data-parallel-size", "512")
    assert out.returncode != 0
    assert "TP*PP*DP = 8*64*512 = 262144 does not equal the 1024 GPUs" in out.stderr


def test_model_larger_than_memory_says_by_how_much():
    out = run("--model", "megatron-1t", "--nodes", "1", "--global-batch-size", "8")
    assert out.returncode != 0
    assert "no layout fits" in out.stderr and "short by" in out.stderr


def test_calibration_round_trip_changes_predictions(tmp_path):
    path = tmp_path / "calib.json"
    out = run("--calibrate", str(path), "--json")
    assert out.returncode == 0, out.stderr
    measured = json.loads(out.stdout)
    saved = json.loads(path.read_text())
    for key in ["matmul_efficiency", "matmul_half_width", "memory_bound_passes", "intra_node_efficiency",
                "inter_node_efficiency", "p2p_latency_s"]:
        assert saved[key] == measured[key]
    assert measured["measurements"]["matmul"]
    args = ["--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "32", "--tensor-model-parallel-size", "2",
            "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "1",
            "--micro-batch-size", "1", "--zero-stage", "1",
            "--recompute-granularity", "full", "--no-sequence-parallel"]
    default = plan_json(*args)
    calibrated = plan_json(*args, "--calibration", str(path))
    assert calibrated["calibration"]["matmul_efficiency"] == saved["matmul_efficiency"]
    assert calibrated["top"][0]["time"]["step_s"] != default["top"][0]["time"]["step_s"]
    # Same layout, same memory: calibration only changes time.
    assert calibrated["top"][0]["memory"] == default["top"][0]["memory"]
    bad = tmp_path / "bad.json"
    bad.write_text('{"matmul_efficiency": 0.5}')
    out = run(*args, "--calibration", str(bad))
    assert out.returncode != 0 and "matmul_half_width" in out.stderr


# ---- activation memory: the planner's per-layer prediction vs the real layer (t = 1)

def _measure(shape, setting):
    sys.path.insert(0, str(ROOT / "scripts"))
    import activation_memory as am  # noqa: E402  (needs megatorch.cpp)
    return am.measure_layer(am.layer_config(am.Shape(*shape), setting, 0.1), shape[1]).bytes


@pytest.mark.parametrize("shape", [(512, 1, 256, 8), (256, 2, 512, 8)])
@pytest.mark.parametrize("setting", ["none", "selective", "full"])
def test_activation_memory_matches_the_real_layer(shape, setting):
    s, b, h, a = shape
    measured = _measure(shape, setting)
    # One layer, one micro-batch in flight: the activation bytes are one layer's. fp32 on CPU,
    # where dropout keeps a 4-byte mask and attention runs SDPA's math path.
    report = plan_json("--num-layers", "1", "--hidden-size", str(h), "--num-attention-heads", str(a),
                       "--seq-length", str(s), "--vocab-size", "256", "--gpus-per-node", "1", "--nodes", "1",
                       "--global-batch-size", str(b), "--micro-batch-size", str(b), "--precision", "fp32",
                       "--recompute-granularity", setting, "--zero-stage", "0", "--mask-bytes", "4",
                       "--megatorch-activations", "--math-attention")
    predicted = report["top"][0]["memory"]["activation_bytes"]
    assert predicted == pytest.approx(measured, rel=0.05)
