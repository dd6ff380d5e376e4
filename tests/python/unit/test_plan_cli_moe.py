"""build/bin/megatorch-plan for mixture-of-experts models: the JSON and --explain fields,
the expert-parallel search, its errors, and the MoE layer's activation memory against what
the real megatorch layer saves (also at expert tensor parallelism 2 under torchrun;
scripts/activation_memory.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_plan_cli import ROOT, _planned_layer_bytes, plan_json, run

MIXTRAL = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--num-query-groups", "8",
           "--ffn-hidden-size", "14336", "--vocab-size", "32000", "--seq-length", "4096", "--swiglu",
           "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
           "--untie-embeddings-and-output-weights", "--num-experts", "8", "--moe-router-topk", "2"]
MOE_LAYOUT = ["--nodes", "8", "--global-batch-size", "256", "--tensor-model-parallel-size", "1",
              "--pipeline-model-parallel-size", "2", "--context-parallel-size", "1",
              "--virtual-pipeline-model-parallel-size", "1", "--micro-batch-size", "1", "--zero-stage", "1",
              "--recompute-granularity", "full"]


def test_moe_json_fields():
    report = plan_json(*MIXTRAL, *MOE_LAYOUT, "--expert-model-parallel-size", "8", "--top", "1")
    model = report["model"]
    # Mixtral 8x7B: 46.7B parameters, 12.9B active per token.
    assert model["parameters"] == 46702792704 and model["active_parameters"] == 12879925248
    assert model["expert_parameters"] == 32 * 8 * 3 * 4096 * 14336
    assert model["num_experts"] == 8 and model["moe_router_topk"] == 2 and model["num_moe_layers"] == 32
    assert model["moe_token_dispatcher_type"] == "alltoall" and model["moe_imbalance_margin"] == 1.0
    top = report["top"][0]
    lay = top["layout"]
    assert lay["expert_model_parallel_size"] == 8 and lay["expert_tensor_parallel_size"] == 1
    assert lay["expert_data_parallel_size"] == 32 // 8
    mem = top["memory"]
    # 16 MoE layers a stage, one of 8 experts each; ZeRO-1 over the 4 expert-DP ranks.
    assert mem["expert_parameters"] == 16 * 3 * 4096 * 14336
    assert mem["expert_param_bytes"] == 2 * mem["expert_parameters"]
    assert mem["expert_optimizer_state_bytes"] == 8 * mem["expert_parameters"] / 4
    assert mem["param_bytes"] == 2 * (mem["dense_parameters"] + mem["expert_parameters"])
    moe = top["moe"]
    # T = 4096 tokens, k = 2, h = 4096, bf16: (ep-1)/ep of the rows out and back, each way.
    assert moe["tokens_per_rank"] == 4096 and moe["routed_rows_per_rank"] == 8192
    assert moe["moe_dispatch_forward_bytes"] == 2 * 4096 * 2 * 4096 * 2 * 7 / 8
    assert moe["moe_dispatch_backward_bytes"] == moe["moe_dispatch_forward_bytes"]
    # Full recompute dispatches the forward again: 16 layers x 8 micro-batches x 3 passes.
    assert moe["moe_dispatch_bytes_per_step"] == 16 * 8 * 3 * moe["moe_dispatch_forward_bytes"]
    assert top["time"]["ep_comm_s"] > 0 and moe["moe_a2a_s"] == top["time"]["ep_comm_s"]
    # The margin: twice the rows on the busiest rank, twice its all-to-all.
    skewed = plan_json(*MIXTRAL, *MOE_LAYOUT, "--expert-model-parallel-size", "8", "--top", "1",
                       "--moe-imbalance-margin", "2")["top"][0]
    assert skewed["moe"]["moe_dispatch_forward_bytes"] == 2 * moe["moe_dispatch_forward_bytes"]
    assert skewed["time"]["ep_comm_s"] == pytest.approx(2 * top["time"]["ep_comm_s"])
    assert skewed["time"]["compute_s"] > top["time"]["compute_s"]


def test_moe_expert_parallel_size_is_searched():
    report = plan_json(*MIXTRAL, *MOE_LAYOUT, "--top", "200")
    sizes = {t["layout"]["expert_model_parallel_size"] for t in report["top"]}
    assert sizes <= {1, 2, 4, 8} and max(sizes) > 1
    for t in report["top"]:
        lay = t["layout"]
        stage = lay["tensor_model_parallel_size"] * lay["context_parallel_size"] * lay["data_parallel_size"]
        assert stage % lay["expert_model_parallel_size"] == 0
        assert lay["zero_stage"] <= 2


def test_dense_models_print_no_moe_fields():
    report = plan_json("--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "64", "--top", "2")
    assert not any(key.startswith(("num_experts", "moe_", "expert_", "active_")) for key in report["model"])
    for t in report["top"]:
        assert "moe" not in t and "ep_comm_s" not in t["time"] and "expert_parameters" not in t["memory"]
        assert "expert_model_parallel_size" not in t["layout"]
    out = run("--model", "llama3-8b", "--nodes", "1", "--global-batch-size", "32", "--explain")
    assert "EP comm" not in out.stdout and "mixture of experts" not in out.stdout and "EP=" not in out.stdout


def test_moe_explain_shows_the_expert_layout_and_dispatch():
    out = run(*MIXTRAL, *MOE_LAYOUT, "--expert-model-parallel-size", "8", "--explain")
    assert out.returncode == 0, out.stderr
    assert "(45097156608 in experts, 8 per MoE layer; 12879925248 active per token)" in out.stdout
    assert "EP=8 ZeRO-1" in out.stdout and "EP comm" in out.stdout
    assert "expert layout: EP=8 x EDP=4 over each stage's TP*CP*DP = 32 ranks" in out.stdout
    assert "1 of the 8 experts of each MoE layer per EP rank" in out.stdout
    assert "T = 4096; routed rows T x k = 8192" in out.stdout
    # 2 x 8192 rows x 4096 x 2 bytes x 7/8 = 117.44 MB each way.
    assert "forward 117.44 MB, backward 117.44 MB" in out.stdout
    assert "recompute" in out.stdout.split("dispatch per step")[1]


def test_moe_errors_name_the_flag():
    out = run(*MIXTRAL, *MOE_LAYOUT, "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "8")
    assert out.returncode != 0 and "EP*ETP = 8*8 = 64 does not divide the TP*CP*DP = 32 ranks" in out.stderr
    out = run(*MIXTRAL, *MOE_LAYOUT, "--moe-imbalance-margin", "0.5")
    assert out.returncode != 0 and "--moe-imbalance-margin >= 1" in out.stderr
    out = run(*MIXTRAL, *MOE_LAYOUT, "--moe-token-dispatcher-type", "ring")
    assert out.returncode != 0 and "'alltoall' or 'allgather', got 'ring'" in out.stderr
    out = run(*MIXTRAL[:-2], "--moe-router-topk", "9", *MOE_LAYOUT)
    assert out.returncode != 0 and "--moe-router-topk in [1, 8]" in out.stderr
    out = run(*MIXTRAL, *MOE_LAYOUT, "--expert-model-parallel-size", "16")
    assert out.returncode != 0 and "no valid layout" in out.stderr and "EP=16 does not divide the 8 experts" in out.stderr
    out = run(*MIXTRAL, "--nodes", "1", "--zero-stage", "3")
    assert out.returncode != 0 and "ZeRO-3 does not shard expert parameters" in out.stderr
    out = run("--model", "llama3-8b", "--nodes", "1", "--expert-model-parallel-size", "2")
    assert out.returncode != 0 and "--expert-model-parallel-size 1 for a dense model" in out.stderr


MOE_SHAPE = (64, 2, 32, 4)  # (s, b, h, a)


def _moe_config(setting, swiglu, bias, fused, shared, dtype=None, **groups):
    """`groups`: TransformerConfig's group fields (expert_tensor_parallel_group=...)."""
    import megatorch.cpp as mt  # noqa: E402  (needs the built extension)
    recompute = "selective" if "selective" in setting else "full" if "full" in setting else "none"
    s, b, h, a = MOE_SHAPE
    kw = dict(hidden_size=h, num_attention_heads=a, seq_length=s, hidden_dropout=0.1, attention_dropout=0.0,
              recompute=recompute, seed=1234, fused_kernels=fused, num_experts=4, moe_router_topk=2,
              moe_ffn_hidden_size=96, moe_shared_expert_intermediate_size=shared, add_bias_linear=bias,
              activation="swiglu" if swiglu else "gelu_tanh", **groups)
    if dtype is not None:
        kw["params_dtype"] = dtype
    return mt.TransformerConfig(**kw)


def _measure_moe_layer(config, dtype):
    """Bytes one MoE TransformerLayer saves for backward (scripts/activation_memory.py's count)."""
    return _moe_layer_saved(config, dtype)[0].bytes


def _moe_layer_saved(config, dtype):
    """(what one MoE TransformerLayer saves for backward: scripts/activation_memory.py's
    Measurement, the layer) after a forward and backward on a random [s, b, h] input."""
    import torch
    import megatorch.cpp as mt  # noqa: E402
    sys.path.insert(0, str(ROOT / "scripts"))
    import activation_memory as am  # noqa: E402
    layer = mt.TransformerLayer(config, None)
    layer.train()
    s, b, h, _ = MOE_SHAPE
    x = torch.randn(s, b, h, dtype=dtype, requires_grad=True)
    saved = am._SavedStorages({p.untyped_storage().data_ptr() for p in layer.parameters()}, {"layer input": x})
    with saved.hooks():
        y = layer(x)
    y.float().sum().backward()
    return saved.out, layer


# (SwiGLU, biases, fused kernels, shared expert width): the unfused layer keeps 4-byte
# dropout masks on CPU, the fused one 1-byte masks and SwiGLU's input and output only.
MOE_VARIANTS = [(False, True, False, 0), (True, False, True, 64), (False, True, True, 32)]
MOE_SETTINGS = ["none", "selective", "full"]


def _moe_flags(swiglu, bias, fused, shared):
    """megatorch-plan's flags for _moe_config's layer (fp32, flash attention, CPU masks)."""
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96",
             "--moe-shared-expert-intermediate-size", str(shared), "--mask-bytes", "1" if fused else "4",
             "--megatorch-activations", "--flash-attention"]
    flags += ["--swiglu"] if swiglu else []
    flags += [] if bias else ["--disable-bias-linear"]
    return flags


@pytest.mark.parametrize("variant", MOE_VARIANTS)
@pytest.mark.parametrize("setting", MOE_SETTINGS)
def test_moe_activation_memory_equals_the_real_layer(variant, setting):
    """One MoE layer at EP 1 (every expert on the rank: T k rows, whatever the routing), fp32,
    attention dropout 0 (flash attention): the planner's count equals what the layer saves."""
    import torch
    measured = _measure_moe_layer(_moe_config(setting, *variant), torch.float32)
    assert _planned_layer_bytes(MOE_SHAPE, setting, *_moe_flags(*variant)) == measured


def test_moe_activation_memory_at_expert_tensor_parallel_2_equals_the_real_layers(tmp_path):
    """The same layers at ETP 2 over 2 gloo ranks (tests/python/unit/moe_etp_activations_worker.py
    under torchrun, one launch for every variant and setting), each rank with its own tokens.
    At EP 1 each rank's experts get exactly its T k rows, so the planner's R = T k (margin 1)
    is exact on every rank, whatever the routing. Each rank's bytes equal the planner's at
    --expert-tensor-parallel-size 2 (DP 2: the layout whose ranks hold ETP 2)."""
    worker = Path(__file__).resolve().parent / "moe_etp_activations_worker.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(worker),
           str(tmp_path)]
    log = tmp_path / "torchrun.log"
    with open(log, "w") as sink:
        ranks = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="60"))
    try:  # the planner's counts while the ranks run
        planned = {(variant, setting): _planned_layer_bytes(MOE_SHAPE, setting, *_moe_flags(*variant),
                                                            "--expert-model-parallel-size", "1",
                                                            "--expert-tensor-parallel-size", "2", dp=2)
                   for variant in MOE_VARIANTS for setting in MOE_SETTINGS}
        at_etp1 = {variant: _planned_layer_bytes(MOE_SHAPE, "none", *_moe_flags(*variant)) for variant in MOE_VARIANTS}
        ranks.wait(timeout=300)
    finally:
        if ranks.poll() is None:  # torchrun stops its workers on SIGTERM
            ranks.terminate()
            ranks.wait(timeout=60)
    assert ranks.returncode == 0, log.read_text()[-6000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    T, k, h, E = MOE_SHAPE[0] * MOE_SHAPE[1], 2, MOE_SHAPE[2], 4
    for variant in MOE_VARIANTS:
        swiglu, bias = variant[:2]
        for setting in MOE_SETTINGS:
            for rank in range(2):
                m = got[rank][f"{variant} {setting}"]
                # The rank's ETP shard: fc1 96/2 columns (gate and up each), fc2 96/2 rows.
                assert m["fc1_weight"] == [4, h, 48 * (2 if swiglu else 1)] and m["fc2_weight"] == [4, 48, h]
                assert m["bytes"] == planned[variant, setting], (rank, variant, setting, m["storages"])
        # Beyond ETP 1 (R = T k rows, 2 R gathered): the gathered input's other R rows, the gathered
        # rows' int64 order and inverse, and with biases fc1's own int64 expert index on the 2 R
        # gathered rows (at ETP 1 fc1 shares fc2's); fc1 and the activation keep as many bytes
        # (2 R rows at half the width).
        R = T * k
        assert planned[variant, "none"] - at_etp1[variant] == R * h * E + 16 * 2 * R + (8 * 2 * R if bias else 0)


def test_moe_activation_memory_bf16_keeps_the_routers_fp32_copies():
    """bf16 (fused kernels, 1-byte masks): the router's fp32 GEMM keeps fp32 copies of its input
    and weight, and without a shared expert the bf16 input itself is not kept."""
    import torch
    measured = _measure_moe_layer(_moe_config("none", False, True, True, 0, torch.bfloat16), torch.bfloat16)
    flags = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "96", "--mask-bytes", "1",
             "--megatorch-activations", "--flash-attention", "--bf16"]
    assert _planned_layer_bytes(MOE_SHAPE, "none", *flags) == measured
