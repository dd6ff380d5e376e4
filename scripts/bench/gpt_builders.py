"""The implementations scripts/bench/gpu_gpt.py times, each built as (model, loss_fn,
optimizer, notes) inside a worker process: megatorch's C++ GPTModel with its
DistributedOptimizer, the plain PyTorch reference (eager or torch.compile), and
Megatron-Core's GPTModel with its local layers."""
import os
import sys
from pathlib import Path

import torch

from gpt_reference import GPTShape, MasterAdamW, ReferenceGPT

HERE = Path(__file__).resolve().parent


def log(msg):
    print(f"[gpu_gpt] {msg}", flush=True)


def make_group(device):
    """A one-rank process group (megatorch's optimizer and Megatron-Core both want one)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return dist.group.WORLD
    if device == "cuda":
        try:
            dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0, world_size=1)
            # NCCL's communicator comes up lazily; one small collective now keeps it out of the timings.
            dist.all_reduce(torch.ones(1, device="cuda"))
            return dist.group.WORLD
        except Exception as e:  # one rank needs no NCCL: gloo does (megatorch never communicates here)
            log(f"NCCL process group failed ({type(e).__name__}: {str(e)[:200]}); using gloo")
            if dist.is_initialized():
                dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def build_megatorch(shape: GPTShape, device, dtype, args):
    import megatorch  # noqa: F401  (loads the operators)
    import megatorch.cpp as mt
    from megatorch.optim import DistributedOptimizer
    group = make_group(device)
    config = mt.TransformerConfig(**shape.megatorch_fields(), params_dtype=dtype, device=device, fused_kernels=True,
                                  recompute="none", seed=1234)
    model = mt.GPTModel(config)
    model.train()
    opt = DistributedOptimizer(model.parameters(), group, zero_stage=0, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.1, gradient_accumulation_fusion=True)
    notes = ("megatorch.cpp.GPTModel (fused_kernels=True, at::scaled_dot_product_attention) + "
             "megatorch.optim.DistributedOptimizer (ZeRO 0, one rank; fp32 grads, master weights and moments; "
             "weight gradients accumulated into the fp32 buffer by the GEMM)")
    return model, model.loss, opt, notes


def build_reference(shape: GPTShape, device, dtype, args, compiled: bool):
    torch.manual_seed(1234)
    model = ReferenceGPT(shape, device=device, dtype=dtype)
    model.train()
    opt = MasterAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    notes = ("plain PyTorch (nn.Linear, F.layer_norm/F.rms_norm, F.gelu tanh/SwiGLU, F.scaled_dot_product_attention), "
             "torch AdamW on fp32 masters")
    loss_fn = model.loss
    if compiled:
        if args.compile == "full":
            loss_fn = torch.compile(model.loss)
        else:
            model.compile_regional()
            loss_fn = model.loss
        notes += f"; torch.compile ({args.compile}: " + (
            "the whole loss function" if args.compile == "full" else "each layer, and the head with the loss") + ")"
    return model, loss_fn, opt, notes


def import_mcore():
    """megatron.core from this interpreter, else from $MEGATORCH_MCORE_PATH (a folder holding
    megatron/, e.g. a copy of the venv's site-packages/megatron carried to the GPU machine), else
    from the repository's .venv (appended to sys.path: this interpreter's torch still wins)."""
    try:
        import megatron.core  # noqa: F401
        return
    except ImportError as e:
        first = e
    candidates = [os.environ.get("MEGATORCH_MCORE_PATH", "")]
    candidates += [str(p) for p in sorted((HERE.parent.parent / ".venv" / "lib").glob("python3*/site-packages"))]
    for path in candidates:
        if path and (Path(path) / "megatron" / "core").is_dir() and path not in sys.path:
            sys.path.append(path)
            try:
                import megatron.core  # noqa: F401
                log(f"megatron.core from {path}")
                return
            except ImportError as e:
                first = e
    raise ImportError(f"megatron.core is not importable by {sys.executable} ({first}); install megatron-core "
                      "or set MEGATORCH_MCORE_PATH to a folder holding megatron/")


def build_mcore(shape: GPTShape, device, dtype, args):
    import torch.nn.functional as F
    make_group(device)
    import_mcore()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)
    if device == "cuda":
        model_parallel_cuda_manual_seed(1234)
    llama = shape.llama
    config = TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, num_attention_heads=shape.num_attention_heads,
        num_query_groups=shape.groups, ffn_hidden_size=shape.ffn, kv_channels=shape.head_dim,
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=shape.norm_epsilon, init_method_std=shape.init_std,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, pipeline_dtype=dtype,
        normalization="RMSNorm" if llama else "LayerNorm", add_bias_linear=not llama,
        gated_linear_unit=llama, activation_func=F.silu if llama else F.gelu,
        # Megatron's own fusions that need no extra CUDA extension: bias-GeLU (tanh) / bias-SwiGLU and
        # bias-dropout-add (TorchScript / torch ops). The masked softmax kernel needs
        # scaled_upper_triang_masked_softmax_cuda (not in the wheel): torch's softmax instead.
        bias_activation_fusion=True, bias_dropout_fusion=True, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        use_cpu_initialization=device != "cuda",
    )
    model = GPTModel(config, transformer_layer_spec=get_gpt_layer_local_spec(normalization=config.normalization),
                     vocab_size=shape.vocab_size, max_sequence_length=shape.seq_length,
                     share_embeddings_and_output_weights=True,
                     position_embedding_type="rope" if llama else "learned_absolute")
    # What Megatron's Float16Module does: every parameter and buffer in bf16 (its norms are
    # built in fp32).
    model.to(device=device, dtype=dtype)
    model.train()
    positions = torch.arange(shape.seq_length, device=device).unsqueeze(0)

    def loss_fn(ids, labels):
        per_token = model(ids, positions.expand_as(ids), None, labels=labels)  # [b, s] fp32
        return per_token.mean()

    opt = MasterAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    notes = ("megatron.core GPTModel with get_gpt_layer_local_spec() (no Transformer Engine: unfused "
             "baddbmm-softmax-bmm attention, torch norms, bias-GeLU/bias-dropout-add fusions), fused torch AdamW "
             "on fp32 masters")
    return model, loss_fn, opt, notes
