"""The implementations scripts/bench/gpu_gpt.py times, each built as (model, loss_fn,
optimizer, notes) inside a worker process: megatorch's C++ GPTModel with its
DistributedOptimizer, the plain PyTorch reference (eager or torch.compile),
Megatron-Core's GPTModel with its local layers, and torchtitan's Llama (Llama shapes only).

Every one starts from the same weights (gpt_reference.shared_init_, drawn per megatorch
parameter name; Megatron-Core's and torchtitan's names are mapped onto megatorch's), so the
rows of a size have the same first-step loss up to rounding."""
import importlib.util
import os
import sys
from pathlib import Path

import torch

from gpt_reference import GPTShape, MasterAdamW, ReferenceGPT, shared_init_

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


# megatorch's FP8 row: TE's usual delayed recipe (docs/fp8.md), as gpu_pretrain.py's fp8_delayed.
MEGATORCH_FP8 = {"format": "hybrid", "recipe": "delayed", "amax_history_len": 1024, "amax_compute_algo": "max"}


def build_megatorch(shape: GPTShape, device, dtype, args, fp8=None):
    import megatorch  # noqa: F401  (loads the operators)
    import megatorch.cpp as mt
    from megatorch.optim import DistributedOptimizer
    group = make_group(device)
    config = mt.TransformerConfig(**shape.megatorch_fields(), params_dtype=dtype, device=device, fused_kernels=True,
                                  recompute="none", seed=1234, fp8=fp8)
    model = mt.GPTModel(config)
    model.train()
    shared_init_(model.named_parameters(), shape)  # before the optimizer copies its fp32 masters
    opt = DistributedOptimizer(model.parameters(), group, zero_stage=0, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                               weight_decay=0.1, gradient_accumulation_fusion=True)
    notes = ("megatorch.cpp.GPTModel (fused_kernels=True, at::scaled_dot_product_attention) + "
             "megatorch.optim.DistributedOptimizer (ZeRO 0, one rank; fp32 grads, master weights and moments; "
             "weight gradients accumulated into the fp32 buffer by the GEMM)")
    if fp8:
        notes += f"; FP8 GEMMs in every transformer layer's linear layers ({fp8})"
    return model, model.loss, opt, notes


def build_reference(shape: GPTShape, device, dtype, args, compiled: bool):
    torch.manual_seed(1234)
    model = ReferenceGPT(shape, device=device, dtype=dtype)
    model.train()
    shared_init_(model.named_parameters(), shape)
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


# Optional peers: the package, the environment variable naming a folder that holds it (appended
# to sys.path, so this interpreter's torch still wins), its folder inside that.
OPTIONAL = {"mcore": ("megatron.core", "MEGATORCH_MCORE_PATH", "megatron/core"),
            "torchtitan": ("torchtitan", "MEGATORCH_TORCHTITAN_PATH", "torchtitan"),
            "torchao_fp8": ("torchao", "MEGATORCH_TORCHAO_PATH", "torchao")}


def _candidates(env):
    paths = [os.environ.get(env, "")]
    paths += [str(p) for p in sorted((HERE.parent.parent / ".venv" / "lib").glob("python3*/site-packages"))]
    return [p for p in paths if p]


def locate(impl):
    """Where `impl`'s package would be imported from, without importing it: "" for this
    interpreter, a folder, or None when it is nowhere (the parent then marks the rows
    unavailable without starting a worker)."""
    module, env, folder = OPTIONAL[impl]
    try:
        if importlib.util.find_spec(module.split(".")[0]) is not None and (
                "." not in module or importlib.util.find_spec(module) is not None):
            return ""
    except (ImportError, ValueError):
        pass
    for path in _candidates(env):
        if (Path(path) / folder).is_dir():
            return path
    return None


def import_optional(impl):
    """Imports `impl`'s package from this interpreter, else from its environment variable's folder,
    else from the repository's .venv; raises ImportError saying where it looked."""
    module, env, folder = OPTIONAL[impl]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        first = e
    for path in _candidates(env):
        if (Path(path) / folder).is_dir() and path not in sys.path:
            sys.path.append(path)
            try:
                mod = importlib.import_module(module)
                log(f"{module} from {path}")
                return mod
            except ImportError as e:
                first = e
    raise ImportError(f"{module} is not importable by {sys.executable} ({first}); install it or set {env} to a "
                      f"folder holding {folder.split('/')[0]}/")


def import_mcore():
    """megatron.core from this interpreter, else from $MEGATORCH_MCORE_PATH (a folder holding
    megatron/, e.g. a copy of the venv's site-packages/megatron carried to the GPU machine), else
    from the repository's .venv (appended to sys.path: this interpreter's torch still wins)."""
    import_optional("mcore")


def mcore_name(name: str) -> str:
    """megatorch's parameter name -> Megatron-Core GPTModel's (local spec)."""
    top = {"embedding.weight": "embedding.word_embeddings.weight",
           "position_embedding": "embedding.position_embeddings.weight",
           "output_layer": "output_layer.weight"}
    if name in top:
        return top[name]
    if name.startswith("final_norm."):
        return "decoder.final_layernorm." + name.split(".", 1)[1]
    parts = name.split(".")  # layers.i.<module>.<...>
    inner = {"input_norm": "input_layernorm", "post_attention_norm": "pre_mlp_layernorm",
             "attention.qkv": "self_attention.linear_qkv", "attention.proj": "self_attention.linear_proj",
             "mlp.fc1": "mlp.linear_fc1", "mlp.fc2": "mlp.linear_fc2"}
    rest = ".".join(parts[2:])
    for k, v in inner.items():
        if rest.startswith(k + "."):
            return f"decoder.layers.{parts[1]}.{v}{rest[len(k):]}"
    raise KeyError(name)


def build_torchao_fp8(shape: GPTShape, device, dtype, args):
    """The eager reference with torchao's float8 training (tensorwise dynamic scaling) on its
    linear layers: what a PyTorch user adds for FP8. The head (a bare parameter) stays bf16,
    as megatorch's."""
    import_optional("torchao_fp8")
    from torchao.float8 import convert_to_float8_training
    model, loss_fn, opt, notes = build_reference(shape, device, dtype, args, compiled=False)
    convert_to_float8_training(model)
    return model, loss_fn, opt, notes + "; torchao.float8.convert_to_float8_training on every nn.Linear (eager)"


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
                     share_embeddings_and_output_weights=shape.tie_embeddings,
                     position_embedding_type="rope" if llama else "learned_absolute", rotary_base=10000)
    # What Megatron's Float16Module does: every parameter and buffer in bf16 (its norms are
    # built in fp32).
    model.to(device=device, dtype=dtype)
    model.train()
    params = dict(model.named_parameters())
    names = list(shape.canonical_sizes())
    missing = [n for n in names if mcore_name(n) not in params]
    extra = set(params) - {mcore_name(n) for n in names}
    if missing or extra:
        raise RuntimeError(f"Megatron-Core's parameters differ from megatorch's: missing {missing[:4]}, "
                           f"unexpected {sorted(extra)[:4]}")
    shared_init_([(n, params[mcore_name(n)]) for n in names], shape)
    positions = torch.arange(shape.seq_length, device=device).unsqueeze(0)

    def loss_fn(ids, labels):
        per_token = model(ids, positions.expand_as(ids), None, labels=labels)  # [b, s] fp32
        return per_token.mean()

    opt = MasterAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    notes = ("megatron.core GPTModel with get_gpt_layer_local_spec() (no Transformer Engine: unfused "
             "baddbmm-softmax-bmm attention, torch norms, " + ("bias-SwiGLU" if llama else "bias-GeLU") +
             "/bias-dropout-add fusions), fused torch AdamW on fp32 masters")
    return model, loss_fn, opt, notes


def import_torchtitan():
    """torchtitan's Llama 3 model and its arguments (torchtitan 0.1/0.2: llama3.model.model.Transformer,
    llama3.model.args.TransformerModelArgs), imported as import_optional does."""
    tt = import_optional("torchtitan")
    try:
        from torchtitan.models.llama3.model.args import TransformerModelArgs
        from torchtitan.models.llama3.model.model import Transformer
    except ImportError as e:
        version = getattr(tt, "__version__", "?")
        raise ImportError(f"torchtitan {version} from {Path(tt.__file__).parent}: its Llama 3 model is not importable "
                          f"here ({e}); this benchmark uses torchtitan 0.2's llama3.model API") from e
    return Transformer, TransformerModelArgs, getattr(tt, "__version__", "?")


def torchtitan_targets(model, shape: GPTShape):
    """(megatorch name, torchtitan parameter, transform) for shared_init_: torchtitan splits
    the fused QKV into wq/wk/wv and SwiGLU's fc1 into w1 (gate) and w3 (up), and rotates
    interleaved pairs (complex RoPE) where megatorch rotates halves: the rows of each q and k
    head are permuted (2i <- i, 2i+1 <- i + d/2) so the attention scores are the same."""
    a, g, d, h, f = shape.num_attention_heads, shape.groups, shape.head_dim, shape.hidden_size, shape.ffn
    per = a // g
    perm = torch.tensor([i // 2 if i % 2 == 0 else d // 2 + i // 2 for i in range(d)])

    def qkv_part(which):
        def take(w):  # w [(a + 2g) d, h], group by group [q heads of the group, k, v]
            w = w.view(g, per + 2, d, h)
            part = w[:, :per].reshape(a, d, h) if which == "q" else w[:, per if which == "k" else per + 1]
            if which != "v":
                part = part[:, perm.to(w.device)]
            return part.reshape(-1, h)
        return take

    p = dict(model.named_parameters())
    out = [("embedding.weight", p["tok_embeddings.weight"]), ("final_norm.weight", p["norm.weight"]),
           ("output_layer" if not shape.tie_embeddings else "embedding.weight", p["output.weight"])]
    for i in range(shape.num_layers):
        m, t = f"layers.{i}.", f"layers.{i}."
        out += [(m + "input_norm.weight", p[t + "attention_norm.weight"]),
                (m + "post_attention_norm.weight", p[t + "ffn_norm.weight"]),
                (m + "attention.qkv.weight", p[t + "attention.wq.weight"], qkv_part("q")),
                (m + "attention.qkv.weight", p[t + "attention.wk.weight"], qkv_part("k")),
                (m + "attention.qkv.weight", p[t + "attention.wv.weight"], qkv_part("v")),
                (m + "attention.proj.weight", p[t + "attention.wo.weight"]),
                (m + "mlp.fc1.weight", p[t + "feed_forward.w1.weight"], lambda w: w[:f]),
                (m + "mlp.fc1.weight", p[t + "feed_forward.w3.weight"], lambda w: w[f:]),
                (m + "mlp.fc2.weight", p[t + "feed_forward.w2.weight"])]
    covered = {id(x[1]) for x in out}
    left = [n for n, q in p.items() if id(q) not in covered]
    if left:
        raise RuntimeError(f"torchtitan parameters without a megatorch counterpart: {left[:4]}")
    return out


def build_torchtitan(shape: GPTShape, device, dtype, args):
    """torchtitan's Llama 3 (nn.Linear wq/wk/wv/wo, SwiGLU w1/w2/w3, nn.RMSNorm, complex RoPE,
    SDPA through its wrapper: cuDNN, flash, math), untied output, built in `dtype`; the loss
    as torchtitan's cross_entropy_loss (fp32 logits); the same MasterAdamW as the others. No
    torchtitan trainer, FSDP or torch.compile: its model code, eager."""
    import torch.nn.functional as F
    if not shape.llama:
        raise ValueError("torchtitan has no GPT-2 model: Llama shapes only")
    Transformer, TransformerModelArgs, version = import_torchtitan()
    # torchtitan's FFN width: int(2 * 4h / 3), times ffn_dim_multiplier, rounded up to multiple_of.
    base = int(2 * 4 * shape.hidden_size / 3)
    multiple_of, multiplier = shape.ffn, None
    if base > shape.ffn:
        multiple_of, multiplier = 1, (shape.ffn + 0.5) / base
    margs = dict(dim=shape.hidden_size, n_layers=shape.num_layers, n_heads=shape.num_attention_heads,
                 n_kv_heads=shape.groups, vocab_size=shape.vocab_size, multiple_of=multiple_of,
                 ffn_dim_multiplier=multiplier, norm_eps=shape.norm_epsilon, rope_theta=10000.0,
                 max_seq_len=shape.seq_length, attn_type="sdpa")
    try:  # plain RoPE frequencies, as megatorch's: Llama 3.1's scaling with factor 1 changes nothing
        from torchtitan.models.llama3.model.args import RoPEScalingArgs
        margs["rope_scaling_args"] = RoPEScalingArgs(scaling_factor=1.0)
    except ImportError:
        pass
    model_args = TransformerModelArgs(**margs)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters in dtype; its RoPE table stays complex64
    try:
        with torch.device(device):
            model = Transformer(model_args)
    finally:
        torch.set_default_dtype(previous)
    ffn = model.layers["0"].feed_forward.w1.weight.shape[0]
    if ffn != shape.ffn:
        raise RuntimeError(f"torchtitan built an FFN of {ffn}, the shape wants {shape.ffn}")
    model.train()
    shared_init_(torchtitan_targets(model, shape), shape)

    def loss_fn(ids, labels):
        logits = model(ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))

    opt = MasterAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    notes = (f"torchtitan {version} Llama 3 model (llama3.model.Transformer: separate wq/wk/wv, complex RoPE, "
             "nn.RMSNorm, SDPA cuDNN/flash/math), eager, its cross-entropy on fp32 logits; fused torch AdamW on "
             "fp32 masters (no torchtitan trainer, FSDP or compile)")
    return model, loss_fn, opt, notes
