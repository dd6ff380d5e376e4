"""build/bin/megatorch-plan: flags, --json, --explain, errors, calibration round trip, FP8,
pipeline schedules, context parallelism, and its activation memory against what the real
dense megatorch layer saves (scripts/activation_memory.py). Mixture of experts:
test_plan_cli_moe.py."""
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
        assert (lay["tensor_model_parallel_size"] * lay["context_parallel_size"] * lay["pipeline_model_parallel_size"]
                * lay["data_parallel_size"]) == 8
        assert lay["cp_comm_type"] == "p2p"
        assert t["memory"]["total_bytes"] <= 80e9
    assert top[1]["why_lost"].startswith("+")


def test_fixed_knobs_are_honoured():
    report = plan_json("--model", "gpt3-175b", "--nodes", "16", "--global-batch-size", "512",
                       "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
                       "--virtual-pipeline-model-parallel-size", "2", "--zero-stage", "1", "--micro-batch-size", "1",
                       "--recompute-granularity", "selective", "--sequence-parallel", "--context-parallel-size", "1")
    for t in report["top"]:
        assert t["layout"] == {"tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 8,
                               "data_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2, "zero_stage": 1,
                               "micro_batch_size": 1, "recompute_granularity": "selective", "sequence_parallel": True,
                               "context_parallel_size": 1, "cp_comm_type": "p2p", "schedule": "interleaved"}
    assert len(report["top"]) == 1
    time = report["top"][0]["time"]
    assert time["bubble_fraction"] > 0  # from the simulator: p = 8, m = 256, v = 2
    assert time["step_s"] == pytest.approx(time["pipeline_s"] + time["dp_comm_s"])


def test_fp8_prices_the_linear_gemms_at_the_fp8_peak():
    """--fp8-format: the same fixed layout's compute at 2x the GEMM rate for the linear
    layers (--fp8-peak-tflops 0) is shorter, and at --fp8-peak-tflops = --peak-tflops the same."""
    fixed = ["--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "64", "--tensor-model-parallel-size", "2",
             "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1", "--zero-stage", "1",
             "--context-parallel-size", "1", "--recompute-granularity", "selective", "--peak-tflops", "989"]
    compute = {}
    for name, extra in {"bf16": [], "fp8": ["--fp8-format", "hybrid"],
                        "fp8_at_bf16_rate": ["--fp8-format", "hybrid", "--fp8-peak-tflops", "989"]}.items():
        report = plan_json(*fixed, *extra)
        assert report["fp8"] == (name != "bf16")
        compute[name] = report["top"][0]["time"]["compute_s"]
    assert compute["fp8"] < 0.8 * compute["bf16"]
    assert compute["fp8_at_bf16_rate"] == pytest.approx(compute["bf16"], rel=1e-9)
    out = run(*fixed, "--fp8-format", "e5m2")
    assert out.returncode != 0 and "--fp8-format" in out.stderr


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
            "--micro-batch-size", "1", "--zero-stage", "1", "--context-parallel-size", "1",
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


# ---- pipeline schedules

PP_ARGS = ["--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "32", "--tensor-model-parallel-size", "2",
           "--pipeline-model-parallel-size", "4", "--context-parallel-size", "1", "--micro-batch-size", "1",
           "--zero-stage", "1", "--recompute-granularity", "selective", "--sequence-parallel"]


def with_batch(args, global_batch):
    i = args.index("--global-batch-size")
    return [*args[:i + 1], str(global_batch), *args[i + 2:]]


def test_schedule_is_searched_and_in_the_json():
    # m = p = 4 micro-batches: zb-h1 fills 1f1b's bubble with W.
    report = plan_json(*with_batch(PP_ARGS, 4), "--top", "10")
    schedules = [t["layout"]["schedule"] for t in report["top"]]
    assert {"1f1b", "zb-h1"} <= set(schedules)
    for t in report["top"]:
        lay = t["layout"]
        assert (lay["schedule"] == "interleaved") == (lay["virtual_pipeline_model_parallel_size"] > 1)
    best = {}
    for t in report["top"]:
        best.setdefault(t["layout"]["schedule"], t["time"])
    assert best["zb-h1"]["step_s"] < best["1f1b"]["step_s"]
    assert best["zb-h1"]["bubble_fraction"] < best["1f1b"]["bubble_fraction"]
    assert report["top"][0]["layout"]["schedule"] != "1f1b"
    fixed = plan_json(*with_batch(PP_ARGS, 4), "--schedule", "zero_bubble_h1")  # an alias of zb-h1
    assert {t["layout"]["schedule"] for t in fixed["top"]} == {"zb-h1"}
    assert fixed["top"][0]["time"] == best["zb-h1"]
    # m = 32 on NCCL: the executor's channels hold no compute behind a send, so zb-h1 keeps
    # its simulated bubble, below 1f1b's, and the V schedules are searched too.
    report = plan_json(*PP_ARGS, "--top", "20")
    assert set(t["layout"]["schedule"] for t in report["top"]) == {"1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}
    zb = next(t["time"] for t in report["top"] if t["layout"]["schedule"] == "zb-h1")
    one = next(t["time"] for t in report["top"] if t["layout"]["schedule"] == "1f1b")
    assert zb["simulated_bubble_fraction"] == zb["bubble_fraction"] < one["bubble_fraction"]
    assert one["simulated_bubble_fraction"] == one["bubble_fraction"]
    assert zb["step_s"] < one["step_s"]


def explained_schedules(out):
    """{schedule: (bubble, simulated bubble or None, {F, B, W ticks}, chosen)} from --explain."""
    rows = {}
    for line in out.splitlines():
        words = line.split()
        if words and words[0] in ("1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev") and "bubble" in words:
            at = words.index("bubble")
            sim = float(words[at + 3].rstrip(")")) if words[at + 2] == "(simulated" else None
            f = words.index("F")
            ticks = {words[i]: int(words[i + 1]) for i in range(f, f + 6, 2)}
            rows[words[0]] = (float(words[at + 1]), sim, ticks, line.endswith("<- chosen"))
    return rows


def test_explain_lists_each_schedules_bubble():
    out = run(*PP_ARGS, "--virtual-pipeline-model-parallel-size", "1", "--explain")
    assert out.returncode == 0, out.stderr
    assert "TP=2 PP=4 DP=1 ZeRO-1 mb=1 recompute=selective SP" in out.stdout
    assert "pipeline schedules at PP=4, 32 micro-batches" in out.stdout
    rows = explained_schedules(out.stdout)
    assert set(rows) == {"1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}
    p, m = 4, 32
    assert rows["1f1b"][0] == pytest.approx((p - 1) / m, abs=5e-5) and rows["1f1b"][1] is None
    assert rows["interleaved"][0] == pytest.approx((p - 1) / (2 * m), abs=5e-5)
    t = rows["zb-h1"][2]
    assert 0 < t["W"] <= min(t["F"], t["B"])
    # Qi et al.'s bubble on NCCL too (no "(simulated ...)": planned and simulated agree).
    assert rows["zb-h1"][0] == pytest.approx((p - 1) * (t["F"] + t["B"] - t["W"]) / (m * (t["F"] + t["B"] + t["W"])),
                                              abs=5e-5)
    assert all(r[1] is None for r in rows.values())
    assert rows["zb-h1"][0] < rows["1f1b"][0]
    assert not rows["1f1b"][3]
    # At m = p zb-h1 is chosen, and its flags name it.
    out = run(*with_batch(PP_ARGS, 4), "--virtual-pipeline-model-parallel-size", "1", "--explain")
    assert out.returncode == 0, out.stderr
    assert "TP=2 PP=4 DP=1 ZeRO-1 mb=1 recompute=selective SP sched=zb-h1" in out.stdout
    rows = explained_schedules(out.stdout)
    assert rows["zb-h1"][3] and rows["zb-h1"][0] < rows["1f1b"][0]
    assert ("gpt_pretrain flags: --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --micro-batch-size 1 "
            "--global-batch-size 4 --zero-stage 1 --recompute-granularity selective --sequence-parallel "
            "--schedule zb-h1 --bf16") in out.stdout


def test_full_recompute_keeps_1f1b():
    args = [a if a != "selective" else "full" for a in PP_ARGS]
    report = plan_json(*args, "--virtual-pipeline-model-parallel-size", "1")
    assert {t["layout"]["schedule"] for t in report["top"]} == {"1f1b"}
    out = run(*args, "--virtual-pipeline-model-parallel-size", "1", "--explain")
    assert "zb-h1        not planned: no weight gradients to defer (W = 0 ticks" in out.stdout


def test_schedule_conflicts_are_named():
    out = run("--model", "llama3-8b", "--nodes", "1", "--schedule", "zb-h1", "--zero-stage", "3")
    assert out.returncode == 0, out.stderr  # ZeRO-3 runs the split backward too
    out = run(*PP_ARGS, "--schedule", "zb-h1", "--virtual-pipeline-model-parallel-size", "2")
    assert out.returncode != 0 and "runs one model chunk per stage: expected VP=1, got VP=2" in out.stderr
    out = run(*PP_ARGS, "--schedule", "ring")
    assert out.returncode != 0 and "gpipe, 1f1b, interleaved, zb-h1, zb-v or dualpipev, got 'ring'" in out.stderr
    out = run(*PP_ARGS, "--distributed-backend", "mpi")
    assert out.returncode != 0 and "expected --distributed-backend 'nccl' or 'gloo', got 'mpi'" in out.stderr


def test_v_schedules_are_planned_on_nccl():
    out = run(*PP_ARGS, "--schedule", "zb-v", "--explain")  # --distributed-backend nccl, the default
    assert out.returncode == 0, out.stderr
    assert "p2p over NCCL" in out.stdout
    assert "TP=2 PP=4 DP=1 ZeRO-1 mb=1 recompute=selective SP sched=zb-v" in out.stdout
    assert ("gpt_pretrain flags: --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --micro-batch-size 1 "
            "--global-batch-size 32 --zero-stage 1 --recompute-granularity selective --sequence-parallel "
            "--schedule zb-v --bf16") in out.stdout
    # The same plan as on Gloo, but for the flag naming the backend.
    nccl = plan_json(*PP_ARGS, "--top", "20")
    gloo = plan_json(*PP_ARGS, "--distributed-backend", "gloo", "--top", "20")
    assert nccl["distributed_backend"] == "nccl"
    assert [t["time"] for t in nccl["top"]] == [t["time"] for t in gloo["top"]]
    assert {"zb-v", "dualpipev"} <= {t["layout"]["schedule"] for t in nccl["top"]}


def test_v_schedules_on_gloo():
    gloo = [*PP_ARGS, "--distributed-backend", "gloo"]
    report = plan_json(*gloo, "--top", "20")
    assert report["distributed_backend"] == "gloo"
    by = {}
    for t in report["top"]:
        by.setdefault(t["layout"]["schedule"], t)
    assert {"1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"} <= set(by)
    p, m = 4, 32
    for name, chunks in (("zb-v", 2 * p), ("dualpipev", 2 * p + 1)):
        t = by[name]
        assert t["layout"]["virtual_pipeline_model_parallel_size"] == 1  # the V's two chunks come with it
        assert t["time"]["peak_inflight_chunks"] == chunks
        assert t["memory"]["inflight_microbatches"] == chunks / 2
        assert t["memory"]["stage"] == 0 and t["memory"]["logits_bytes"] > 0  # the head is rank 0's
        assert t["time"]["bubble_fraction"] == t["time"]["simulated_bubble_fraction"]
        assert t["time"]["bubble_fraction"] < by["1f1b"]["time"]["bubble_fraction"]
    # zb-h1 is timed as the simulator runs it: Qi et al.'s bubble.
    zb = by["zb-h1"]["time"]
    assert zb["bubble_fraction"] == zb["simulated_bubble_fraction"]
    # Fixed: the V only, and its flags name the schedule and the backend.
    fixed = plan_json(*gloo, "--schedule", "zb-v")
    assert {t["layout"]["schedule"] for t in fixed["top"]} == {"zb-v"}
    assert fixed["top"][0]["time"] == by["zb-v"]["time"]
    out = run(*gloo, "--schedule", "zb-v", "--explain")
    assert out.returncode == 0, out.stderr
    assert "TP=2 PP=4 DP=1 ZeRO-1 mb=1 recompute=selective SP sched=zb-v" in out.stdout
    assert ("gpt_pretrain flags: --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 --micro-batch-size 1 "
            "--global-batch-size 32 --zero-stage 1 --recompute-granularity selective --sequence-parallel "
            "--schedule zb-v --distributed-backend gloo --bf16") in out.stdout
    assert "p2p over Gloo" in out.stdout
    rows = explained_schedules(out.stdout)
    assert set(rows) == {"1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"}
    assert rows["zb-v"][3] and not rows["dualpipev"][3]
    assert rows["zb-v"][0] == pytest.approx(by["zb-v"]["time"]["bubble_fraction"], abs=5e-5)
    assert rows["dualpipev"][0] == pytest.approx(by["dualpipev"]["time"]["bubble_fraction"], abs=5e-5)
    assert all(r[1] is None for r in rows.values())  # planned and simulated bubbles agree
    # A chunk of the V is half a stage: the ticks of interleaved's chunks at VP 2.
    assert rows["zb-v"][2] == rows["dualpipev"][2] == rows["interleaved"][2]
    # What the V needs, named: 2 x PP micro-batches and 2 x PP dividing the layers.
    out = run(*with_batch(gloo, 4), "--schedule", "zb-v")
    assert out.returncode != 0 and "expected at least 8 micro-batches per step, got 4" in out.stderr
    out = run(*gloo, "--schedule", "dualpipev", "--num-layers", "36")
    assert out.returncode != 0 and "expected the 36 layers divisible by 8, got a remainder of 4" in out.stderr


# ---- context parallelism

CP_ARGS = ["--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "8", "--tensor-model-parallel-size", "4",
           "--pipeline-model-parallel-size", "1", "--virtual-pipeline-model-parallel-size", "1",
           "--micro-batch-size", "1", "--zero-stage", "1", "--recompute-granularity", "none", "--sequence-parallel"]


def test_context_parallel_layout_fields_and_memory():
    # 8192 tokens without recompute: 123 GB per GPU at CP 1, so a larger GPU to compare.
    one = plan_json(*CP_ARGS, "--context-parallel-size", "1", "--gpu-memory-gb", "200")["top"][0]
    two = plan_json(*CP_ARGS, "--context-parallel-size", "2", "--gpu-memory-gb", "200")["top"][0]
    assert one["layout"]["context_parallel_size"] == 1 and one["layout"]["data_parallel_size"] == 2
    assert two["layout"]["context_parallel_size"] == 2 and two["layout"]["data_parallel_size"] == 1
    assert two["layout"]["cp_comm_type"] == "p2p"
    # Activations and logits per rank halve; ZeRO shards over DP x CP = 2 either way.
    assert two["memory"]["activation_bytes"] == one["memory"]["activation_bytes"] / 2
    assert two["memory"]["logits_bytes"] == one["memory"]["logits_bytes"] / 2
    assert two["memory"]["optimizer_state_bytes"] == one["memory"]["optimizer_state_bytes"]
    assert one["time"]["cp_comm_s"] == 0 and two["time"]["cp_comm_s"] >= 0


def test_context_parallel_explain_shows_the_share_and_traffic():
    out = run(*CP_ARGS, "--context-parallel-size", "2", "--explain")
    assert out.returncode == 0, out.stderr
    assert "TP=4 CP=2(p2p) PP=1 DP=1" in out.stdout
    assert "4096 of 8192 tokens per CP rank" in out.stdout
    assert "rank r holds chunks r and 3-r: rank 0: 0 and 3, rank 1: 1 and 2" in out.stdout
    # 1 hop of K and V: 2 x b (S/c) (n_kv/t) d x 2 bytes = 2 x 4096 x 2 x 128 x 2.
    assert "forward 4.19 MB" in out.stdout and "backward 8.39 MB" in out.stdout
    out = run(*CP_ARGS, "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--explain")
    assert out.returncode == 0, out.stderr
    assert "a2a (Ulysses" in out.stdout and "none of it hidden" in out.stdout


def test_context_parallel_searched_when_not_fixed():
    report = plan_json("--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "64", "--top", "50")
    sizes = {t["layout"]["context_parallel_size"] for t in report["top"]}
    assert sizes <= {1, 2, 4, 8} and max(sizes) > 1  # S = 8192 without recompute: CP fits


def test_context_parallel_errors():
    # llama3-8b at TP 8: one key/value head per TP rank, which a2a cannot split over 2 ranks.
    out = run("--model", "llama3-8b", "--nodes", "2", "--tensor-model-parallel-size", "8",
              "--context-parallel-size", "2", "--cp-comm-type", "a2a")
    assert out.returncode != 0 and "a2a splits the heads" in out.stderr
    out = run("--model", "llama3-8b", "--nodes", "1", "--cp-comm-type", "ring")
    assert out.returncode != 0 and "'p2p' or 'a2a', got 'ring'" in out.stderr
    out = run("--model", "llama3-8b", "--nodes", "1", "--tensor-model-parallel-size", "2",
              "--pipeline-model-parallel-size", "2", "--data-parallel-size", "1", "--context-parallel-size", "4")
    assert out.returncode != 0 and "TP*CP*PP*DP = 2*4*2*1 = 16 does not equal the 8 GPUs" in out.stderr


# ---- activation memory: the planner's per-layer prediction vs the real layer (t = 1)

def _measure(shape, setting, attention_dropout=None):
    """One real layer's saved bytes; hidden dropout 0.1, attention dropout 0.1 unless given."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import activation_memory as am  # noqa: E402  (needs megatorch.cpp)
    config = am.layer_config(am.Shape(*shape), setting, 0.1, attention_dropout=attention_dropout)
    return am.measure_layer(config, shape[1]).bytes


def _planned_layer_bytes(shape, setting, *flags, dp=1):
    """megatorch-plan's activation bytes for one layer and one micro-batch in flight, fp32,
    at DP dp (dp > 1: room for expert tensor parallelism over the data-parallel ranks)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import activation_memory as am  # noqa: E402  (needs megatorch.cpp)
    return am.planned_layer_bytes(CLI, am.Shape(*shape), setting, *flags, dp=dp)


@pytest.mark.parametrize("shape", [(512, 1, 256, 8), (256, 2, 512, 8)])
@pytest.mark.parametrize("setting", ["none", "selective", "full"])
def test_activation_memory_matches_the_real_layer(shape, setting):
    measured = _measure(shape, setting)
    # One layer, one micro-batch in flight: the activation bytes are one layer's. fp32 on CPU,
    # where dropout keeps a 4-byte mask and attention runs SDPA's math path.
    predicted = _planned_layer_bytes(shape, setting, "--mask-bytes", "4", "--megatorch-activations",
                                     "--math-attention")
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("shape", [(512, 1, 256, 8), (256, 2, 512, 8)])
@pytest.mark.parametrize("setting", ["none", "selective", "full"])
def test_flash_attention_activation_memory_equals_the_real_layer(shape, setting):
    """Attention dropout 0: the layer runs SDPA's flash kernel (no s x s scores, an fp32
    log-sum-exp per query and head). --flash-attention counts exactly that: to the byte."""
    measured = _measure(shape, setting, attention_dropout=0.0)
    predicted = _planned_layer_bytes(shape, setting, "--mask-bytes", "4", "--megatorch-activations",
                                     "--flash-attention")
    assert predicted == measured
    # Without recompute the paper's score term is what separates the two counts.
    if setting == "none":
        s, b, h, a = shape
        paper = _planned_layer_bytes(shape, setting, "--mask-bytes", "4", "--megatorch-activations")
        assert paper - predicted == (2 * 4 + 4) * a * s * s * b - 4 * a * s * b


def test_flash_and_math_attention_are_refused_together():
    out = run("--num-layers", "1", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "512",
              "--gpus-per-node", "1", "--nodes", "1", "--global-batch-size", "1", "--math-attention",
              "--flash-attention")
    assert out.returncode != 0
    assert "got both flash_attention and math_attention" in out.stderr and "not both" in out.stderr


def test_mean_document_length_counts_packed_attention():
    """--mean-document-length: packed documents' attention is each document's square, so a
    long-sequence layout computes less; 0 (the default) is one document per sequence."""
    fixed = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "32768",
             "--nodes", "1", "--gpus-per-node", "1", "--global-batch-size", "1", "--tensor-model-parallel-size", "1",
             "--pipeline-model-parallel-size", "1", "--micro-batch-size", "1", "--recompute-granularity", "full",
             "--context-parallel-size", "1"]
    whole = plan_json(*fixed)["top"][0]["time"]["compute_s"]
    assert plan_json(*fixed, "--mean-document-length", "0")["top"][0]["time"]["compute_s"] == whole
    packed = plan_json(*fixed, "--mean-document-length", "512")["top"][0]["time"]["compute_s"]
    assert packed < 0.5 * whole  # attention dominates at 32k tokens
    out = run(*fixed, "--mean-document-length", "-5")
    assert out.returncode != 0 and "--mean-document-length" in out.stderr
