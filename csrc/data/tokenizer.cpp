#include "megatorch/data/tokenizer.h"

#include <algorithm>
#include <filesystem>

#include "megatorch/check.h"
#include "python_tokenizer.h"

namespace megatorch::data {

namespace {

// The UTF-8 bytes of the text. Detokenize keeps the bytes and drops ids >= 256 (the
// end-of-document and any padded rows), as Megatron's ByteLevel tokenizer does.
class ByteLevelTokenizer final : public Tokenizer {
 public:
  int64_t vocab_size() const override { return kByteLevelVocabSize; }
  int64_t eod() const override { return kByteLevelEod; }
  bool has_text() const override { return true; }
  std::vector<int64_t> tokenize(const std::string& text) override {
    std::vector<int64_t> ids(text.size());
    std::transform(text.begin(), text.end(), ids.begin(), [](char c) { return static_cast<unsigned char>(c); });
    return ids;
  }
  std::string detokenize(const std::vector<int64_t>& ids) override {
    std::string text;
    text.reserve(ids.size());
    for (const int64_t id : ids) {
      MEGATORCH_CHECK(id >= 0, "ByteLevel: cannot detokenize the negative id ", id);
      if (id < 256) text.push_back(static_cast<char>(id));
    }
    return text;
  }
  std::string name() const override { return "ByteLevel"; }
};

// Ids in, ids out: only the bounds are known.
class PreTokenizedTokenizer final : public Tokenizer {
 public:
  PreTokenizedTokenizer(int64_t vocab_size, int64_t eod) : vocab_size_(vocab_size), eod_(eod) {}
  int64_t vocab_size() const override { return vocab_size_; }
  int64_t eod() const override { return eod_; }
  bool has_text() const override { return false; }
  std::vector<int64_t> tokenize(const std::string&) override {
    MEGATORCH_FAIL("--tokenizer-type PreTokenized has no text tokenizer: its data are token ids already; for text "
                   "use ByteLevel, GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer or Llama2Tokenizer");
  }
  std::string detokenize(const std::vector<int64_t>&) override {
    MEGATORCH_FAIL("--tokenizer-type PreTokenized cannot turn ids into text; give the tokenizer the ids came from "
                   "(e.g. --tokenizer-type GPT2BPETokenizer --vocab-file ... --merge-file ...)");
  }
  std::string name() const override { return "PreTokenized"; }

 private:
  int64_t vocab_size_;
  int64_t eod_;
};

void check_file(const std::string& path, const std::string& type, const std::string& flag, const std::string& what) {
  MEGATORCH_CHECK(!path.empty(), "--tokenizer-type ", type, " needs ", flag, " (", what, ")");
  MEGATORCH_CHECK(std::filesystem::exists(path), "--tokenizer-type ", type, ": ", flag, " ", path,
                  " does not exist; give the path of ", what);
}

}  // namespace

std::unique_ptr<Tokenizer> build_tokenizer(const TokenizerOptions& o) {
  const std::string& type = o.tokenizer_type();
  if (type == "ByteLevel") return std::make_unique<ByteLevelTokenizer>();
  if (type == "PreTokenized") {
    MEGATORCH_CHECK(o.vocab_size() > 0, "--tokenizer-type PreTokenized needs --vocab-size (ids are checked against "
                    "it), got ", o.vocab_size());
    MEGATORCH_CHECK(o.eod_id() < o.vocab_size(), "--tokenizer-type PreTokenized: --eod-id ", o.eod_id(),
                    " is not below --vocab-size ", o.vocab_size());
    return std::make_unique<PreTokenizedTokenizer>(o.vocab_size(), o.eod_id() >= 0 ? o.eod_id() : -1);
  }
  // The library-backed types: the files are checked here so that a typo is reported
  // before a Python process starts.
  if (type == "GPT2BPETokenizer") {
    check_file(o.vocab_file(), type, "--vocab-file", "the GPT-2 vocab.json");
    check_file(o.merge_file(), type, "--merge-file", "the GPT-2 merges.txt");
  } else if (type == "HuggingFaceTokenizer") {
    check_file(o.tokenizer_model(), type, "--tokenizer-model", "a tokenizer directory or tokenizer.json");
  } else if (type == "SentencePieceTokenizer" || type == "Llama2Tokenizer") {
    check_file(o.tokenizer_model(), type, "--tokenizer-model", "the SentencePiece .model");
  } else {
    std::string names;
    for (const auto& n : kTokenizerTypes) names += (names.empty() ? "" : ", ") + n;
    MEGATORCH_FAIL("unknown --tokenizer-type '", type, "'; megatorch has ", names);
  }
  return make_python_tokenizer(o);
}

}  // namespace megatorch::data
