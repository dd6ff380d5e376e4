"""load_checkpoint validates metadata.json (and latest_checkpointed_iteration.txt) before use.

Each case damages one field of a freshly saved checkpoint. Loading it must fail with an
error naming the field or file: in a child process, an ordinary Python exception (exit
status 1), not a signal from a division by zero or a read out of bounds; in this process,
a RuntimeError that leaves every parameter byte-identical (validation is part of planning,
before the first copy).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

import megatorch.cpp as mt

BIN = os.environ.get("MEGATORCH_BIN_DIR", os.path.join(os.path.dirname(__file__), "..", "..", "..", "build", "bin"))
CLI = os.path.join(BIN, "megatorch-hf")

CONFIG = dict(hidden_size=32, num_attention_heads=4, num_layers=1, seq_length=8, vocab_size=64)
KEY = "model/embedding.weight"  # partitioned along dim 0, padded rows: every field matters


def piece(meta):
    return meta["tensors"][KEY]["pieces"][0]


def set_piece(field, value):
    def mutate(meta, tmp_path):
        piece(meta)[field] = value
    return mutate


def absolute_file(meta, tmp_path):
    piece(meta)["file"] = str(tmp_path / "ckpt" / "iter_0000003" / "rank_00000.safetensors")


def begin_after_end(meta, tmp_path):
    piece(meta).update(begin=100, end=50)


def negative_shape(meta, tmp_path):
    meta["tensors"][KEY]["shape"] = [-64, 32]


def no_pieces(meta, tmp_path):
    del meta["tensors"][KEY]["pieces"]


def no_files(meta, tmp_path):
    del meta["files"]


# (id, mutation of the parsed metadata, or raw text for metadata.json / latest file, words the error names)
CASES = [
    ("parts_0", set_piece("parts", 0), ["pieces[0]", "parts 0"]),
    ("world_0", set_piece("world", 0), ["pieces[0]", "world 0"]),
    ("partition_dim_5", set_piece("partition_dim", 5), ["pieces[0]", "partition dim", "got 5"]),
    ("begin_after_end", begin_after_end, ["pieces[0]", "range", "[100, 50)"]),
    ("end_beyond_numel", set_piece("end", 10**6), ["pieces[0]", "range", "1000000"]),
    ("world_string", set_piece("world", "1"), ["pieces[0].world", "expected an integer"]),
    ("negative_full_shape", set_piece("full_shape", [-128, 32]), ["pieces[0].full_shape", "sizes >= 0"]),
    ("negative_shape", negative_shape, ["shape", "sizes >= 0"]),
    ("file_parent", set_piece("file", "../x.safetensors"), ["pieces[0].file", "leaves the checkpoint directory"]),
    ("file_absolute", absolute_file, ["pieces[0].file", "leaves the checkpoint directory"]),
    ("bad_dtype", set_piece("dtype", "F99"), ["pieces[0].dtype", "F99"]),
    ("missing_pieces", no_pieces, ["pieces", "missing"]),
    ("missing_files", no_files, ["files", "missing"]),
    ("huge_padding", set_piece("full_shape", [2**40, 32]), ["pieces[0]", "full_shape"]),
    ("not_json", ("metadata", "{not json"), ["metadata.json", "not valid JSON"]),
    ("json_list", ("metadata", "[]"), ["metadata.json", "not a megatorch checkpoint"]),
    ("latest_word", ("latest", "abc\n"), ["latest_checkpointed_iteration.txt", "abc"]),
    ("latest_negative", ("latest", "-3\n"), ["latest_checkpointed_iteration.txt", "-3"]),
    ("latest_overflow", ("latest", "9" * 30 + "\n"), ["latest_checkpointed_iteration.txt", "999"]),
]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint of a model with seed 1 and a model with other weights (seed 2)."""
    root = tmp_path_factory.mktemp("saved")
    mt.save_checkpoint(mt.GPTModel(mt.TransformerConfig(**CONFIG, seed=1)), str(root / "ckpt"), 3)
    return root / "ckpt"


def damaged(saved, tmp_path, mutation):
    ckpt = tmp_path / "ckpt"
    subprocess.run(["cp", "-r", str(saved), str(ckpt)], check=True)
    meta_path = ckpt / "iter_0000003" / "metadata.json"
    if isinstance(mutation, tuple):
        which, text = mutation
        (meta_path if which == "metadata" else ckpt / "latest_checkpointed_iteration.txt").write_text(text)
    else:
        meta = json.loads(meta_path.read_text())
        mutation(meta, tmp_path)
        meta_path.write_text(json.dumps(meta))
    return ckpt


def test_the_undamaged_checkpoint_loads(saved):
    # Guards the cases below: they fail because of their one change, not the setup.
    model = mt.GPTModel(mt.TransformerConfig(**CONFIG, seed=2))
    assert mt.load_checkpoint(model, str(saved)) == 3
    ref = dict(mt.GPTModel(mt.TransformerConfig(**CONFIG, seed=1)).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name]), name


@pytest.mark.parametrize("mutation,named", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_damaged_metadata_fails_by_name_in_a_child(saved, tmp_path, mutation, named):
    ckpt = damaged(saved, tmp_path, mutation)
    code = (f"import megatorch.cpp as mt; m = mt.GPTModel(mt.TransformerConfig(**{CONFIG!r}, seed=2)); "
            f"mt.load_checkpoint(m, {str(ckpt)!r})")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    # 1: an exception; a negative status is a signal (SIGFPE, SIGSEGV, SIGABRT).
    assert out.returncode == 1, f"status {out.returncode}\n{out.stderr}"
    assert "RuntimeError" in out.stderr, out.stderr
    for word in named:
        assert word in out.stderr, f"{word!r} not in\n{out.stderr}"
    assert "json.exception" not in out.stderr or "not valid JSON" in out.stderr, out.stderr


@pytest.mark.parametrize("mutation,named", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_damaged_metadata_leaves_the_weights_unchanged(saved, tmp_path, mutation, named):
    ckpt = damaged(saved, tmp_path, mutation)
    model = mt.GPTModel(mt.TransformerConfig(**CONFIG, seed=2))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="megatorch"):
        mt.load_checkpoint(model, str(ckpt))
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    for name, p in before.items():
        # Byte-identical: the same bits, not merely close values.
        assert torch.equal(after[name].detach().view(torch.uint8), p.view(torch.uint8)), name


@pytest.mark.parametrize("case", ["world_0", "latest_word"])
def test_a_tool_reports_damaged_metadata_in_one_line(saved, tmp_path, case):
    # megatorch-hf export --load goes through load_checkpoint: exit 1, the message once,
    # no C++ backtrace.
    mutation, named = next(c[1:] for c in CASES if c[0] == case)
    ckpt = damaged(saved, tmp_path, mutation)
    out = subprocess.run([CLI, "export", "--load", str(ckpt), "--hf-dir", str(tmp_path / "hf")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, f"status {out.returncode}\n{out.stderr}"
    for word in named:
        assert word in out.stderr, f"{word!r} not in\n{out.stderr}"
    assert "Exception raised from" not in out.stderr, out.stderr
    assert "megatorch: megatorch:" not in out.stderr, out.stderr
