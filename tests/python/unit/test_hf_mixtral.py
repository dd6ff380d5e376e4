"""HuggingFace Mixtral (MixtralForCausalLM) interchange (build/bin/megatorch-hf,
csrc/ckpt/hf_convert.cpp): a randomly initialised tiny Mixtral (hidden 32, 2 layers, 4
experts, top-2, expert width 48, 4 heads, 2 key/value heads) written by ``transformers``.

- import -> megatorch's logits equal HF's within 1e-5 relative to their magnitude
  (tests/python/tolerance.py), from the per-expert layout
  save_pretrained writes (the published one) and from transformers 5's fused in-memory
  layout, on one rank and with the experts split over two expert-parallel ranks (torchrun);
- a megatorch mixture of experts exported -> transformers' from_pretrained loads a Mixtral
  with megatorch's logits (default and pre-softmax routers, top-1, tied, a window, an
  expert width other than ffn_hidden_size, a checkpoint saved at EP 2);
- what either side cannot represent is refused by field name;
- the load-balancing coefficient: megatorch's a equals HF's k * router_aux_loss_coef for
  one MoE layer (the router's gradients agree), as docs/checkpoints.md states.
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import transformers  # a requirement (requirements.txt): missing, this test fails, not skips
import megatorch.cpp as mt  # noqa: E402
from tolerance import assert_close

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
CLI = str(BIN / "megatorch-hf")
VOCAB, SEQ, EXPERTS, TOPK, FFN = 300, 16, 4, 2, 48


def run(*args):
    out = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def run_fails(*args):
    out = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Exception raised from" not in out.stderr, out.stderr
    return out.stderr


def hf_mixtral(**extra):
    torch.manual_seed(0)
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=FFN, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                  num_experts_per_tok=TOPK, max_position_embeddings=4 * SEQ, rms_norm_eps=1e-6,
                  tie_word_embeddings=False, router_aux_loss_coef=0.02, sliding_window=None)
    fields.update(extra)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**fields))
    with torch.no_grad():  # norms start at 1: make every tensor tell its place
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if name.endswith("mlp.gate.weight"):  # decisive routing: no near-ties between experts
                p.mul_(20)
    return model.eval().float()


def ids(batch=2, seq=SEQ):
    return torch.randint(VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))


def hf_logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def mt_logits(model, x):
    with torch.no_grad():
        return model(x)[:, :, :VOCAB].transpose(0, 1)  # [s, b, Vp] -> [b, s, V]


def experts_used(model, x):
    """How many distinct experts each layer routes x's tokens to."""
    with torch.no_grad():
        logits = model(input_ids=x, output_router_logits=True).router_logits
    return [len(set(l.topk(TOPK, -1).indices.flatten().tolist())) for l in logits]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """The HF model, its save_pretrained directory and its import."""
    root = tmp_path_factory.mktemp("mixtral")
    hf = hf_mixtral(router_jitter_noise=0.1)
    hf.save_pretrained(root / "hf", safe_serialization=True)
    out = run("import", "--hf-dir", root / "hf", "--save", root / "ckpt")
    assert "(mixtral, 2 layers" in out
    return hf, root


def test_save_pretrained_writes_the_published_layout(imported):
    _, root = imported
    from safetensors import safe_open
    with safe_open(root / "hf" / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in names
    assert "model.layers.0.block_sparse_moe.gate.weight" in names
    assert not any("gate_up_proj" in n for n in names)


def test_import_gives_huggingface_logits(imported):
    hf, root = imported
    config = mt.checkpoint_config(str(root / "ckpt"))
    assert (config.num_experts, config.moe_router_topk, config.moe_ffn_hidden_size, config.ffn_hidden_size) == \
        (EXPERTS, TOPK, FFN, FFN)
    assert (config.moe_layer_freq, config.moe_first_k_dense, config.moe_shared_expert_intermediate_size) == (1, 0, 0)
    assert (config.moe_router_score_function, config.moe_router_pre_softmax) == ("softmax", False)
    assert (config.rotary_base, config.sliding_window, config.seq_length) == (1e6, 0, 4 * SEQ)
    assert not config.tie_embeddings and not config.add_bias_linear
    model = mt.GPTModel(config.replace(seed=99))  # other weights until loaded
    assert mt.load_checkpoint(model, str(root / "ckpt")) == 0
    x = ids()
    assert experts_used(hf, x) == [EXPERTS, EXPERTS]  # every expert's weights matter
    assert_close(mt_logits(model, x), hf_logits(hf, x))
    # Exported back: Mixtral, per-expert names, the training-only fields the import recorded.
    run("export", "--load", root / "ckpt", "--hf-dir", root / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(root / "back", dtype=torch.float32).eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    assert (back.config.router_aux_loss_coef, back.config.router_jitter_noise) == (0.02, 0.1)
    assert back.config.rope_parameters["rope_theta"] == 1e6
    torch.testing.assert_close(hf_logits(back, x), hf_logits(hf, x), rtol=0, atol=0)


def test_import_of_the_fused_layout(imported, tmp_path):
    """transformers 5's in-memory names (mlp.gate, mlp.experts.gate_up_proj [E, 2F, h],
    mlp.experts.down_proj [E, h, F]), as a state_dict saved directly holds them."""
    hf, root = imported
    (tmp_path / "hf").mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 2 * FFN, 32)
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "hf" / "config.json").write_text((root / "hf" / "config.json").read_text())
    run("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    config = mt.checkpoint_config(str(tmp_path / "ckpt"))
    model = mt.GPTModel(config)
    mt.load_checkpoint(model, str(tmp_path / "ckpt"))
    assert_close(mt_logits(model, ids()), hf_logits(hf, ids()))


# Two expert-parallel ranks (each holding 2 of the 4 experts, tokens exchanged all-to-all),
# each with its own batch row: the imported checkpoint's logits equal HF's.
EP_WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    import megatorch.cpp as mt
    ckpt, want = sys.argv[1], torch.load(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.group.WORLD
    config = mt.checkpoint_config(ckpt).replace(expert_parallel_group=world, seed=99)
    model = mt.GPTModel(config)
    mt.load_checkpoint(model, ckpt, group=world)
    assert model.state_dict()["layers.0.mlp.experts.fc1_weight"].shape[0] == config.num_experts // 2
    x = want["ids"][rank:rank + 1]
    with torch.no_grad():
        got = model(x)[:, :, :want["vocab"]].transpose(0, 1)
    ref = want["logits"][rank:rank + 1]  # tests/python/tolerance.py's criterion: atol = rtol max|want|
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} ok")
""")


def torchrun(*args):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *map(str, args)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env=dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="60"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def test_import_at_expert_parallel_2(imported, tmp_path):
    hf, root = imported
    x = ids()
    torch.save({"ids": x, "logits": hf_logits(hf, x), "vocab": VOCAB}, tmp_path / "want.pt")
    (tmp_path / "worker.py").write_text(EP_WORKER)
    out = torchrun(tmp_path / "worker.py", root / "ckpt", tmp_path / "want.pt")
    assert "rank 0 ok" in out and "rank 1 ok" in out


def test_trained_at_expert_parallel_2_exports(imported, tmp_path):
    """The import trained two steps by gpt_pretrain at EP 2 (with a load-balancing loss) and
    saved there: the export gives transformers megatorch's logits of the trained weights."""
    hf, root = imported
    data = Path(__file__).resolve().parents[3] / "data" / "default" / "stdlib_docs_text_document"
    torchrun("--no-python", BIN / "gpt_pretrain", "--use-checkpoint-args", "--finetune", "--load", root / "ckpt",
             "--save", tmp_path / "trained", "--expert-model-parallel-size", "2", "--seq-length", SEQ,
             "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2", "--lr-warmup-iters", "0",
             "--train-iters", "2", "--data-path", data, "--eval-iters", "1", "--seed", "5",
             "--moe-aux-loss-coeff", "0.01")
    assert "as mixtral" in run("export", "--load", tmp_path / "trained", "--hf-dir", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    # gpt_pretrain's checkpoint state replaces the import's: no HF coefficient recorded.
    assert back.config.router_aux_loss_coef == 0.0
    model = mt.GPTModel(mt.checkpoint_config(str(tmp_path / "trained")))
    assert mt.load_checkpoint(model, str(tmp_path / "trained")) == 2
    x = ids()
    assert (hf_logits(back, x) - hf_logits(hf, x)).abs().max() > 1e-3  # it trained
    assert_close(hf_logits(back, x), mt_logits(model, x))


def mt_moe_config(**extra):
    fields = dict(hidden_size=32, num_attention_heads=4, num_query_groups=2, num_layers=2, seq_length=SEQ,
                  vocab_size=VOCAB, ffn_hidden_size=FFN, normalization="RMSNorm", activation="swiglu",
                  position_embedding_type="rope", add_bias_linear=False, norm_epsilon=1e-6, tie_embeddings=False,
                  num_experts=EXPERTS, moe_router_topk=TOPK, init_std=0.2, seed=11)
    fields.update(extra)
    return mt.TransformerConfig(**fields)


EXPORTS = {
    "default": {},
    # Softmax over all experts, top-k, renormalised: Mixtral's own order of operations.
    "pre_softmax": dict(moe_router_pre_softmax=True, moe_router_norm_topk_prob=True),
    "top1": dict(moe_router_topk=1),
    "tied_window": dict(tie_embeddings=True, sliding_window=SEQ, max_position_embeddings=4 * SEQ),
    "expert_width": dict(ffn_hidden_size=64, moe_ffn_hidden_size=40, rotary_base=5e5),
}


@pytest.mark.parametrize("case", EXPORTS)
def test_export_loads_in_transformers(tmp_path, case):
    model = mt.GPTModel(mt_moe_config(**EXPORTS[case]))
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    mt.save_checkpoint(model, str(tmp_path / "ckpt"), 4)
    assert "as mixtral" in run("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (written["num_local_experts"], written["router_aux_loss_coef"]) == (EXPERTS, 0.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    c = model.config
    assert (hf.config.num_experts_per_tok, hf.config.intermediate_size, hf.config.tie_word_embeddings) == \
        (c.moe_router_topk, c.moe_ffn_hidden_size or c.ffn_hidden_size, c.tie_embeddings)
    assert hf.config.sliding_window == (c.sliding_window or None)
    x = ids()
    assert_close(hf_logits(hf, x), mt_logits(model, x))


EXPORT_REFUSED = [
    (dict(moe_router_score_function="sigmoid"), "moe_router_score_function sigmoid (Mixtral: softmax)"),
    (dict(moe_shared_expert_intermediate_size=32), "moe_shared_expert_intermediate_size 32"),
    (dict(moe_layer_freq=2), "moe_layer_freq 2"),
    (dict(moe_first_k_dense=1), "moe_first_k_dense 1"),
    (dict(moe_router_topk_scaling_factor=2.5), "moe_router_topk_scaling_factor 2.5"),
    (dict(moe_router_enable_expert_bias=True), "moe_router_enable_expert_bias true"),
    (dict(moe_router_pre_softmax=True), "moe_router_pre_softmax true with moe_router_norm_topk_prob false"),
    (dict(moe_router_pre_softmax=True, moe_router_norm_topk_prob=True, moe_router_topk=1),
     "moe_router_pre_softmax true with moe_router_norm_topk_prob true and moe_router_topk 1"),
    (dict(add_bias_linear=True), "add_bias_linear true"),
    (dict(add_qkv_bias=True), "add_qkv_bias true"),
    (dict(activation="gelu_tanh"), "activation gelu_tanh"),
    (dict(position_embedding_type="learned_absolute"), "position_embedding_type learned_absolute"),
    (dict(normalization="LayerNorm"), "normalization LayerNorm"),
]


@pytest.mark.parametrize("fields, named", EXPORT_REFUSED, ids=[next(iter(f)) + ("_k1" if "moe_router_topk" in f else "")
                                                                for f, _ in EXPORT_REFUSED])
def test_export_refuses_what_mixtral_cannot_represent(tmp_path, fields, named):
    model = mt.GPTModel(mt_moe_config(**fields))
    mt.save_checkpoint(model, str(tmp_path / "ckpt"), 0)
    err = run_fails("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "hf")
    assert "can be written neither as Mixtral" in err and named in err, err
    assert not (tmp_path / "hf" / "config.json").exists()


def test_export_names_every_field_at_once(tmp_path):
    model = mt.GPTModel(mt_moe_config(moe_router_score_function="sigmoid", moe_layer_freq=2, add_bias_linear=True))
    mt.save_checkpoint(model, str(tmp_path / "ckpt"), 0)
    err = run_fails("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "hf")
    assert all(f in err for f in ("add_bias_linear true", "moe_layer_freq 2", "moe_router_score_function sigmoid"))


def edited(root, tmp_path, **fields):
    (tmp_path / "hf").mkdir()
    config = json.loads((root / "hf" / "config.json").read_text())
    config.update(fields)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").symlink_to(root / "hf" / "model.safetensors")
    return tmp_path / "hf"


IMPORT_REFUSED = [
    (dict(hidden_act="gelu"), "Mixtral import: hidden_act 'gelu'"),
    (dict(num_experts_per_tok=5), "expected num_experts_per_tok (5) <= num_local_experts (4)"),
    (dict(num_local_experts=0), "'num_local_experts' to be an integer >= 1, got 0"),
    (dict(num_experts_per_tok=1.5), "'num_experts_per_tok' to be an integer, got 1.5"),
    (dict(rope_parameters={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "rope_theta": 1e6}),
     "rope_parameters.rope_type: expected rope_type 'default', 'linear', 'dynamic', 'yarn' or 'llama3', got 'longrope'"),
    # head_dim may differ from hidden / heads (kv_channels); then the attention weights do not fit.
    (dict(head_dim=16), "'model.layers.0.self_attn.q_proj.weight' of shape [64, 32] (from config.json)"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    # The config alone is valid; the weights are not its model.
    (dict(num_local_experts=3), "'model.layers.0.block_sparse_moe.gate.weight' of shape [3, 32] (from config.json), "
                                "got [4, 32]"),
    (dict(intermediate_size=64), "'model.layers.0.block_sparse_moe.experts.0.w1.weight' of shape [64, 32]"),
    (dict(model_type="mistral", architectures=["MistralForCausalLM"]),
     "expected tensor 'model.layers.0.mlp.gate_proj.weight', found none"),
]


@pytest.mark.parametrize("fields, named", IMPORT_REFUSED, ids=[f"{next(iter(f))}" for f, _ in IMPORT_REFUSED])
def test_import_refuses_what_it_cannot_honour_by_name(imported, tmp_path, fields, named):
    _, root = imported
    err = run_fails("import", "--hf-dir", edited(root, tmp_path, **fields), "--save", tmp_path / "ckpt")
    assert named in err, err
    assert not (tmp_path / "ckpt").exists()


def test_sliding_window_as_mistral(imported, tmp_path):
    # A window shorter than the sequence: HF's logits with it, on every layer.
    _, root = imported
    hf_dir = edited(root, tmp_path, sliding_window=SEQ // 4)
    run("import", "--hf-dir", hf_dir, "--save", tmp_path / "ckpt")
    config = mt.checkpoint_config(str(tmp_path / "ckpt"))
    assert config.sliding_window == SEQ // 4
    model = mt.GPTModel(config)
    mt.load_checkpoint(model, str(tmp_path / "ckpt"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    x = ids()
    assert_close(mt_logits(model, x), hf_logits(hf, x))


def test_aux_loss_coefficient_is_k_times_hf(tmp_path):
    """One MoE layer: HF's loss with router_aux_loss_coef c and megatorch's with
    --moe-aux-loss-coeff k*c give the router the same gradient (HF counts the k choices of
    a token as k whole tokens, so its fractions sum to k; megatorch's to 1)."""
    c = 0.05
    hf = hf_mixtral(num_hidden_layers=1, router_aux_loss_coef=c)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    run("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    x = ids()
    hf.zero_grad()
    hf(input_ids=x, labels=x, output_router_logits=True).loss.backward()
    want = hf.model.layers[0].mlp.gate.weight.grad
    ce_only = None
    grads = {}
    for a in (0.0, c, TOPK * c):
        model = mt.GPTModel(mt.checkpoint_config(str(tmp_path / "ckpt")).replace(moe_aux_loss_coeff=a))
        mt.load_checkpoint(model, str(tmp_path / "ckpt"))
        labels = torch.cat([x[:, 1:], torch.full((x.size(0), 1), -100)], 1)  # HF's shift: last position unlabelled
        model.loss(x, labels).backward()
        grads[a] = model.named_parameters()["layers.0.mlp.router.weight"].grad
    aux_hf, aux_mt = want - grads[0.0], grads[TOPK * c] - grads[0.0]
    assert aux_hf.abs().max() > 1e-3  # the coefficient moves the gradient measurably
    assert_close(grads[TOPK * c], want, msg="router gradient")  # ~4e-3: 1e-5 of that, not 1e-6 absolute
    # The auxiliary parts are differences of two gradients: their rounding follows the
    # gradients' magnitude, the scale here, not their own (~1e-3, some ~1e-6).
    grad_scale = want.abs().max()
    assert_close(aux_mt, aux_hf, scale=grad_scale, msg="auxiliary gradient, coefficient k c")
    assert_close(grads[c] - grads[0.0], aux_hf / TOPK, scale=grad_scale / TOPK,
                 msg="auxiliary gradient, coefficient c")
