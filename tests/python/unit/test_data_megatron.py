"""Megatron compatibility of megatorch's data, checked against megatron-core itself (from the
package index, CPU only): files written by Megatron's IndexedDatasetBuilder read by
megatorch, files written by megatorch-preprocess equal byte for byte to Megatron's builder
fed the same documents and read by Megatron's IndexedDataset, and the GPT samples of every
split equal, sample by sample, to what Megatron's BlendedMegatronDatasetBuilder +
GPTDataset give for the same files, split, sequence length, seed and sample counts."""
import json
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    # megatron-core is a requirement (requirements.txt): missing, this test fails, not skips.
    import megatron.core.datasets.indexed_dataset as mid
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", Path(__file__).resolve().parents[3] / "build" / "bin"))
PREPROCESS = str(BIN / "megatorch-preprocess")
DATASET = str(BIN / "megatorch-dataset")
NUMPY_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float64, np.float32, np.uint16]


def run(*args):
    r = subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def megatron_encode(text_or_sentences, append_eod):
    """preprocess_data.py's Encoder.encode with a byte-level tokenizer (ids 0-255, eod 256)."""
    sentences = text_or_sentences if isinstance(text_or_sentences, list) else [text_or_sentences]
    ids, lens = [], []
    for s in sentences:
        t = list(s.encode("utf-8"))
        if t:
            ids.extend(t)
            lens.append(len(t))
    if ids and append_eod:
        ids.append(256)
        lens[-1] += 1
    return ids, lens


def make_jsonl(path, n_docs, seed):
    rng = np.random.default_rng(seed)
    words = ["the", "model", "reads", "tokens", "from", "a", "memory", "map", "and", "shuffles", "samples",
             "über", "naïve", "déjà", "vu", "—", "pipeline", "stage", "tensor", "parallel"]
    with open(path, "w", encoding="utf-8") as f:
        for d in range(n_docs):
            n = int(rng.integers(0, 120))
            text = " ".join(rng.choice(words, size=n))
            rec = {"text": text, "id": d}
            if d % 17 == 5:
                rec["text"] = [text[: len(text) // 2], "", text[len(text) // 2:]]  # sentences
            f.write(json.dumps(rec, ensure_ascii=d % 2 == 0) + "\n")


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: d.__name__)
def test_files_written_by_megatron_are_read_by_megatorch(tmp_path, dtype):
    prefix = str(tmp_path / "m")
    docs = [[[1, 2, 3], [4]], [], [[5, 6, 7, 8, 127]], [[0]]]
    builder = mid.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in docs[:2]:  # add_item + end_document
        for seq in doc:
            builder.add_item(torch.tensor(seq))
        builder.end_document()
    for doc in docs[2:]:  # add_document
        builder.add_document(torch.tensor([t for seq in doc for t in seq]), [len(seq) for seq in doc])
    builder.finalize(prefix + ".idx")

    info = json.loads(run(DATASET, "info", prefix))
    assert info["dtype"] == dtype.__name__
    assert info["dtype_code"] == mid.DType.code_from_dtype(dtype)
    assert (info["sequences"], info["documents"], info["tokens"]) == (4, 4, 10)
    read = [json.loads(line)["ids"] for line in run(DATASET, "docs", prefix).splitlines()]
    assert read == docs


def test_preprocess_writes_megatrons_bytes_and_megatron_reads_them(tmp_path):
    jsonl = tmp_path / "in.jsonl"
    make_jsonl(jsonl, 60, seed=3)
    with open(jsonl, "a") as f:
        f.write(json.dumps({"text": "", "id": -1}) + "\n")  # an empty document
    run(PREPROCESS, "--input", jsonl, "--output-prefix", tmp_path / "ours", "--json-keys", "text",
        "--tokenizer-type", "ByteLevel", "--append-eod", "--workers", "2")
    ours = str(tmp_path / "ours_text_document")

    theirs = str(tmp_path / "theirs_text_document")
    builder = mid.IndexedDatasetBuilder(theirs + ".bin", dtype=mid.DType.optimal_dtype(257))
    expected = []
    for line in open(jsonl, encoding="utf-8"):
        ids, lens = megatron_encode(json.loads(line)["text"], append_eod=True)
        builder.add_document(torch.tensor(ids, dtype=torch.long), lens)
        expected.append((ids, lens))
    builder.finalize(theirs + ".idx")

    for ext in (".bin", ".idx"):
        assert Path(ours + ext).read_bytes() == Path(theirs + ext).read_bytes(), ext

    ds = mid.IndexedDataset(ours)
    assert ds.index.dtype == np.uint16
    assert len(ds.document_indices) == len(expected) + 1
    k = 0
    for ids, lens in expected:
        start = 0
        for n in lens:
            assert ds[k].tolist() == ids[start:start + n]
            start += n
            k += 1
    assert k == len(ds)


def test_pretokenized_ids_match_megatron_for_a_large_vocabulary(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 100_000, size=int(rng.integers(1, 50))).tolist() for _ in range(40)]
    with open(tmp_path / "ids.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"ids": d}) + "\n")
    run(PREPROCESS, "--input", tmp_path / "ids.jsonl", "--output-prefix", tmp_path / "ours", "--json-keys", "ids",
        "--tokenizer-type", "PreTokenized", "--vocab-size", "100001", "--eod-id", "100000", "--append-eod")
    builder = mid.IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=mid.DType.optimal_dtype(100001))
    for d in docs:
        builder.add_document(torch.tensor(d + [100000]), [len(d) + 1])
    builder.finalize(str(tmp_path / "theirs.idx"))
    assert mid.DType.optimal_dtype(100001) == np.int32
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours_ids_document{ext}").read_bytes() == (tmp_path / f"theirs{ext}").read_bytes()


class _ByteTokenizer:
    """What GPTDataset needs of a tokenizer: the end-of-document id and the vocabulary size
    (no pad id: Megatron then uses -1)."""
    eod = 256
    vocab_size = 257
    unique_identifiers = {"class": "ByteLevel"}


def megatron_datasets(data_path, seq_length, seed, split, sizes):
    config = GPTDatasetConfig(random_seed=seed, sequence_length=seq_length, blend=get_blend_from_list(data_path),
                              split=split, tokenizer=_ByteTokenizer(), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False)
    sizes = [None if n < 0 else n for n in sizes]
    return BlendedMegatronDatasetBuilder(GPTDataset, sizes, lambda: True, config).build()


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpora")
    out = []
    for name, n_docs, seed in (("a", 120, 1), ("b", 50, 2)):
        make_jsonl(d / f"{name}.jsonl", n_docs, seed)
        run(PREPROCESS, "--input", d / f"{name}.jsonl", "--output-prefix", d / name, "--append-eod")
        out.append(str(d / f"{name}_text_document"))
    return out


CASES = {
    # one prefix: 3 epochs of the train split (~1200 samples each), the last used for < 80%
    # and so shuffled on its own
    "single_separate_final_epoch": (["A"], 32, 1234, "90,8,2", [2700, 40, 4]),
    # one prefix: 2 epochs (~2400 samples each), the last used for > 80%: one shuffle
    "single_whole_final_epoch": (["A"], 16, 7, "90,9,1", [4500, 100, 10]),
    "single_one_epoch": (["A"], 24, 99, "80,15,5", [-1, -1, -1]),
    # B's train split needs 2 epochs for its 70%
    "weighted_blend": (["0.3", "A", "0.7", "B"], 16, 1234, "90,8,2", [1500, 60, 6]),
    "unweighted_blend": (["A", "B"], 16, 5, "98,2,0", [700, 30, 0]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_gpt_samples_equal_megatrons(tmp_path, corpora, case):
    tokens, seq_length, seed, split, sizes = CASES[case]
    data_path = [corpora[0] if t == "A" else corpora[1] if t == "B" else t for t in tokens]
    run(DATASET, "samples", "--data-path", *data_path, "--seq-length", seq_length, "--seed", seed, "--split", split,
        "--num-samples", *sizes, "--out", tmp_path)
    ours_indices = json.loads((tmp_path / "indices.json").read_text())
    theirs = megatron_datasets(data_path, seq_length, seed, split, sizes)
    for k, name in enumerate(("train", "valid", "test")):
        ours = np.fromfile(tmp_path / f"{name}.bin", dtype=np.int64).reshape(-1, seq_length + 1)
        ds = theirs[k]
        if ds is None:
            assert len(ours) == 0, name
            continue
        assert len(ours) == len(ds), name
        assert len(ours) >= max(sizes[k], 0), name
        for i in range(len(ds)):
            item = ds[i]
            text = torch.cat([item["tokens"], item["labels"][-1:]]).numpy()
            np.testing.assert_array_equal(ours[i], text, err_msg=f"{case} {name} sample {i}")
        if isinstance(ds, GPTDataset):
            np.testing.assert_array_equal(ours_indices[name]["document_index"], ds.document_index)
            np.testing.assert_array_equal(np.array(ours_indices[name]["sample_index"]).reshape(-1, 2), ds.sample_index)
            np.testing.assert_array_equal(ours_indices[name]["shuffle_index"], ds.shuffle_index)
        else:
            np.testing.assert_array_equal(ours_indices[name]["dataset_index"], ds.dataset_index)
            np.testing.assert_array_equal(ours_indices[name]["dataset_sample_index"], ds.dataset_sample_index)
            assert ours_indices[name]["weights"] == list(ds.weights)
