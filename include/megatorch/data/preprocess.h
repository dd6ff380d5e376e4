#pragma once
// JSONL -> Megatron indexed dataset, as Megatron-LM's tools/preprocess_data.py does it
// (build/bin/megatorch-preprocess is the command line over this). Each input line is a
// JSON object; for every --json-keys KEY its value becomes one document of
// PREFIX_KEY_document.bin/.idx. A value that is a list of sentences becomes one sequence
// per non-empty sentence; --append-eod adds the end-of-document id to a non-empty
// document's last sequence. The dtype is Megatron's choice for the vocabulary (uint16
// below 65500 ids, else int32), so the files equal Megatron's for the same token ids.
//
// Tokenizers:
//   ByteLevel     the UTF-8 bytes of the text: ids 0..255, end-of-document 256, vocab 257
//   PreTokenized  the value is already token ids (a list of ints, or a list of such lists);
//                 needs vocab_size, and eod_id with append_eod
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace megatorch::data {

struct PreprocessOptions {
  TORCH_ARG(std::string, input);
  TORCH_ARG(std::string, output_prefix);
  TORCH_ARG(std::vector<std::string>, json_keys) = {"text"};
  TORCH_ARG(bool, append_eod) = false;
  TORCH_ARG(std::string, tokenizer_type) = "ByteLevel";
  TORCH_ARG(int64_t, vocab_size) = -1;  // PreTokenized: ids must be < vocab_size
  TORCH_ARG(int64_t, eod_id) = -1;      // PreTokenized with append_eod
  TORCH_ARG(int64_t, workers) = 1;      // threads that parse and tokenize lines
};

constexpr int64_t kByteLevelVocabSize = 257;
constexpr int64_t kByteLevelEod = 256;

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
  std::vector<PreprocessOutput> outputs;  // one per json key, in --json-keys order
};

PreprocessReport preprocess_jsonl(const PreprocessOptions& options);

}  // namespace megatorch::data
