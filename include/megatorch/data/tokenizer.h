#pragma once
// Megatron-LM's tokenizer types behind one interface, shared by megatorch-preprocess,
// gpt_pretrain (vocabulary size, end-of-document id) and megatorch-generate (text in and
// out). ByteLevel and PreTokenized are implemented here; the library-backed types
// (GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, Llama2Tokenizer) run
// the libraries that define them (HuggingFace `tokenizers`, `sentencepiece`) in a Python
// co-process, so no BPE or unigram model is re-implemented here.
#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace megatorch::data {

// Megatron's --tokenizer-type names that megatorch knows.
inline const std::vector<std::string> kTokenizerTypes = {
    "ByteLevel", "PreTokenized", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "Llama2Tokenizer"};

// ByteLevel: ids 0..255 are the UTF-8 bytes, 256 ends a document.
constexpr int64_t kByteLevelVocabSize = 257;
constexpr int64_t kByteLevelEod = 256;

struct TokenizerOptions {
  // ByteLevel | PreTokenized | GPT2BPETokenizer | HuggingFaceTokenizer |
  // SentencePieceTokenizer | Llama2Tokenizer (Megatron's --tokenizer-type names).
  TORCH_ARG(std::string, tokenizer_type) = "ByteLevel";
  TORCH_ARG(std::string, vocab_file);       // GPT2BPETokenizer: vocab.json
  TORCH_ARG(std::string, merge_file);       // GPT2BPETokenizer: merges.txt
  TORCH_ARG(std::string, tokenizer_model);  // HuggingFace directory or tokenizer.json; SentencePiece .model
  TORCH_ARG(int64_t, vocab_size) = -1;      // PreTokenized: ids must be below it
  TORCH_ARG(int64_t, eod_id) = -1;          // PreTokenized: end-of-document id
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // Megatron's tokenizer.vocab_size: the unpadded vocabulary.
  virtual int64_t vocab_size() const = 0;
  // The end-of-document id (Megatron's tokenizer.eod); -1 when the tokenizer has none (a
  // HuggingFace tokenizer without an eos token, PreTokenized without --eod-id).
  virtual int64_t eod() const = 0;
  // False for PreTokenized: no text, ids only.
  virtual bool has_text() const = 0;
  // Megatron's tokenizer.tokenize(text) (e.g. Llama2Tokenizer prepends BOS).
  virtual std::vector<int64_t> tokenize(const std::string& text) = 0;
  // Megatron's tokenizer.detokenize(ids).
  virtual std::string detokenize(const std::vector<int64_t>& ids) = 0;
  // The type's name, for logs.
  virtual std::string name() const = 0;
};

// Validates the options (files present, flags the type needs) and builds the tokenizer.
// Not thread-safe: give each worker thread its own.
std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerOptions& options);

}  // namespace megatorch::data
