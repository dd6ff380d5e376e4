#!/usr/bin/env python3
"""Trains the small byte-level BPE tokenizer shipped in data/tokenizers/default-bpe on the
bundled dataset (data/default), offline and deterministically, with HuggingFace
`tokenizers` (its BpeTrainer; nothing is implemented here).

The text is read back from the bundled ByteLevel dataset (its ids are the UTF-8 bytes,
256 ends a document), so no download and no other input is needed. Written to --out:

  tokenizer.json          --tokenizer-type HuggingFaceTokenizer --tokenizer-model <out>/tokenizer.json
  tokenizer_config.json   (with tokenizer.json: --tokenizer-model <out>, AutoTokenizer; eos '<|endoftext|>')
  vocab.json, merges.txt  --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...

All three encode text to the same ids (GPT-2's byte-level BPE, no added BOS/EOS), and
'<|endoftext|>' (id 0) is the end-of-document id.

  python scripts/train_tokenizer.py --out data/tokenizers/default-bpe --vocab-size 4096 \\
      --write-jsonl /tmp/stdlib_docs.jsonl
  build/bin/megatorch-preprocess --input /tmp/stdlib_docs.jsonl --output-prefix data/default/stdlib_docs_bpe \\
      --tokenizer-type HuggingFaceTokenizer --tokenizer-model data/tokenizers/default-bpe --append-eod --workers 2
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EOD = "<|endoftext|>"


def read_byte_level_documents(prefix):
    """The documents of a ByteLevel indexed dataset as text. The .idx layout is Megatron's
    MMIDIDX: magic, version, dtype code, sequence and document counts, then the sequence
    lengths (int32), sequence byte offsets (int64) and document boundaries (int64)."""
    idx = Path(str(prefix) + ".idx").read_bytes()
    if idx[:9] != b"MMIDIDX\x00\x00":
        sys.exit(f"{prefix}.idx is not a Megatron indexed dataset")
    n_seq, n_doc = np.frombuffer(idx, np.int64, 2, offset=18)
    lengths = np.frombuffer(idx, np.int32, n_seq, offset=34)
    doc_index = np.frombuffer(idx, np.int64, n_doc, offset=34 + 12 * int(n_seq))
    tokens = np.fromfile(str(prefix) + ".bin", dtype=np.uint16)
    if tokens.max() > 256:
        sys.exit(f"{prefix} is not a ByteLevel dataset (ids above 256)")
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])  # of each sequence, in tokens
    docs = []
    for d in range(int(n_doc) - 1):
        ids = tokens[offsets[doc_index[d]]:offsets[doc_index[d + 1]]]
        docs.append(ids[ids < 256].astype(np.uint8).tobytes().decode("utf-8"))
    return docs


def train(texts, vocab_size):
    """A GPT-2-style byte-level BPE: GPT-2's pre-tokenizer regex, all 256 bytes in the
    alphabet, '<|endoftext|>' as the one special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save(tok, out):
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    tok.model.save(str(out))  # vocab.json + merges.txt, GPT-2's file formats
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOD, "eos_token": EOD, "unk_token": EOD,
              "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory to write the tokenizer files to")
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--data", default=str(ROOT / "data" / "default" / "stdlib_docs_text_document"),
                    help="a ByteLevel indexed dataset prefix whose documents are the training text")
    ap.add_argument("--write-jsonl", help="also write the documents as JSONL ({\"text\": ...} per line)")
    args = ap.parse_args()
    docs = read_byte_level_documents(args.data)
    tok = train(docs, args.vocab_size)
    save(tok, Path(args.out))
    if args.write_jsonl:
        with open(args.write_jsonl, "w", encoding="utf-8") as f:
            for d in docs:
                f.write(json.dumps({"text": d}) + "\n")
    print(f"trained a byte-level BPE of {tok.get_vocab_size()} entries on {len(docs)} documents -> {args.out}")


if __name__ == "__main__":
    main()
