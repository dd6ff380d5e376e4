"""Data that would train on garbage fails before step 1, with a message naming the numbers:
token ids outside the model's vocabulary (the largest id cached beside the data), a
dataset too small for one sample, and a JSONL line longer than --max-line-bytes.
Each gpt_pretrain run is one process (world size 1) that fails while setting up."""
import json
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
TRAIN = BIN / "gpt_pretrain"
PREPROCESS = BIN / "megatorch-preprocess"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "3e-3", "--eval-iters", "0",
         "--log-interval", "1", "--seed", "11", "--device", "cpu", "--split", "100,0,0", "--train-iters", "2"]

pytestmark = pytest.mark.skipif(not (TRAIN.exists() and PREPROCESS.exists()),
                                reason=f"{TRAIN} / {PREPROCESS} not built (scripts/build.sh)")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, timeout=120):
    """A tool, or gpt_pretrain as the only rank of a world of one (torchrun's variables)."""
    env = {k: v for k, v in os.environ.items() if k != "MEGATORCH_COMM_TIMEOUT_S"}
    env.update(OMP_NUM_THREADS="1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, env=env)


def assert_fails(out, *needles):
    """A clean failure: an exit status (a negative one is a signal), the numbers, no backtrace."""
    assert out.returncode > 0, (out.returncode, out.stderr[-3000:])
    assert "Exception raised from" not in out.stderr, out.stderr[-3000:]
    for n in needles:
        assert n in out.stderr, (n, out.stderr[-3000:])


def preprocess(tmp_path, name, docs, *flags, key="text"):
    jsonl = tmp_path / f"{name}.jsonl"
    jsonl.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))
    out = run([PREPROCESS, "--input", jsonl, "--output-prefix", tmp_path / name, "--json-keys", key, *flags])
    assert out.returncode == 0, out.stderr
    return tmp_path / f"{name}_{key}_document"


@pytest.fixture
def bytelevel(tmp_path):
    """A ByteLevel dataset: ids up to 256 (the end-of-document id)."""
    docs = [f"document {i}: " + "some text to train on " * 5 for i in range(20)]
    return preprocess(tmp_path, "bl", docs, "--tokenizer-type", "ByteLevel", "--append-eod")


def test_ids_outside_the_vocabulary_fail_and_the_largest_id_is_cached(bytelevel):
    prefix = bytelevel
    cache = Path(f"{prefix}.max_id.json")
    small_vocab = [*MODEL, "--data-path", prefix, "--tokenizer-type", "PreTokenized", "--vocab-size", "200",
                   "--eod-id", "0"]
    out = run([TRAIN, *small_vocab])
    assert_fails(out, str(prefix), "largest id 256", "vocabulary has 200 ids", "--vocab-size", "--tokenizer-type")
    assert out.stderr.count("largest id 256") == 1
    # The scan is cached beside the data, keyed by the .bin it describes.
    saved = json.loads(cache.read_text())
    assert saved["max_id"] == 256 and saved["min_id"] >= 0
    assert saved["bin_bytes"] == Path(f"{prefix}.bin").stat().st_size
    assert not list(cache.parent.glob("*.tmp.*"))  # written through a temporary file, renamed

    # Reused: a run reads the cached number rather than scanning again.
    saved["max_id"] = 123456
    cache.write_text(json.dumps(saved))
    assert_fails(run([TRAIN, *small_vocab]), "largest id 123456")

    # Invalidated by a changed .bin (the same bytes with a new mtime count as changed).
    st = Path(f"{prefix}.bin").stat()
    os.utime(f"{prefix}.bin", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert_fails(run([TRAIN, *small_vocab]), "largest id 256")
    assert json.loads(cache.read_text())["max_id"] == 256

    # The data's own vocabulary trains (ByteLevel: 257 ids).
    ok = run([TRAIN, *MODEL, "--data-path", prefix, "--vocab-size", "257"])
    assert ok.returncode == 0, ok.stderr[-3000:]


def test_an_id_inside_the_padding_fails(tmp_path):
    # 257 ids pad to 384 rows; id 300 has a row (an untrained one) but no token.
    docs = [[(7 * i + j) % 250 for j in range(60)] + ([300] if i == 3 else []) for i in range(10)]
    prefix = preprocess(tmp_path, "pt", docs, "--tokenizer-type", "PreTokenized", "--vocab-size", "1000", key="ids")
    out = run([TRAIN, *MODEL, "--data-path", prefix, "--vocab-size", "257"])
    assert_fails(out, str(prefix), "largest id 300", "vocabulary has 257 ids")
    # A weighted blend checks every prefix: the bad one is named.
    good = preprocess(tmp_path, "good", [[(3 * i + j) % 250 for j in range(60)] for i in range(10)],
                      "--tokenizer-type", "PreTokenized", "--vocab-size", "257", key="ids")
    out = run([TRAIN, *MODEL, "--data-path", "0.5", good, "0.5", prefix, "--vocab-size", "257"])
    assert_fails(out, str(prefix), "largest id 300")
    assert f"dataset {good} " not in out.stderr


def test_a_dataset_smaller_than_one_sample_fails_fast(tmp_path):
    prefix = preprocess(tmp_path, "tiny", ["hello"], "--tokenizer-type", "ByteLevel", "--append-eod")
    out = run([TRAIN, *MODEL, "--data-path", prefix, "--vocab-size", "257"], timeout=60)
    assert_fails(out, str(prefix), "train split", "1 documents, 6 tokens", "has 6 tokens",
                 "fewer than one sample of 33 tokens (--seq-length 32 + 1)", "8 samples were requested")


def test_a_line_over_max_line_bytes_fails_with_its_number(tmp_path):
    lines = [json.dumps({"text": "short"}), json.dumps({"text": "also short"}), json.dumps({"text": "x" * 500}),
             json.dumps({"text": "after"})]
    big = tmp_path / "big.jsonl"
    big.write_text("\n".join(lines) + "\n")
    out = run([PREPROCESS, "--input", big, "--output-prefix", tmp_path / "big", "--tokenizer-type", "ByteLevel",
               "--max-line-bytes", "100"])
    assert_fails(out, f"{big} line 3 is longer than --max-line-bytes 100")
    # Lines within the limit (the last one without a newline) are read as before, and the
    # output equals the default limit's.
    small = tmp_path / "small.jsonl"
    small.write_text("\n".join(lines[:2] + ["", lines[3]]))
    tokens = []
    for name, flags in (("limited", ["--max-line-bytes", "100"]), ("default", [])):
        out = run([PREPROCESS, "--input", small, "--output-prefix", tmp_path / name, "--tokenizer-type", "ByteLevel",
                   *flags])
        assert out.returncode == 0, out.stderr
        assert "processed 3 documents" in out.stdout
        tokens.append(np.fromfile(tmp_path / f"{name}_text_document.bin", dtype=np.uint16))
    assert tokens[0].tobytes() == tokens[1].tobytes()
    assert bytes(tokens[0].astype(np.uint8)) == b"shortalso shortafter"
    # A line exactly at the limit is accepted.
    exact = tmp_path / "exact.jsonl"
    exact.write_text(lines[0] + "\n")
    out = run([PREPROCESS, "--input", exact, "--output-prefix", tmp_path / "exact", "--tokenizer-type", "ByteLevel",
               "--max-line-bytes", str(len(lines[0]))])
    assert out.returncode == 0, out.stderr
    out = run([PREPROCESS, "--input", exact, "--output-prefix", tmp_path / "exact", "--tokenizer-type", "ByteLevel",
               "--max-line-bytes", str(len(lines[0]) - 1)])
    assert_fails(out, "line 1 is longer than")
