#pragma once
// JSONL -> Megatron indexed dataset, as Megatron-LM's tools/preprocess_data.py does it
// (build/bin/megatorch-preprocess is the command line over this). Each input line is a
// JSON object; for every --json-keys KEY its value becomes one document of
// PREFIX_KEY_document.bin/.idx. A value that is a list of sentences becomes one sequence
// per non-empty sentence; --append-eod adds the end-of-document id to a non-empty
// document's last sequence. The dtype is Megatron's choice for the vocabulary (uint16
// below 65500 ids, else int32), so the files equal Megatron's for the same token ids.
//
// The tokenizer is any of megatorch's (tokenizer.h): ByteLevel, GPT2BPETokenizer,
// HuggingFaceTokenizer, SentencePieceTokenizer, Llama2Tokenizer take a string or a list of
// strings; PreTokenized takes the ids themselves (a list of ints, or a list of such lists)
// and needs vocab_size, and eod_id with append_eod. Every id must be below the tokenizer's
// vocabulary. Each worker thread has its own tokenizer (for the library-backed types its
// own Python process), so --workers parallelises the tokenization itself.
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

#include "megatorch/data/tokenizer.h"

namespace megatorch::data {

struct PreprocessOptions {
  TORCH_ARG(std::string, input);
  TORCH_ARG(std::string, output_prefix);
  TORCH_ARG(std::vector<std::string>, json_keys) = {"text"};
  TORCH_ARG(bool, append_eod) = false;
  TORCH_ARG(TokenizerOptions, tokenizer);
  TORCH_ARG(int64_t, workers) = 1;      // threads that parse and tokenize lines
  // A longer input line fails with its line number before more of it is read, rather than
  // growing one string until memory runs out.
  TORCH_ARG(int64_t, max_line_bytes) = int64_t{64} << 20;
};

struct PreprocessOutput {
  std::string key;
  std::string prefix;  // OUTPUT_PREFIX_KEY_document
  int64_t documents = 0;
  int64_t sequences = 0;
  int64_t tokens = 0;
};

struct PreprocessReport {
  int64_t lines = 0;
  int64_t input_bytes = 0;
  std::string dtype;
  std::string tokenizer;   // its name
  int64_t vocab_size = 0;  // the tokenizer's, which chose the dtype
  std::vector<PreprocessOutput> outputs;  // one per json key, in --json-keys order
};

PreprocessReport preprocess_jsonl(const PreprocessOptions& options);

}  // namespace megatorch::data
