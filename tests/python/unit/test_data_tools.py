"""megatorch-preprocess and megatorch-dataset as a user runs them: flags, errors that name
the file and the fault, and the dataset bundled in data/default."""
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
PREPROCESS = str(BIN / "megatorch-preprocess")
DATASET = str(BIN / "megatorch-dataset")
BUNDLED = str(ROOT / "data" / "default" / "stdlib_docs_text_document")


def run(*args):
    return subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=120)


@pytest.fixture
def small(tmp_path):
    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"text": "hello"}\n{"text": "world", "title": "t"}\n')
    r = run(PREPROCESS, "--input", jsonl, "--output-prefix", tmp_path / "s", "--append-eod")
    assert r.returncode == 0, r.stderr
    assert "2 documents, 2 sequences, 12 tokens" in r.stdout
    return tmp_path / "s_text_document"


def test_info_and_docs(small):
    info = json.loads(run(DATASET, "info", small).stdout)
    assert info == {"prefix": str(small), "dtype": "uint16", "dtype_code": 8, "sequences": 2, "documents": 2,
                    "tokens": 12, "has_modes": False}
    docs = [json.loads(line)["ids"] for line in run(DATASET, "docs", small).stdout.splitlines()]
    assert docs == [[list(b"hello") + [256]], [list(b"world") + [256]]]


@pytest.mark.parametrize("damage, fault", [
    (lambda p: p.with_suffix(".bin").write_bytes(p.with_suffix(".bin").read_bytes()[:-2]), "truncated"),
    (lambda p: p.with_suffix(".idx").write_bytes(b"NOTANIDX" + p.with_suffix(".idx").read_bytes()[8:]),
     "not a Megatron MMIDIDX index"),
    (lambda p: p.with_suffix(".idx").write_bytes(p.with_suffix(".idx").read_bytes()[:40]), "truncated or corrupt"),
    (lambda p: p.with_suffix(".bin").unlink(), "cannot open"),
])
def test_damaged_files_fail_naming_file_and_fault(small, damage, fault):
    damage(Path(str(small) + ".x"))  # with_suffix replaces ".x": the real .bin/.idx
    for args in (("info", small), ("docs", small),
                 ("samples", "--data-path", small, "--seq-length", 4, "--out", small.parent)):
        r = run(DATASET, *args)
        assert r.returncode == 1, args
        assert str(small) in r.stderr and fault in r.stderr, r.stderr
        assert "Exception raised from" not in r.stderr  # a message, not a C++ backtrace


def test_preprocess_flag_errors(tmp_path, small):
    jsonl = tmp_path / "in.jsonl"
    cases = [
        ((), "--input is required"),
        (("--input", jsonl, "--output-prefix", tmp_path / "o", "--tokenizer-type", "GPT2BPETokenizer"), "tokenizer-type"),
        (("--input", jsonl, "--output-prefix", tmp_path / "o", "--workers", "0"), "workers"),
        (("--input", jsonl, "--output-prefix", tmp_path / "o", "--split-sentences"), "split-sentences"),
        (("--input", jsonl, "--output-prefix", tmp_path / "o", "--json-keys", "body"), "line 1 has no key \"body\""),
        (("--input", jsonl, "--output-prefix", tmp_path / "o", "--tokenizer-type", "PreTokenized"), "--vocab-size"),
        (("--input", tmp_path / "none.jsonl", "--output-prefix", tmp_path / "o"), "cannot open --input"),
    ]
    for args, message in cases:
        r = run(PREPROCESS, *args)
        assert r.returncode != 0, args
        assert message in r.stderr + r.stdout, (args, r.stderr)


def test_samples_split_and_counts(tmp_path, small):
    r = run(DATASET, "samples", "--data-path", small, "--seq-length", 3, "--split", "1", "--num-samples", 5, 0, 0,
            "--out", tmp_path)
    assert r.returncode == 0, r.stderr
    # 12 tokens per epoch, 16 needed for 5 samples of 3 (+1): 2 epochs, (24 - 1) // 3 = 7 samples.
    assert "train 7, valid 0, test 0 samples of 4 tokens" in r.stdout
    assert (tmp_path / "train.bin").stat().st_size == 7 * 4 * 8
    r = run(DATASET, "samples", "--data-path", "0.5", small, "b", "--seq-length", 3, "--out", tmp_path)
    assert r.returncode == 1 and "mixes weights and prefixes" in r.stderr


def test_bundled_dataset_is_valid_english_bytes():
    info = json.loads(run(DATASET, "info", BUNDLED).stdout)
    assert info["dtype"] == "uint16"
    assert info["documents"] == info["sequences"] > 1000
    assert 500_000 < info["tokens"] < 2_000_000
    lines = run(DATASET, "docs", BUNDLED, "--limit", "200").stdout.splitlines()
    assert len(lines) == 200
    words = 0
    for line in lines:
        (ids,) = json.loads(line)["ids"]
        assert ids[-1] == 256 and 256 not in ids[:-1]  # one end-of-document, last
        text = bytes(ids[:-1]).decode("ascii")
        words += sum(text.count(w) for w in (" the ", " of ", " and ", " is ", " a "))
    assert words > 1000  # prose, not noise (200 random-byte documents would have none)


def test_docs_as_text_round_trips_the_bundled_data(tmp_path):
    """megatorch-dataset docs --tokenizer-type prints the documents as {"text": ...} JSONL;
    tokenized again with the same tokenizer they give the same ids (here the first 300 documents of the bundled byte-level data, and of its BPE twin through the shipped
    tokenizer)."""
    cases = [(BUNDLED, ["--tokenizer-type", "ByteLevel"]),
             (str(ROOT / "data" / "default" / "stdlib_docs_bpe_text_document"),
              ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", ROOT / "data/tokenizers/default-bpe/vocab.json",
               "--merge-file", ROOT / "data/tokenizers/default-bpe/merges.txt"])]
    for i, (prefix, tokenizer) in enumerate(cases):
        r = run(DATASET, "docs", prefix, "--limit", "300", *tokenizer)
        assert r.returncode == 0, r.stderr
        jsonl = tmp_path / f"docs{i}.jsonl"
        jsonl.write_text(r.stdout)
        assert all("text" in json.loads(line) for line in r.stdout.splitlines())
        r = run(PREPROCESS, "--input", jsonl, "--output-prefix", tmp_path / f"again{i}", "--append-eod", *tokenizer)
        assert r.returncode == 0, r.stderr
        ids = run(DATASET, "docs", tmp_path / f"again{i}_text_document")
        want = run(DATASET, "docs", prefix, "--limit", "300")
        assert ids.stdout == want.stdout
