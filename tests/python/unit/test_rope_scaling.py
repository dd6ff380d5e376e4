"""RoPE scaling and partial rotary (include/megatorch/transformer/rope.h) against transformers.

Tiny randomly initialised LlamaForCausalLM models with each rope_type transformers implements
and megatorch imports (linear, dynamic NTK, yarn with derived and explicit attention factor,
llama3), written by transformers in both spellings of config.json (transformers 5's
rope_parameters; 4.x's rope_scaling with "type"): imported with megatorch-hf, the logits of
sequences twice as long as the original context equal transformers' (1e-5 relative to their
magnitude, fp32); greedy generation past the original context equals transformers'
generate at TP1 and TP2; exported back, transformers loads the same RoPE. megatorch's own
--rotary-percent trains, and its export is refused as no Llama rotates part of a head.
"""
import json
from pathlib import Path

import pytest
import torch

import transformers  # a requirement (requirements.txt): missing, this test fails, not skips
import megatorch.cpp as mt  # noqa: E402
from binaries import launch, run
from tolerance import assert_close

VOCAB, ORIGINAL, SEQ, NEW = 200, 8, 16, 6

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn_explicit": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                      "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.3, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 2.0,
               "original_max_position_embeddings": ORIGINAL},
}



def hf_model(name):
    torch.manual_seed(0)
    scaling = dict(SCALINGS[name])
    # Dynamic NTK scales above max_position_embeddings; the others keep 2 x SEQ positions.
    positions = ORIGINAL if scaling["rope_type"] == "dynamic" else 2 * SEQ
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                                      rms_norm_eps=1e-6, rope_parameters={**scaling, "rope_theta": 10000.0})
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # peaked logits: no argmax ties in generation, every tensor matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    model.generation_config.eos_token_id = None
    return model.eval().float()


def saved(tmp_path, name, spelling):
    model = hf_model(name)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    if spelling == "4.x":  # rope_theta at the top, rope_scaling with "type"
        path = tmp_path / "hf" / "config.json"
        config = json.loads(path.read_text())
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        rope["type"] = rope.pop("rope_type")
        config["rope_scaling"] = rope
        path.write_text(json.dumps(config))
    return model


def logits(model, x):
    with torch.no_grad():
        return model(x)[:, :, :VOCAB].transpose(0, 1)


@pytest.mark.parametrize("spelling", ["5.x", "4.x"])
@pytest.mark.parametrize("name", list(SCALINGS))
def test_import_gives_transformers_logits_beyond_the_original_context(tmp_path, name, spelling):
    hf = saved(tmp_path, name, spelling)
    run("megatorch-hf", "import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    config = mt.checkpoint_config(str(tmp_path / "ckpt"))
    want_type = SCALINGS[name]["rope_type"]
    assert config.rope_scaling["rope_type"] == want_type
    assert config.rope_scaling["factor"] == SCALINGS[name]["factor"]
    model = mt.GPTModel(config.replace(seed=99))
    assert mt.load_checkpoint(model, str(tmp_path / "ckpt")) == 0
    x = torch.randint(VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=x).logits
    assert_close(logits(model, x), want)
    # Without the scaling the logits differ: the test can see a wrong RoPE.
    plain = mt.GPTModel(config.replace(rope_scaling=None))
    mt.load_checkpoint(plain, str(tmp_path / "ckpt"))
    assert not torch.allclose(logits(plain, x), want, rtol=1e-3, atol=1e-3)
    # Exported: transformers reads the same RoPE (5.x spelling) and gives the same logits.
    run("megatorch-hf", "export", "--load", tmp_path / "ckpt", "--hf-dir", tmp_path / "back")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert back.config.rope_parameters["rope_type"] == want_type
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, want)


@pytest.mark.parametrize("name", ["linear", "yarn", "llama3", "dynamic"])
def test_greedy_generation_past_the_original_context_equals_transformers(tmp_path, name):
    hf = saved(tmp_path, name, "5.x")
    run("megatorch-hf", "import", "--hf-dir", tmp_path / "hf", "--save", tmp_path / "ckpt")
    prompts = [[5, 17, 99, 3, 8, 1, 2], [42, 7, 7, 7, 7, 7]]  # 7 + 6 tokens: past ORIGINAL = 8
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"ids": p}) + "\n" for p in prompts))
    for tp in (1, 2):
        out = tmp_path / f"out_tp{tp}.jsonl"
        run("megatorch-generate", "--load", tmp_path / "ckpt", "--prompts-file", tmp_path / "prompts.jsonl",
            "--max-new-tokens", NEW, "--output-json", out, "--tensor-model-parallel-size", tp, "--ignore-eod",
            nproc=tp)
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        for prompt, line in zip(prompts, lines):
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
            assert line["generated_ids"] == want, (tp, prompt, line)


def test_rope_scaling_validation_names_what_is_missing():
    c = mt.TransformerConfig(hidden_size=32, num_attention_heads=4, position_embedding_type="rope")
    with pytest.raises(ValueError, match="expected a scaling factor >= 1"):
        c.replace(rope_scaling={"rope_type": "linear", "factor": 0.5})
    with pytest.raises(ValueError, match="needs the context it extends"):
        c.replace(rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="rope_type 'default', 'linear', 'dynamic', 'yarn' or 'llama3', got 'longrope'"):
        c.replace(rope_scaling={"rope_type": "longrope"})
    with pytest.raises(RuntimeError, match="rotary-percent"):
        c.replace(rotary_percent=0.1).validate(1)  # 8 x 0.1: no even number of channels
    angles = mt.rope_frequencies(4, c.replace(rotary_percent=0.5))
    assert angles.shape == (4, 1, 1, 4)
    assert torch.equal(angles, mt.rope_frequencies(4, 4))


DATA = Path(__file__).resolve().parents[3] / "data" / "default" / "stdlib_docs_text_document"
LLAMA = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "257", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3",
         "--data-path", str(DATA), "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--train-iters", "4", "--eval-iters", "0", "--seed", "5"]


def losses(path):
    return [json.loads(line)["loss"] for line in Path(path).read_text().splitlines()]


def test_gpt_pretrain_flags_train_the_same_at_tp2_and_record_the_rope(tmp_path):
    """--use-rope-scaling (Llama 3.1's, original context 16 here), --rope-type yarn and
    --rotary-percent 0.5: TP2 gives one rank's losses, the checkpoint records the RoPE, and a
    run with another RoPE refuses to resume it."""
    runs = {"llama3": ["--use-rope-scaling", "--rope-scaling-factor", "4", "--original-max-position-embeddings", "16"],
            "yarn": ["--rope-type", "yarn", "--rope-scaling-factor", "2", "--original-max-position-embeddings", "16"],
            "partial": ["--rotary-percent", "0.5"]}
    for name, flags in runs.items():
        got = {}
        for tp in (1, 2):
            log = tmp_path / f"{name}_{tp}.json"
            run("gpt_pretrain", *LLAMA, *flags, "--tensor-model-parallel-size", tp, "--log-json", log,
                "--save", tmp_path / f"ckpt_{name}_{tp}", nproc=tp, torchrun=True)
            got[tp] = losses(log)
        assert got[2] == pytest.approx(got[1], rel=1e-5), name
        config = mt.checkpoint_config(str(tmp_path / f"ckpt_{name}_1"))
        if name == "partial":
            assert config.rotary_percent == 0.5
        else:
            assert config.rope_scaling["rope_type"] == name
            assert config.rope_scaling["original_max_position_embeddings"] == 16
    assert mt.checkpoint_config(str(tmp_path / "ckpt_llama3_1")).rope_scaling["high_freq_factor"] == 4.0
    out = launch("gpt_pretrain", *LLAMA, "--train-iters", "6", "--load", tmp_path / "ckpt_yarn_1", torchrun=True)
    assert out.returncode != 0 and "rope_scaling" in out.stdout + out.stderr
    # No transformers Llama rotates part of a head: the export says so.
    out = launch("megatorch-hf", "export", "--load", tmp_path / "ckpt_partial_1", "--hf-dir", tmp_path / "partial_hf")
    assert out.returncode == 1 and "rotary_percent" in out.stderr, out.stdout + out.stderr
