"""Continued pretraining of a HuggingFace checkpoint, end to end, as a user runs it:
a ``transformers`` Llama (odd vocabulary, GQA, rope_theta 500000, rms_norm_eps 1e-5, no
biases) -> ``megatorch-hf import`` -> ``gpt_pretrain --use-checkpoint-args --finetune``
at TP2 x PP2 on 4 CPU ranks -> ``megatorch-hf export`` -> ``transformers`` loads it and
gives megatorch's logits."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import transformers
import megatorch.cpp as mt
from tolerance import assert_close

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
# The shipped BPE tokenizer (4096 ids) and the bundled data tokenized with it.
TOKENIZER = ROOT / "data" / "tokenizers" / "default-bpe"
DATA = ROOT / "data" / "default" / "stdlib_docs_bpe_text_document"
VOCAB = 4097  # odd: one row more than the tokenizer has ids, padded to 4352 at TP2
TRAIN = ["--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
         "--lr-warmup-iters", "0", "--data-path", str(DATA), "--eval-iters", "1", "--seed", "5",
         "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(TOKENIZER)]


# A from-scratch model on the byte-level data (vocabulary 257 from the tokenizer type).
BYTE_LEVEL = [*TRAIN[:TRAIN.index("--data-path")], "--data-path", str(ROOT / "data" / "default" / "stdlib_docs_text_document"),
              "--eval-iters", "1", "--seed", "5"]


def run(cmd, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGATORCH_COMM_TIMEOUT_S="60")
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)


def pretrain(nproc, args):
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                "--no-python", BIN / "gpt_pretrain", *args])


def losses(path):
    return {r["iteration"]: r["loss"] for r in map(json.loads, Path(path).read_text().splitlines()) if "loss" in r}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at 1: make every tensor tell its place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp / "hf", safe_serialization=True)
    out = run([BIN / "megatorch-hf", "import", "--hf-dir", tmp / "hf", "--save", tmp / "ckpt"])
    assert out.returncode == 0, out.stdout + out.stderr
    return tmp, model.eval()


def test_import_finetune_at_tp2_pp2_export(imported, tmp_path):
    src, hf = imported
    runs = {"tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]), "single": (1, [])}
    got = {}
    for name, (n, layout) in runs.items():
        log = tmp_path / f"{name}.json"
        out = pretrain(n, ["--use-checkpoint-args", "--finetune", "--load", src / "ckpt", "--save", tmp_path / name,
                           *TRAIN, "--train-iters", "3", *layout, "--log-json", log])
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert "weights only (--finetune), starting at iteration 0" in out.stdout
        got[name] = losses(log)
        assert sorted(got[name]) == [1, 2, 3]
    # The imported weights, read at two layouts: the first loss is the same number.
    assert got["tp2pp2"][1] == pytest.approx(got["single"][1], rel=1e-6)
    for it in (2, 3):
        assert got["tp2pp2"][it] == pytest.approx(got["single"][it], rel=1e-5)

    out = run([BIN / "megatorch-hf", "export", "--load", tmp_path / "tp2pp2", "--hf-dir", tmp_path / "out"])
    assert out.returncode == 0, out.stdout + out.stderr
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    # max_position_embeddings survives training at --seq-length 32 (RoPE: no parameter holds it).
    assert (saved["vocab_size"], saved["num_key_value_heads"], saved["rope_theta"], saved["rms_norm_eps"],
            saved["max_position_embeddings"]) == (VOCAB, 2, 500000.0, 1e-5, 64)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    model = mt.GPTModel(mt.checkpoint_config(str(tmp_path / "tp2pp2")).replace(seed=99))
    assert mt.load_checkpoint(model, str(tmp_path / "tp2pp2")) == 3
    x = torch.randint(VOCAB, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(x)[:, :, :VOCAB].transpose(0, 1)
        got_hf, before = exported(input_ids=x).logits, hf(input_ids=x).logits
    assert_close(got_hf, want)
    assert (got_hf - before).abs().max() > 1e-3  # three steps of training moved the weights


@pytest.mark.parametrize("flags, message", [
    (["--hidden-size", "64"], "--hidden-size 64 disagrees with the checkpoint"),
    (["--disable-bias-linear"], None),  # agrees with the Llama checkpoint: accepted
    (["--vocab-size", "4099"], "--vocab-size 4099 disagrees with the checkpoint"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5 disagrees with the checkpoint"),
])
def test_checkpoint_args_disagreeing_flag_is_an_error(imported, tmp_path, flags, message):
    src, _ = imported
    out = pretrain(1, ["--use-checkpoint-args", "--finetune", "--load", src / "ckpt", *TRAIN, "--train-iters", "1",
                       *flags])
    if message is None:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    else:
        assert out.returncode != 0
        assert message in out.stderr, out.stderr[-3000:]


def test_resume_without_optimizer_or_rng_state(tmp_path):
    """--no-load-optim keeps the weights and the iteration but starts AdamW afresh (the
    loss before the first resumed step is the uninterrupted run's, the next one is not);
    --no-load-rng keeps everything but the generators (dropout draws other masks)."""
    model = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--hidden-dropout", "0.1",
             "--train-iters", "4", *BYTE_LEVEL]
    full = tmp_path / "full.json"
    out = pretrain(1, [*model, "--save", tmp_path / "ckpt", "--save-interval", "2", "--log-json", full])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    want = losses(full)
    shutil.rmtree(tmp_path / "ckpt" / "iter_0000004")
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("2")
    got = {}
    for name, flags in {"resume": [], "no_optim": ["--no-load-optim"], "no_rng": ["--no-load-rng"]}.items():
        log = tmp_path / f"{name}.json"
        out = pretrain(1, [*model, "--load", tmp_path / "ckpt", "--log-json", log, *flags])
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        got[name] = losses(log)
        assert sorted(got[name]) == [3, 4], name
    assert (got["resume"][3], got["resume"][4]) == (want[3], want[4])  # bit for bit
    assert got["no_optim"][3] == want[3] and got["no_optim"][4] != pytest.approx(want[4], rel=1e-6)
    assert got["no_rng"][3] != pytest.approx(want[3], rel=1e-6)


def test_model_vocabulary_smaller_than_the_tokenizer_is_an_error():
    out = pretrain(1, [*TRAIN, "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--vocab-size", "1000", "--train-iters", "1"])
    assert out.returncode != 0
    assert "smaller than the HuggingFaceTokenizer tokenizer's 4096 ids" in out.stderr, out.stderr[-3000:]


def test_checkpoint_from_before_the_qkv_bias_and_window_fields_loads(tmp_path):
    """Fields added to the model config later (add_qkv_bias, sliding_window, max_positions)
    are absent from older checkpoints: absent means off, so those still load; a
    checkpoint that says a field is on does not load into a model without it."""
    fields = dict(hidden_size=32, num_attention_heads=4, num_layers=1, seq_length=8, vocab_size=64)
    mt.save_checkpoint(mt.GPTModel(mt.TransformerConfig(**fields)), str(tmp_path / "ckpt"), 0)
    meta = tmp_path / "ckpt" / "iter_0000000" / "metadata.json"
    data = json.loads(meta.read_text())
    for key in ("add_qkv_bias", "sliding_window", "max_positions"):
        del data["model_config"][key]
    meta.write_text(json.dumps(data))
    assert mt.load_checkpoint(mt.GPTModel(mt.TransformerConfig(**fields)), str(tmp_path / "ckpt")) == 0
    data["model_config"]["add_qkv_bias"] = True
    meta.write_text(json.dumps(data))
    with pytest.raises(RuntimeError, match="add_qkv_bias: checkpoint true, model false"):
        mt.load_checkpoint(mt.GPTModel(mt.TransformerConfig(**fields)), str(tmp_path / "ckpt"))


def test_loading_without_checkpoint_args_must_match_what_the_weights_compute(imported, tmp_path):
    """Without --use-checkpoint-args the flags must describe the checkpoint: besides the
    shapes, the RoPE base and norm epsilon (a Llama-3 resumed with the default base would
    silently train another model). --finetune from a directory without a checkpoint is
    an error, not a run from random weights."""
    src, _ = imported
    shape = ["--num-layers", "4", "--hidden-size", "32", "--ffn-hidden-size", "64", "--num-attention-heads", "4",
             "--group-query-attention", "--num-query-groups", "2", "--vocab-size", str(VOCAB), "--normalization",
             "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--max-position-embeddings", "64"]
    out = pretrain(1, ["--finetune", "--load", src / "ckpt", *TRAIN, *shape, "--train-iters", "1"])
    assert out.returncode != 0
    assert "rotary_base: checkpoint 500000.0, model 10000.0" in out.stderr, out.stderr[-3000:]
    out = pretrain(1, ["--finetune", "--load", src / "ckpt", *TRAIN, *shape, "--rotary-base", "500000",
                       "--norm-epsilon", "1e-5", "--train-iters", "1"])
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out = pretrain(1, ["--finetune", "--load", tmp_path / "nothing", *TRAIN, *shape, "--train-iters", "1"])
    assert out.returncode != 0
    assert "--finetune starts from a checkpoint's weights" in out.stderr, out.stderr[-3000:]
