"""Megatron's tokenizer types in megatorch-preprocess, against the libraries themselves.

Tokenizers are trained here, offline, on the bundled dataset's text (HuggingFace
`tokenizers` for a byte-level BPE, `sentencepiece` for a unigram model). For every type,
megatorch-preprocess --workers 2 must give each document exactly the library's own
encoding (read back with megatron-core's IndexedDataset), write .bin/.idx byte-identical
to megatron-core's IndexedDatasetBuilder fed those ids, and widen the dtype to int32
past 65,500 ids. Bad input fails with a message naming the fault."""
import importlib.util
import json
import os
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.datasets.indexed_dataset as mid
import sentencepiece as spm
import tokenizers
import transformers

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(os.environ.get("MEGATORCH_BIN_DIR", ROOT / "build" / "bin"))
PREPROCESS = str(BIN / "megatorch-preprocess")
SHIPPED = ROOT / "data" / "tokenizers" / "default-bpe"
BUNDLED = ROOT / "data" / "default" / "stdlib_docs_text_document"


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train_tokenizer = load_script("train_tokenizer")


def run(*args, env=None):
    return subprocess.run([*map(str, args)], capture_output=True, text=True, timeout=120,
                          env=None if env is None else {**os.environ, **env})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The bundled documents (a slice, to stay quick) plus a few that probe the edges:
    non-ASCII text, an empty document, a list of sentences, Megatron's <EOD> in the text."""
    d = tmp_path_factory.mktemp("tok")
    docs = train_tokenizer.read_byte_level_documents(BUNDLED)
    texts = docs[:400] + ["Grüße, naïve café — 日本語 ✓", "", "  leading and trailing  ", "a <EOD> b"]
    records = [{"text": t} for t in texts] + [{"text": ["first sentence.", "", "second one."]}]
    jsonl = d / "docs.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return d, docs, records, jsonl


@pytest.fixture(scope="module")
def trained(corpus):
    d, docs, _, _ = corpus
    bpe = d / "bpe"
    train_tokenizer.save(train_tokenizer.train(docs, 1000), bpe)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(docs), model_prefix=str(d / "sp"), vocab_size=1000,
                                   model_type="unigram", num_threads=2, minloglevel=2, max_sentence_length=1 << 20)
    return bpe, d / "sp.model"


def reference(tokenizer_type, files):
    """Each type's encoding from its library, as Megatron's tokenizer calls it."""
    bpe, sp_model = files
    if tokenizer_type == "GPT2BPETokenizer":
        hf = transformers.GPT2TokenizerFast(vocab=str(bpe / "vocab.json"), merges=str(bpe / "merges.txt"))
        assert len(hf) == 1000
        return lambda t: hf(t).input_ids, hf.convert_tokens_to_ids("<|endoftext|>"), len(hf)
    if tokenizer_type == "HuggingFaceTokenizer":
        hf = transformers.AutoTokenizer.from_pretrained(str(bpe))
        return lambda t: hf(t).input_ids, hf.eos_token_id, len(hf)
    if tokenizer_type == "HuggingFaceTokenizer-json":
        tok = tokenizers.Tokenizer.from_file(str(bpe / "tokenizer.json"))
        return lambda t: tok.encode(t).ids, tok.token_to_id("<|endoftext|>"), tok.get_vocab_size()
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    if tokenizer_type == "Llama2Tokenizer":
        return lambda t: [sp.bos_id()] + sp.encode(t), sp.eos_id(), len(sp)
    # Megatron's _SentencePieceTokenizer appends <CLS> <SEP> <EOD> <MASK> <PAD> (the model has
    # no pad piece; <s> and </s> are its own) and encodes them where they occur in the text.
    eod = len(sp) + 2

    def encode(text):
        if "<EOD>" not in text:
            return sp.encode(text)
        a, b = text.split("<EOD>")
        return sp.encode(a) + [eod] + sp.encode(b)
    return encode, eod, len(sp) + 5


def flags(tokenizer_type, files):
    bpe, sp_model = files
    return {
        "GPT2BPETokenizer": ["--vocab-file", bpe / "vocab.json", "--merge-file", bpe / "merges.txt"],
        "HuggingFaceTokenizer": ["--tokenizer-model", bpe],
        "HuggingFaceTokenizer-json": ["--tokenizer-model", bpe / "tokenizer.json"],
        "SentencePieceTokenizer": ["--tokenizer-model", sp_model],
        "Llama2Tokenizer": ["--tokenizer-model", sp_model],
    }[tokenizer_type]


def megatron_files(prefix, documents, vocab_size):
    """megatron-core's IndexedDatasetBuilder fed the given documents (lists of sequences)."""
    builder = mid.IndexedDatasetBuilder(str(prefix) + ".bin", dtype=mid.DType.optimal_dtype(vocab_size))
    for doc in documents:
        builder.add_document(torch.tensor([t for s in doc for t in s], dtype=torch.long), [len(s) for s in doc])
    builder.finalize(str(prefix) + ".idx")
    return Path(str(prefix) + ".bin").read_bytes(), Path(str(prefix) + ".idx").read_bytes()


def expected_documents(records, encode, eod):
    """Megatron's preprocess_data Encoder.encode: every sentence encoded, empty encodings
    dropped, the eod appended to a non-empty document's last sequence."""
    docs = []
    for r in records:
        sentences = r["text"] if isinstance(r["text"], list) else [r["text"]]
        seqs = [ids for ids in (encode(s) for s in sentences) if ids]
        if seqs:
            seqs[-1] = seqs[-1] + [eod]
        docs.append(seqs)
    return docs


@pytest.mark.parametrize("tokenizer_type", ["GPT2BPETokenizer", "HuggingFaceTokenizer", "HuggingFaceTokenizer-json",
                                            "SentencePieceTokenizer", "Llama2Tokenizer"])
def test_preprocess_equals_library_and_megatron_builder(corpus, trained, tokenizer_type):
    d, _, records, jsonl = corpus
    encode, eod, vocab_size = reference(tokenizer_type, trained)
    out = d / tokenizer_type
    r = run(PREPROCESS, "--input", jsonl, "--output-prefix", out, "--tokenizer-type", tokenizer_type.split("-")[0],
            *flags(tokenizer_type, trained), "--append-eod", "--workers", 2)
    assert r.returncode == 0, r.stderr
    assert f"(vocab {vocab_size}), dtype uint16" in r.stdout
    want = expected_documents(records, encode, eod)
    ds = mid.IndexedDataset(f"{out}_text_document")
    assert ds.index.dtype == mid.DType.optimal_dtype(vocab_size)
    seq = 0
    for doc in want:  # document by document, sequence by sequence
        for s in doc:
            assert ds[seq].tolist() == s, (doc, seq)
            seq += 1
    assert seq == len(ds)
    theirs = megatron_files(d / f"{tokenizer_type}_megatron", want, vocab_size)
    assert (Path(f"{out}_text_document.bin").read_bytes(), Path(f"{out}_text_document.idx").read_bytes()) == theirs


def test_vocabulary_past_65500_widens_to_int32(corpus, trained, tmp_path):
    """The BPE plus 64,600 added tokens: 65,600 ids, past Megatron's 65,500 for uint16, so
    the files are int32 (and hold ids above uint16's 65,535)."""
    tok = tokenizers.Tokenizer.from_file(str(trained[0] / "tokenizer.json"))
    tok.add_tokens([f"<extra_{i}>" for i in range(64_600)])
    assert tok.get_vocab_size() == 65_600
    tok.save(str(tmp_path / "big.json"))
    texts = ["plain text <extra_64599> and <extra_3>", "the module's functions"]
    jsonl = tmp_path / "big.jsonl"
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    r = run(PREPROCESS, "--input", jsonl, "--output-prefix", tmp_path / "big", "--tokenizer-type",
            "HuggingFaceTokenizer", "--tokenizer-model", tmp_path / "big.json", "--workers", 2)
    assert r.returncode == 0, r.stderr
    assert "(vocab 65600), dtype int32" in r.stdout
    want = [[tok.encode(t).ids] for t in texts]
    assert 65_599 in want[0][0]  # an id that needs more than uint16's 65,535
    ds = mid.IndexedDataset(str(tmp_path / "big_text_document"))
    assert ds.index.dtype == mid.DType.optimal_dtype(65_600)
    assert [ds[i].tolist() for i in range(len(ds))] == [doc[0] for doc in want]
    theirs = megatron_files(tmp_path / "theirs", want, 65_600)
    assert (tmp_path / "big_text_document.bin").read_bytes() == theirs[0]
    assert (tmp_path / "big_text_document.idx").read_bytes() == theirs[1]


def test_bad_input_fails_clearly(corpus, trained, tmp_path):
    _, _, _, jsonl = corpus
    bpe, sp_model = trained
    ids = tmp_path / "ids.jsonl"
    ids.write_text('{"ids": [1, 2, 500]}\n')
    out = ("--output-prefix", tmp_path / "o")
    cases = [
        (("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe / "vocab.json"), {}, "needs --merge-file"),
        (("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tmp_path / "none.json", "--merge-file",
          bpe / "merges.txt"), {}, f"--vocab-file {tmp_path / 'none.json'} does not exist"),
        (("--tokenizer-type", "HuggingFaceTokenizer"), {}, "needs --tokenizer-model"),
        (("--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", tmp_path / "none.model"), {},
         "none.model does not exist"),
        # The Python side's own errors come back naming the type, the file and the fix.
        (("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", bpe / "vocab.json"), {},
         f"SentencePieceTokenizer: --tokenizer-model {bpe / 'vocab.json'} is not a SentencePiece model"),
        (("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", bpe / "merges.txt", "--merge-file",
          bpe / "merges.txt"), {}, "cannot read --vocab-file"),
        # An interpreter that cannot run, or that dies, is reported, not waited for.
        (("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe), {"MEGATORCH_PYTHON": "/no/python"},
         "cannot run the Python interpreter '/no/python'"),
        (("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe), {"MEGATORCH_PYTHON": "false"},
         "exited with status 1 while starting"),
        (("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe),
         {"MEGATORCH_TOKENIZER_SCRIPT": str(tmp_path / "none.py")}, "set MEGATORCH_TOKENIZER_SCRIPT"),
    ]
    for args, env, message in cases:
        r = run(PREPROCESS, "--input", jsonl, *out, *args, env=env)
        assert r.returncode == 1, (args, r.stdout)
        assert message in r.stderr, (args, r.stderr)
        assert "Exception raised from" not in r.stderr
    r = run(PREPROCESS, "--input", ids, *out, "--json-keys", "ids", "--tokenizer-type", "PreTokenized",
            "--vocab-size", 500)
    assert r.returncode == 1 and "token id 500 is outside [0, --vocab-size=500)" in r.stderr, r.stderr
    r = run(PREPROCESS, "--input", ids, *out, "--json-keys", "ids", "--tokenizer-type", "ByteLevel")
    assert r.returncode == 1 and "must be a string or a list of strings for ByteLevel" in r.stderr, r.stderr


def test_python_build_tokenizer_matches_megatron_semantics(trained):
    """megatorch.tokenizers from Python: the attributes Megatron's tokenizers have."""
    from megatorch.tokenizers import build_tokenizer

    bpe, sp_model = trained
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    s = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(sp_model))
    assert (s.vocab_size, s.eod) == (len(sp) + 5, len(sp) + 2)
    assert s.detokenize(s.tokenize("one <EOD> two")) == "one <EOD> two"
    llama = build_tokenizer("Llama2Tokenizer", tokenizer_model=str(sp_model))
    assert (llama.vocab_size, llama.eod, llama.tokenize("x")[0]) == (len(sp), sp.eos_id(), sp.bos_id())
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=str(bpe / "vocab.json"), merge_file=str(bpe / "merges.txt"))
    text = "Return the module's  docstring, naïvely."
    assert gpt2.detokenize(gpt2.tokenize(text)) == text
    with pytest.raises(Exception, match="cannot detokenize id 1000"):
        gpt2.detokenize([1000])


def test_shipped_tokenizer_and_dataset(tmp_path):
    """data/tokenizers/default-bpe is what scripts/train_tokenizer.py trains, and the
    bundled BPE dataset is the bundled text tokenized with it."""
    r = run(ROOT / ".venv" / "bin" / "python" if (ROOT / ".venv").exists() else "python3",
            ROOT / "scripts" / "train_tokenizer.py", "--out", tmp_path / "bpe", "--write-jsonl", tmp_path / "docs.jsonl")
    assert r.returncode == 0, r.stderr
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt"):
        assert (tmp_path / "bpe" / name).read_bytes() == (SHIPPED / name).read_bytes(), name
    r = run(PREPROCESS, "--input", tmp_path / "docs.jsonl", "--output-prefix", tmp_path / "stdlib_docs_bpe",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", SHIPPED / "vocab.json", "--merge-file",
            SHIPPED / "merges.txt", "--append-eod", "--workers", 2)
    assert r.returncode == 0, r.stderr
    for ext in (".bin", ".idx"):
        shipped = ROOT / "data" / "default" / f"stdlib_docs_bpe_text_document{ext}"
        assert (tmp_path / f"stdlib_docs_bpe_text_document{ext}").read_bytes() == shipped.read_bytes(), ext
