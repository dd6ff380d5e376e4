"""Outputs are written atomically and write errors are seen (include/megatorch/io/atomic_file.h):
a failed megatorch-preprocess leaves the previous .bin/.idx byte-identical, and a full disk
(here a file size limit, RLIMIT_FSIZE, whose writes fail with EFBIG) makes megatorch-preprocess,
megatorch-hf export, megatorch-dataset samples and gpt_pretrain --log-json exit non-zero naming
the file, without a signal, a partial target or a temporary file left behind."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
PREPROCESS = str(BIN / "megatorch-preprocess")
DATASET = str(BIN / "megatorch-dataset")
HF = str(BIN / "megatorch-hf")
TRAIN = str(BIN / "gpt_pretrain")
DATA = ROOT / "data" / "default" / "stdlib_docs_text_document"
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--vocab-size", "257", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "3e-3",
         "--data-path", str(DATA), "--eval-iters", "1", "--log-interval", "1", "--seed", "11"]

# Runs argv with writes past `limit` bytes per file failing with EFBIG (SIGXFSZ ignored,
# so the error reaches the program instead of killing it).
LIMITED = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
           "n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_FSIZE, (n, n)); "
           "os.execv(sys.argv[2], sys.argv[2:])")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(*args, limit=None):
    argv = [*map(str, args)]
    if limit is not None:
        argv = [sys.executable, "-c", LIMITED, str(limit), *argv]
    # One process of a world of one (gpt_pretrain reads torchrun's variables).
    env = dict(os.environ, OMP_NUM_THREADS="1", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


def snapshot(directory):
    return {p.name: p.read_bytes() for p in sorted(Path(directory).iterdir()) if p.is_file()}


def no_temporaries(directory):
    return [p.name for p in Path(directory).iterdir() if ".tmp." in p.name] == []


def write_jsonl(path, n, bad_line=None):
    lines = [json.dumps({"text": f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 4})
             for i in range(n)]
    if bad_line is not None:
        lines[bad_line] = "this line is not JSON"
    path.write_text("\n".join(lines) + "\n")


def test_failed_preprocess_leaves_the_previous_dataset(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    prefix = out / "d"
    write_jsonl(tmp_path / "a.jsonl", 5)
    assert run(PREPROCESS, "--input", tmp_path / "a.jsonl", "--output-prefix", prefix).returncode == 0
    before = snapshot(out)
    assert set(before) == {"d_text_document.bin", "d_text_document.idx"}

    # Line 1101 fails after the first two batches of 512 lines were written to the new .bin.
    write_jsonl(tmp_path / "bad.jsonl", 1200, bad_line=1100)
    r = run(PREPROCESS, "--input", tmp_path / "bad.jsonl", "--output-prefix", prefix, "--workers", 1)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "line 1101 is not valid JSON" in r.stderr, r.stderr
    assert snapshot(out) == before  # byte-identical, and no temporary file left behind

    write_jsonl(tmp_path / "b.jsonl", 9)
    assert run(PREPROCESS, "--input", tmp_path / "b.jsonl", "--output-prefix", prefix).returncode == 0
    after = snapshot(out)
    assert set(after) == set(before)
    assert len(after["d_text_document.bin"]) > len(before["d_text_document.bin"])
    info = json.loads(run(DATASET, "info", out / "d_text_document").stdout)
    assert info["documents"] == 9


def test_preprocess_on_a_full_disk_fails_naming_the_file(tmp_path):
    prefix = tmp_path / "d"
    write_jsonl(tmp_path / "in.jsonl", 2000)  # ~400 KB of uint16 tokens, past the 64 KiB limit
    r = run(PREPROCESS, "--input", tmp_path / "in.jsonl", "--output-prefix", prefix, limit=64 << 10)
    assert r.returncode == 1, r.stdout + r.stderr  # an error, not SIGXFSZ (negative) nor exit 0
    assert f"{prefix}_text_document.bin" in r.stderr and "File too large" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]  # no partial target, no temporary


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    r = run(TRAIN, *MODEL, "--train-iters", "1", "--save", root / "ckpt")
    assert r.returncode == 0, r.stdout + r.stderr
    return root / "ckpt"


def test_hf_export_on_a_full_disk_keeps_the_previous_export(tmp_path, checkpoint):
    hf = tmp_path / "hf"
    r = run(HF, "export", "--load", checkpoint, "--hf-dir", hf)
    assert r.returncode == 0, r.stdout + r.stderr
    before = snapshot(hf)
    assert set(before) == {"config.json", "model.safetensors"}
    assert len(before["model.safetensors"]) > 64 << 10

    r = run(HF, "export", "--load", checkpoint, "--hf-dir", hf, limit=64 << 10)
    assert r.returncode == 1, r.stdout + r.stderr
    assert str(hf / "model.safetensors") in r.stderr and "File too large" in r.stderr, r.stderr
    assert snapshot(hf) == before  # the earlier export whole, and no temporary file

    fresh = tmp_path / "fresh"
    r = run(HF, "export", "--load", checkpoint, "--hf-dir", fresh, limit=64 << 10)
    assert r.returncode == 1, r.stdout + r.stderr
    assert snapshot(fresh) == {}  # neither file half-written


def test_dataset_samples_on_a_full_disk_fails_naming_the_file(tmp_path):
    r = run(DATASET, "samples", "--data-path", DATA, "--seq-length", 32, "--num-samples", 2000, 10, 10, "--out",
            tmp_path, limit=64 << 10)
    assert r.returncode == 1, r.stdout + r.stderr
    assert str(tmp_path / "train.bin") in r.stderr and "File too large" in r.stderr, r.stderr
    assert snapshot(tmp_path) == {}
    assert no_temporaries(tmp_path)


def test_log_json_write_failure_stops_the_run(tmp_path):
    log = tmp_path / "log.jsonl"
    # One line of the log is ~500 bytes: the first iterations fit, a later one does not.
    r = run(TRAIN, *MODEL, "--train-iters", "50", "--log-json", log, limit=2000)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"writing the --log-json file '{log}' failed" in r.stderr and "File too large" in r.stderr, r.stderr
    lines = log.read_text().splitlines()
    assert 0 < len(lines) < 50
