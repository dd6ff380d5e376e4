"""Megatron-LM's library-backed tokenizer types, with Megatron's vocab_size, eod, tokenize
and detokenize, on top of the libraries that define them (HuggingFace ``tokenizers`` /
``transformers``, ``sentencepiece``).

The semantics are those of Megatron-LM's megatron/training/tokenizer/tokenizer.py
(``_GPT2BPETokenizer``, ``_HuggingFaceTokenizer``, ``_SentencePieceTokenizer``,
``_Llama2Tokenizer``), the tokenizers its tools/preprocess_data.py and pretrain_gpt.py use.

From Python::

    from megatorch.tokenizers import build_tokenizer
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file="vocab.json", merge_file="merges.txt")
    tok.vocab_size, tok.eod, tok.tokenize("text"), tok.detokenize([...])

The C++ side (megatorch::data::build_tokenizer) runs this file by path as a co-process,
``python tokenizers.py --serve --tokenizer-type T ...``, speaking JSON lines on stdin/stdout.
It therefore imports neither torch nor the megatorch package, and the libraries only when a
tokenizer needs them.
"""
import argparse
import json
import os
import sys

if __name__ == "__main__":
    # Run by path, this file's directory comes first on sys.path, and `import tokenizers`
    # would find this file instead of HuggingFace's package.
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

TYPES = ("GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer")


class TokenizerError(Exception):
    """A tokenizer that cannot be built or used; the message says what to fix."""


def _require_file(path, what, type_name):
    if not path:
        raise TokenizerError(f"--tokenizer-type {type_name} needs {what}")
    if not os.path.exists(path):
        raise TokenizerError(f"--tokenizer-type {type_name}: {what} {path} does not exist")


def _import(module, type_name):
    try:
        return __import__(module)
    except ImportError as e:
        raise TokenizerError(f"--tokenizer-type {type_name} needs the Python package '{module}' in {sys.executable} "
                             f"({e}); pip install {module}, or point MEGATORCH_PYTHON at an interpreter that has it")


class GPT2BPETokenizer:
    """Megatron's _GPT2BPETokenizer: GPT-2's byte-level BPE from vocab.json + merges.txt.
    The text is encoded as text throughout ('<|endoftext|>' in a document is not the eod id),
    as Megatron's GPT2Tokenizer(special_tokens=[]) does; vocab_size is len(encoder)."""

    def __init__(self, vocab_file, merge_file):
        _require_file(vocab_file, "--vocab-file (vocab.json)", "GPT2BPETokenizer")
        _require_file(merge_file, "--merge-file (merges.txt)", "GPT2BPETokenizer")
        tk = _import("tokenizers", "GPT2BPETokenizer")
        try:
            model = tk.models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the library's own parse error, with the files named
            raise TokenizerError(f"GPT2BPETokenizer: cannot read --vocab-file {vocab_file} / --merge-file {merge_file} "
                                 f"as GPT-2 vocab.json / merges.txt: {e}")
        self._tok = tk.Tokenizer(model)
        self._tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = tk.decoders.ByteLevel()
        self.vocab = self._tok.get_vocab(with_added_tokens=False)
        if "<|endoftext|>" not in self.vocab:
            raise TokenizerError(f"GPT2BPETokenizer: --vocab-file {vocab_file} has no '<|endoftext|>' entry, which "
                                 "Megatron uses as the end-of-document id; add it to the vocabulary")
        self.vocab_size = len(self.vocab)
        self.eod = self.vocab["<|endoftext|>"]

    def tokenize(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids):
        _check_ids(ids, self.vocab_size, "GPT2BPETokenizer")
        return self._tok.decode(ids, skip_special_tokens=False)


# A bare tokenizer.json carries no eos token; these are the end-of-text markers of the
# common models, tried in order among its special tokens.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "<|im_end|>")


class HuggingFaceTokenizer:
    """Megatron's _HuggingFaceTokenizer: AutoTokenizer on a directory; vocab_size is
    len(tokenizer), eod its eos_token_id, tokenize its input_ids for the text (with the
    special tokens its post-processor adds). A bare tokenizer.json is read with
    tokenizers.Tokenizer.from_file, the same encoding without transformers; its eod is the
    first of _EOS_NAMES among its special tokens."""

    def __init__(self, path):
        _require_file(path, "--tokenizer-model (a tokenizer directory or tokenizer.json)", "HuggingFaceTokenizer")
        self._hf = None
        self._tok = None
        if os.path.isdir(path):
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            transformers = _import("transformers", "HuggingFaceTokenizer")
            try:
                self._hf = transformers.AutoTokenizer.from_pretrained(path)
            except Exception as e:
                raise TokenizerError(f"HuggingFaceTokenizer: AutoTokenizer cannot load --tokenizer-model {path}: {e}")
            self.vocab_size = len(self._hf)
            eos = self._hf.eos_token_id
        else:
            tk = _import("tokenizers", "HuggingFaceTokenizer")
            try:
                self._tok = tk.Tokenizer.from_file(path)
            except Exception as e:
                raise TokenizerError(f"HuggingFaceTokenizer: --tokenizer-model {path} is not a tokenizer.json that "
                                     f"tokenizers.Tokenizer.from_file reads ({e}); give a tokenizer file or directory")
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            special = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
            eos = next((special[n] for n in _EOS_NAMES if n in special), None)
        self.eod = -1 if eos is None else int(eos)

    def tokenize(self, text):
        if self._hf is not None:
            return list(self._hf(text).input_ids)
        return self._tok.encode(text).ids

    def detokenize(self, ids):
        _check_ids(ids, self.vocab_size, "HuggingFaceTokenizer")
        if self._hf is not None:
            return self._hf.decode(ids)
        return self._tok.decode(ids, skip_special_tokens=False)


class SentencePieceTokenizer:
    """Megatron's _SentencePieceTokenizer: the SentencePiece vocabulary plus Megatron's
    special tokens <CLS>, <SEP>, <EOD>, <MASK> (and <PAD>/<BOS>/<EOS> where the model has
    none), appended after the model's pieces when missing; eod is <EOD>. A special token in
    the text is encoded as its id, the text between them by SentencePiece."""

    def __init__(self, model_file):
        _require_file(model_file, "--tokenizer-model (a SentencePiece .model)", type(self).__name__)
        spm = _import("sentencepiece", type(self).__name__)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except Exception as e:
            raise TokenizerError(f"{type(self).__name__}: --tokenizer-model {model_file} is not a SentencePiece "
                                 f"model ({e}); give the .model file that spm_train wrote")
        self.vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._init_special()

    def _piece_or(self, piece_id, default):
        return self._sp.id_to_piece(piece_id) if 0 <= piece_id < len(self._sp) else default

    def _init_special(self):
        self._special = {}
        for t in ("<CLS>", "<SEP>", "<EOD>", "<MASK>", self._piece_or(self._sp.pad_id(), "<PAD>"),
                  self._piece_or(self._sp.bos_id(), "<BOS>"), self._piece_or(self._sp.eos_id(), "<EOS>")):
            if t not in self.vocab:
                self.vocab[t] = len(self.vocab)
            self._special[t] = self.vocab[t]
        self._inv_special = {i: t for t, i in self._special.items()}
        self.vocab_size = len(self.vocab)
        self.eod = self._special["<EOD>"]

    def tokenize(self, text):
        ids, idx = [], 0
        while True:
            found = {t: text.find(t, idx) for t in self._special}
            found = {t: i for t, i in found.items() if i >= 0}
            if not found:
                break
            token = min(found, key=found.get)  # the earliest; ties go to the first in order, as Megatron's min()
            ids.extend(self._sp.encode_as_ids(text[idx:found[token]]))
            ids.append(self._special[token])
            idx = found[token] + len(token)
        ids.extend(self._sp.encode_as_ids(text[idx:]))
        return ids

    def detokenize(self, ids):
        _check_ids(ids, self.vocab_size, type(self).__name__)
        text, last = "", 0
        for i, t in enumerate(ids):
            if t in self._inv_special:
                text += self._sp.decode_ids(ids[last:i]) + " " + self._inv_special[t] + " "
                last = i + 1
        return text + self._sp.decode_ids(ids[last:])


class Llama2Tokenizer(SentencePieceTokenizer):
    """Megatron's _Llama2Tokenizer: the SentencePiece vocabulary as is; eod is the model's
    eos id; tokenize prepends the bos id (text completion)."""

    def _init_special(self):
        self.vocab_size = len(self.vocab)
        self.bos = self._sp.bos_id()
        self.eod = self._sp.eos_id()
        if self.bos < 0:
            raise TokenizerError("Llama2Tokenizer: the SentencePiece model has no bos piece, which Llama2Tokenizer "
                                 "prepends; train it with bos_id >= 0 or use SentencePieceTokenizer")

    def tokenize(self, text):
        return [self.bos] + self._sp.encode_as_ids(text)

    def detokenize(self, ids):
        _check_ids(ids, self.vocab_size, "Llama2Tokenizer")
        return self._sp.decode_ids(ids)


def _check_ids(ids, vocab_size, type_name):
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(f"{type_name}: cannot detokenize id {bad[0]}: the vocabulary has ids 0..{vocab_size - 1}")


def build_tokenizer(tokenizer_type, vocab_file=None, merge_file=None, tokenizer_model=None):
    """Megatron's build_tokenizer for the library-backed types (without vocabulary padding)."""
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    raise TokenizerError(f"unknown tokenizer type '{tokenizer_type}'; the library-backed types are {', '.join(TYPES)}")


def _serve(args):
    """One JSON object per line each way: the first reply describes the tokenizer (or the
    error that stopped it); then {"op": "tokenize", "text": ...} -> {"ids": [...]} and
    {"op": "detokenize", "ids": [...]} -> {"text": ...}, or {"error": ...}. End of input ends it."""
    # The protocol keeps the real stdin/stdout; anything a library prints goes to stderr.
    reader = os.fdopen(os.dup(0), "rb")
    writer = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj):
        writer.write(json.dumps(obj, ensure_ascii=False).encode("utf-8", "replace") + b"\n")
        writer.flush()

    try:
        tok = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
    except TokenizerError as e:
        reply({"error": str(e)})
        return 0
    reply({"vocab_size": tok.vocab_size, "eod": tok.eod})
    for line in reader:
        try:
            req = json.loads(line)
            op = req.get("op")
            if op == "tokenize":
                reply({"ids": tok.tokenize(req["text"])})
            elif op == "detokenize":
                reply({"text": tok.detokenize(req["ids"])})
            else:
                reply({"error": f"unknown request {op!r}"})
        except TokenizerError as e:
            reply({"error": str(e)})
        except Exception as e:  # noqa: BLE001 - reported to the C++ caller rather than killing the co-process
            reply({"error": f"{type(e).__name__}: {e}"})
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve", action="store_true", help="answer JSON-line requests on stdin (the C++ co-process)")
    ap.add_argument("--tokenizer-type", required=True, choices=TYPES)
    ap.add_argument("--vocab-file")
    ap.add_argument("--merge-file")
    ap.add_argument("--tokenizer-model")
    ap.add_argument("--text", help="without --serve: print the ids of this text")
    args = ap.parse_args(argv)
    if args.serve:
        return _serve(args)
    try:
        tok = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model)
    except TokenizerError as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps({"vocab_size": tok.vocab_size, "eod": tok.eod}))
    if args.text is not None:
        print(json.dumps(tok.tokenize(args.text)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
