#pragma once
// Megatron's tokenizer flags for a CLI11 command line (megatorch-preprocess, gpt_pretrain,
// megatorch-generate). Header-only and NOT included from megatorch/megatorch.h: it needs
// <CLI/CLI.hpp>, which only the tools have. --vocab-size is left to the caller (its meaning
// differs: the model's vocabulary in gpt_pretrain, the ids' bound in megatorch-preprocess).
#include <CLI/CLI.hpp>

#include "megatorch/data/tokenizer.h"

namespace megatorch::data {

inline void add_tokenizer_options(CLI::App& app, TokenizerOptions& o) {
  app.add_option("--tokenizer-type", o.tokenizer_type(),
                 "ByteLevel (UTF-8 bytes, vocab 257, end-of-document 256), PreTokenized (lists of ids), "
                 "GPT2BPETokenizer (--vocab-file, --merge-file), HuggingFaceTokenizer (--tokenizer-model: a "
                 "directory or tokenizer.json), SentencePieceTokenizer or Llama2Tokenizer (--tokenizer-model: a "
                 ".model)")
      ->check(CLI::IsMember(kTokenizerTypes))
      ->capture_default_str();
  app.add_option("--vocab-file", o.vocab_file(), "GPT2BPETokenizer: the vocabulary (vocab.json)");
  app.add_option("--merge-file", o.merge_file(), "GPT2BPETokenizer: the BPE merges (merges.txt)");
  app.add_option("--tokenizer-model", o.tokenizer_model(),
                 "HuggingFaceTokenizer: a tokenizer directory or tokenizer.json; SentencePieceTokenizer, "
                 "Llama2Tokenizer: the SentencePiece .model");
  app.add_option("--eod-id", o.eod_id(), "PreTokenized: the end-of-document id");
}

}  // namespace megatorch::data
