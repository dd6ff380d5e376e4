"""Imported and loaded configurations are validated (build/bin/megatorch-hf import,
csrc/ckpt/hf_convert.cpp; checkpoint model_config, csrc/ckpt/gpt_checkpoint.cpp).

A config.json with zero heads, a negative layer count, a vocabulary that disagrees with the
embedding rows, indivisible heads, a string where an integer belongs, or a weight of the
wrong shape is refused by name: exit code 1 (not a signal such as SIGFPE), the field or
HF tensor named, no C++ backtrace, and no checkpoint written under --save. The unedited
models import (so each refusal is the edit's doing).
"""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import transformers  # a requirement (requirements.txt): missing, this test fails, not skips
import megatorch.cpp as mt  # noqa: E402

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
CLI = str(BIN / "megatorch-hf")
VOCAB, SEQ = 200, 16


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Llama (4 heads, 2 key/value heads) and GPT-2, as save_pretrained writes them."""
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    llama = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    transformers.LlamaForCausalLM(llama).save_pretrained(root / "llama", safe_serialization=True)
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(gpt2).save_pretrained(root / "gpt2", safe_serialization=True)
    return root


def edited(saved, tmp_path, arch, config=None, tensors=None):
    """A copy of the saved `arch` model with config.json fields replaced and tensors replaced
    (name -> tensor, or a function of the old tensor)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    data = json.loads((saved / arch / "config.json").read_text())
    data.update(config or {})
    (hf / "config.json").write_text(json.dumps(data))
    if tensors:
        weights = load_file(saved / arch / "model.safetensors")
        for name, new in tensors.items():
            assert name in weights, sorted(weights)  # the edit must hit a tensor the file has
            weights[name] = new(weights[name]) if callable(new) else new
        save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    else:
        shutil.copy(saved / arch / "model.safetensors", hf / "model.safetensors")
    return hf


def refused(hf, ckpt):
    out = cli("import", "--hf-dir", hf, "--save", ckpt)
    assert out.returncode == 1, f"rc {out.returncode}\n{out.stdout}{out.stderr}"  # a signal is negative
    assert "Exception raised from" not in out.stderr, out.stderr
    assert not ckpt.exists(), sorted(p.name for p in ckpt.iterdir())  # nothing half-written
    return out.stderr


@pytest.mark.parametrize("arch, final_norm", [("llama", "model.norm.weight"), ("gpt2", "transformer.ln_f.weight")])
def test_unedited_models_import(saved, tmp_path, arch, final_norm):
    # Rewritten through safetensors unchanged: the editing itself leaves an importable model.
    hf = edited(saved, tmp_path, arch, tensors={final_norm: lambda t: t})
    out = cli("import", "--hf-dir", hf, "--save", tmp_path / "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    assert (mt.checkpoint_config(str(tmp_path / "ckpt")).vocab_size, arch in out.stdout) == (VOCAB, True)


CONFIGS = [
    # (arch, config.json fields, what stderr must name)
    ("llama", dict(num_attention_heads=0), "'num_attention_heads' to be an integer >= 1, got 0"),
    ("gpt2", dict(n_head=0), "'n_head' to be an integer >= 1, got 0"),
    ("llama", dict(num_hidden_layers=-1), "'num_hidden_layers' to be an integer >= 1, got -1"),
    ("gpt2", dict(n_layer=0), "'n_layer' to be an integer >= 1, got 0"),
    ("llama", dict(vocab_size=0), "'vocab_size' to be an integer >= 1, got 0"),
    ("llama", dict(hidden_size=30, head_dim=None), "hidden_size (30) to be divisible by num_attention_heads (4)"),
    # With head_dim given, heads x head_dim need not be the hidden size (Qwen3): the weights say no.
    ("llama", dict(hidden_size=30), f"'model.embed_tokens.weight' of shape [{VOCAB}, 30] (from config.json)"),
    ("gpt2", dict(n_embd=30), "n_embd (30) to be divisible by n_head (4)"),
    ("llama", dict(num_key_value_heads=3), "num_attention_heads (4) to be divisible by num_key_value_heads (3)"),
    ("llama", dict(intermediate_size="48"), "'intermediate_size' to be an integer, got \"48\""),
    ("llama", dict(max_position_embeddings=16.0), "'max_position_embeddings' to be an integer, got 16.0"),
    ("gpt2", dict(tie_word_embeddings="yes"), "'tie_word_embeddings' to be true or false"),
    ("llama", dict(rms_norm_eps=0.0), "norm_epsilon > 0, got 0"),
    # The config alone is valid; the weights are not its model.
    ("llama", dict(vocab_size=VOCAB - 1),
     f"'model.embed_tokens.weight' of shape [{VOCAB - 1}, 32] (from config.json), got [{VOCAB}, 32]"),
    ("gpt2", dict(vocab_size=VOCAB + 1), f"'transformer.wte.weight' of shape [{VOCAB + 1}, 32]"),
    ("gpt2", dict(n_positions=2 * SEQ), f"'transformer.wpe.weight' of shape [{2 * SEQ}, 32] (from config.json), "
                                        f"got [{SEQ}, 32]"),
    ("llama", dict(intermediate_size=64), "'model.layers.0.mlp.gate_proj.weight' of shape [64, 32]"),
    ("llama", dict(num_key_value_heads=1), "'model.layers.0.self_attn.k_proj.weight' of shape [8, 32] "
                                           "(from config.json), got [16, 32]"),
]


@pytest.mark.parametrize("arch, fields, named", CONFIGS, ids=[f"{a}-{next(iter(f))}={next(iter(f.values()))}"
                                                              for a, f, _ in CONFIGS])
def test_bad_config_json_refused_by_name(saved, tmp_path, arch, fields, named):
    err = refused(edited(saved, tmp_path, arch, fields), tmp_path / "ckpt")
    assert named in err, err


def test_wrong_shaped_q_proj_refused_before_regrouping(saved, tmp_path):
    # [16, 64] has q_proj's 1024 elements: without the shape check it would reshape silently.
    name = "model.layers.1.self_attn.q_proj.weight"
    hf = edited(saved, tmp_path, "llama", tensors={name: lambda t: t.reshape(16, 64)})
    err = refused(hf, tmp_path / "ckpt")
    assert f"'{name}' of shape [32, 32] (from config.json), got [16, 64]" in err, err


def test_integer_weights_refused(saved, tmp_path):
    hf = edited(saved, tmp_path, "llama", tensors={"model.norm.weight": lambda t: t.to(torch.int32)})
    err = refused(hf, tmp_path / "ckpt")
    assert "'model.norm.weight' to be floating-point" in err and "Int" in err, err


def test_checkpoint_model_config_validated_on_load(saved, tmp_path):
    """What a checkpoint's metadata.json says is validated like an import: zero heads or a
    fractional layer count is refused by name (Python and megatorch-hf export alike)."""
    out = cli("import", "--hf-dir", saved / "llama", "--save", tmp_path / "ckpt")
    assert out.returncode == 0, out.stdout + out.stderr
    meta = tmp_path / "ckpt" / "iter_0000000" / "metadata.json"
    good = json.loads(meta.read_text())
    for field, value, named in [("num_attention_heads", 0, "num_attention_heads"),
                                ("num_layers", 2.5, "expected num_layers to be an integer, got 2.5"),
                                ("num_query_groups", 3, "divisible by num_query_groups (3)"),
                                ("norm_epsilon", -1e-6, "norm_epsilon > 0")]:
        data = json.loads(json.dumps(good))
        data["model_config"][field] = value
        meta.write_text(json.dumps(data))
        with pytest.raises(RuntimeError, match=r"checkpoint model_config") as e:
            mt.checkpoint_config(str(tmp_path / "ckpt"))
        assert named in str(e.value)
        out = cli("export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "back")
        assert out.returncode == 1 and named in out.stderr, out.stdout + out.stderr
        assert "Exception raised from" not in out.stderr
    meta.write_text(json.dumps(good))
    assert mt.checkpoint_config(str(tmp_path / "ckpt")).num_attention_heads == 4
