"""HuggingFace interchange (build/bin/megatorch-hf, include/megatorch/ckpt/hf_convert.h).

Randomly initialised tiny GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM, GQA) models
written by the ``transformers`` package: import -> megatorch logits equal HF logits, and a
megatorch model exported -> transformers loads it and gives megatorch's logits. Both within
1e-4 in fp32 (the same arithmetic up to summation order and kernel choice).
"""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

import transformers  # a requirement (requirements.txt): missing, this test fails, not skips
import megatorch.cpp as mt  # noqa: E402

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
CLI = str(BIN / "megatorch-hf")
VOCAB, SEQ = 200, 16


def run(*args):
    out = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def hf_model(arch, tied):
    torch.manual_seed(0)
    if arch == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                          rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied)
        model = transformers.LlamaForCausalLM(config)
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


CASES = [("gpt2", True), ("gpt2", False), ("llama", False), ("llama", True)]


@pytest.mark.parametrize("arch, tied", CASES)
def test_import_gives_huggingface_logits(tmp_path, arch, tied):
    hf = hf_model(arch, tied)
    hf.save_pretrained(tmp_path / "hf", safe_serialization=True)
    out = run("import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    assert f"({arch},"  in out
    config = mt.checkpoint_config(str(tmp_path / "ckpt"))
    assert config.tie_embeddings == tied
    model = mt.GPTModel(config.replace(seed=99))  # other weights until loaded
    assert mt.load_checkpoint(model, str(tmp_path / "ckpt")) == 0
    x = ids()
    want, got = hf_logits(hf, x), mt_logits(model, x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch, tied", CASES)
def test_export_loads_in_transformers(tmp_path, arch, tied):
    fields = dict(hidden_size=32, num_attention_heads=4, num_layers=2, seq_length=SEQ, vocab_size=VOCAB,
                  tie_embeddings=tied, init_std=0.2, seed=11)
    if arch == "llama":
        fields.update(num_query_groups=2, ffn_hidden_size=48, normalization="RMSNorm", activation="swiglu",
                      position_embedding_type="rope", add_bias_linear=False, norm_epsilon=1e-6)
    model = mt.GPTModel(mt.TransformerConfig(**fields))
    with torch.no_grad():
        for name, p in model.state_dict().items():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    mt.save_checkpoint(model, str(tmp_path / "ckpt"), 4)
    run("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "hf")
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert hf_config["model_type"] == arch
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    assert type(hf).__name__ == ("GPT2LMHeadModel" if arch == "gpt2" else "LlamaForCausalLM")
    x = ids()
    torch.testing.assert_close(hf_logits(hf, x), mt_logits(model, x), rtol=1e-4, atol=1e-4)


def test_export_refuses_other_architectures(tmp_path):
    model = mt.GPTModel(mt.TransformerConfig(hidden_size=32, num_attention_heads=4, num_layers=1, seq_length=8,
                                             vocab_size=VOCAB, normalization="RMSNorm"))
    mt.save_checkpoint(model, str(tmp_path / "ckpt"), 0)
    out = subprocess.run([CLI, "export", "--load", str(tmp_path / "ckpt"), "--hf-dir", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "neither GPT-2" in out.stderr
