"""HuggingFace interchange (build/bin/megatorch-hf, include/megatorch/ckpt/hf_convert.h).

Randomly initialised tiny GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM, GQA), Mistral
(MistralForCausalLM, GQA, a sliding window shorter than the sequence) and Qwen2
(Qwen2ForCausalLM, GQA, non-zero q/k/v biases) models written by the ``transformers``
package: import -> megatorch logits equal HF logits and the export gives the same class
back; a megatorch model exported -> transformers loads it as the right class and gives
megatorch's logits. All within 1e-5 relative to the logits' magnitude in fp32
(tests/python/tolerance.py: the same arithmetic up to summation order and kernel choice);
imported and exported back, HF's logits bit for bit. config.json fields megatorch cannot
honour are refused by name.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import transformers  # a requirement (requirements.txt): missing, this test fails, not skips
import megatorch.cpp as mt  # noqa: E402
from tolerance import assert_close

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
CLI = str(BIN / "megatorch-hf")
VOCAB, SEQ = 200, 16


def run(*args):
    out = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def run_fails(*args):
    out = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stderr


HF_CLASS = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM"}


def hf_model(arch, tied, **extra):
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
    else:
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, rms_norm_eps=1e-6,
                      rope_theta=10000.0, tie_word_embeddings=tied)
        if arch == "mistral":  # positions beyond the window
            fields.update(max_position_embeddings=4 * SEQ, sliding_window=SEQ)
        fields.update(extra)
        config = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config}[arch](**fields)
    model = getattr(transformers, HF_CLASS[arch])(config)
    with torch.no_grad():  # norms start at 1 and biases at 0: make every tensor tell its place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval().float()


def ids():
    return torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def hf_logits(model, x):
    with torch.no_grad():
        return model(input_ids=x).logits


def mt_logits(model, x):
    with torch.no_grad():
        return model(x)[:, :, :VOCAB].transpose(0, 1)  # [s, b, Vp] -> [b, s, V]


CASES = [("gpt2", True), ("gpt2", False), ("llama", False), ("llama", True), ("mistral", False), ("qwen2", False),
         ("qwen2", True)]


@pytest.mark.parametrize("arch, tied", CASES)
def test_import_gives_huggingface_logits(tmp_path, arch, tied):
    hf = hf_model(arch, tied)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = run("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    assert f"({arch},"  in out
    config = mt.checkpoint_config(str(tmp_path / "ckpt"))
    assert config.tie_embeddings == tied
    assert config.add_qkv_bias == (arch == "qwen2")
    assert (config.sliding_window, config.seq_length) == ((SEQ, 4 * SEQ) if arch == "mistral" else (0, SEQ))
    model = mt.GPTModel(config.replace(seed=99))  # other weights until loaded
    assert mt.load_checkpoint(model, str(tmp_path / "ckpt")) == 0
    x = ids()
    want, got = hf_logits(hf, x), mt_logits(model, x)
    assert got.shape == want.shape
    assert_close(got, want)
    # Exported back: the architecture the import recorded (Mistral, not the Llama it is shaped like).
    run("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(back).__name__ == HF_CLASS[arch]
    assert torch.equal(hf_logits(back, x), want)  # the same class and weights, bit for bit


def test_mistral_without_window_exports_as_mistral(tmp_path):
    hf_model("mistral", False, sliding_window=None).save_pretrained(tmp_path / "hf", safe_serialization=True)
    run("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    config = mt.checkpoint_config(str(tmp_path / "ckpt"))
    assert (config.sliding_window, config.seq_length) == (0, 4 * SEQ)
    assert "as mistral" in run("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["sliding_window"] is None


@pytest.mark.parametrize("arch, tied", CASES)
def test_export_loads_in_transformers(tmp_path, arch, tied):
    fields = dict(hidden_size=32, num_attention_heads=4, num_layers=2, seq_length=SEQ, vocab_size=VOCAB,
                  tie_embeddings=tied, init_std=0.2, seed=11)
    if arch != "gpt2":  # Mistral: a window; Qwen2: QKV biases; the export derives the architecture from them
        fields.update(num_query_groups=2, ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
                      position_embedding_type="rope", add_bias_linear=False, norm_epsilon=1e-6,
                      add_qkv_bias=arch == "qwen2", sliding_window=SEQ if arch == "mistral" else 0)
    model = mt.GPTModel(mt.TransformerConfig(**fields))
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    mt.save_checkpoint(model, str(tmp_path / "ckpt"), 4)
    run("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    assert type(hf).__name__ == HF_CLASS[arch]
    if arch == "mistral":
        assert hf.config.sliding_window == SEQ
    x = ids()
    assert_close(hf_logits(hf, x), mt_logits(model, x))


def test_export_refuses_other_architectures(tmp_path):
    model = mt.GPTModel(mt.TransformerConfig(hidden_size=32, num_attention_heads=4, num_layers=1, seq_length=8,
                                             vocab_size=VOCAB, normalization="RMSNorm"))
    mt.save_checkpoint(model, str(tmp_path / "ckpt"), 0)
    out = subprocess.run([CLI, "export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "neither GPT-2" in out.stderr


def test_sliding_window_shorter_than_the_sequence(tmp_path):
    # The window masks keys more than SEQ / 4 back: HF's logits over the whole sequence.
    hf = hf_model("mistral", False, sliding_window=SEQ // 4)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    run("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    config = mt.checkpoint_config(str(tmp_path / "ckpt"))
    assert (config.sliding_window, config.seq_length) == (SEQ // 4, 4 * SEQ)
    model = mt.GPTModel(config)
    mt.load_checkpoint(model, str(tmp_path / "ckpt"))
    x = ids()
    assert_close(mt_logits(model, x), hf_logits(hf, x))
    # Without the window the logits past it differ: the test sees a window that is not applied.
    plain = mt.GPTModel(config.replace(sliding_window=0))
    mt.load_checkpoint(plain, str(tmp_path / "ckpt"))
    assert not torch.allclose(mt_logits(plain, x), hf_logits(hf, x), rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One saved tiny model per architecture, whose config.json the refusal tests edit."""
    root = tmp_path_factory.mktemp("hf")
    for arch in HF_CLASS:
        hf_model(arch, False).save_pretrained(root / arch, safe_serialization=True)
    return root


def edited(saved, tmp_path, arch, **fields):
    (tmp_path / "hf").mkdir()
    config = json.loads((saved / arch / "config.json").read_text())
    config.update(fields)
    for key in [k for k, v in fields.items() if v is DROP]:
        del config[key]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf" / "model.safetensors").symlink_to(saved / arch / "model.safetensors")
    return tmp_path / "hf"


DROP = object()  # edited(): remove the field
REFUSED = [
    ("llama", dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
     "rope_scaling.rope_type: expected rope_type 'default', 'linear', 'dynamic', 'yarn' or 'llama3', got 'longrope'"),
    ("qwen2", dict(rope_parameters={"rope_type": "yarn", "factor": 0.5, "rope_theta": 1e4}),
     "rope_parameters: rope_type 'yarn': expected a scaling factor >= 1, got 0.5"),
    ("mistral", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("qwen2", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("gpt2", dict(add_cross_attention=True), "add_cross_attention"),
    ("gpt2", dict(activation_function="relu"), "activation_function 'relu'"),
    ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("llama", dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]),
     "expected 'layer_types' to be a list of num_hidden_layers (2) strings"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "chunked_attention"]),
     "expected each of layer_types to be 'sliding_attention' or 'full_attention', got \"chunked_attention\""),
    ("falcon", {}, "model_type"),
]


@pytest.mark.parametrize("arch, fields, named", REFUSED, ids=[r[2].split()[0] for r in REFUSED])
def test_import_refuses_what_it_cannot_honour_by_name(saved, tmp_path, arch, fields, named):
    src = "llama" if arch == "falcon" else arch
    hf = edited(saved, tmp_path, src, **fields, **({"model_type": "falcon"} if arch == "falcon" else {}))
    err = run_fails("import", "--hf-dir", hf, "--save", tmp_path / "ckpt")
    assert named in err
    assert not (tmp_path / "ckpt").exists()


def test_qwen2_sliding_window_on_every_layer_is_a_window(saved, tmp_path):
    hf = edited(saved, tmp_path, "qwen2", use_sliding_window=True, sliding_window=SEQ, max_window_layers=0,
                layer_types=DROP)
    run("import", "--hf-dir", hf, "--save", tmp_path / "ckpt")
    assert mt.checkpoint_config(str(tmp_path / "ckpt")).sliding_window == SEQ
    run("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "back")
    back = transformers.AutoConfig.from_pretrained(tmp_path / "back")
    assert (back.model_type, back.sliding_window, back.layer_types) == ("qwen2", SEQ, ["sliding_attention"] * 2)


def test_import_refuses_tensors_the_config_does_not_declare(saved, tmp_path):
    # Qwen2's q/k/v biases under a Llama config.json would be dropped: refused, naming one.
    hf = edited(saved, tmp_path, "qwen2", model_type="llama", architectures=["LlamaForCausalLM"])
    err = run_fails("import", "--hf-dir", hf, "--save", tmp_path / "ckpt")
    assert "self_attn.k_proj.bias' (6 in all) has no place" in err
