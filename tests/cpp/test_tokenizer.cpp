// megatorch::data::build_tokenizer: ByteLevel and PreTokenized in C++, and the library-backed
// types through the Python co-process with the tokenizer shipped in data/tokenizers
// (tests/python/unit/test_tokenizers.py checks every type's ids against the libraries).
#include <filesystem>
#include <fstream>
#include <catch2/catch.hpp>
#include <stdlib.h>

#include <cstdlib>
#include <thread>

#include "megatorch/data/tokenizer.h"

namespace md = megatorch::data;
using Catch::Matchers::Contains;

namespace {

const std::string kShipped = std::string(MEGATORCH_SOURCE_DIR) + "/data/tokenizers/default-bpe";

md::TokenizerOptions gpt2() {
  return md::TokenizerOptions().tokenizer_type("GPT2BPETokenizer").vocab_file(kShipped + "/vocab.json")
      .merge_file(kShipped + "/merges.txt");
}

}  // namespace

TEST_CASE("ByteLevel and PreTokenized tokenizers", "[tokenizer]") {
  auto byte = md::build_tokenizer(md::TokenizerOptions());
  CHECK(byte->name() == "ByteLevel");
  CHECK(byte->vocab_size() == 257);
  CHECK(byte->eod() == 256);
  CHECK(byte->tokenize("a\xc3\xa9") == std::vector<int64_t>({'a', 0xc3, 0xa9}));
  // The end-of-document and padded rows are dropped, as Megatron's ByteLevel does.
  CHECK(byte->detokenize({'a', 256, 0xc3, 0xa9, 300}) == "a\xc3\xa9");
  CHECK_THROWS_WITH(byte->detokenize({-1}), Contains("negative id -1"));

  auto ids = md::build_tokenizer(md::TokenizerOptions().tokenizer_type("PreTokenized").vocab_size(100).eod_id(99));
  CHECK(!ids->has_text());
  CHECK(ids->vocab_size() == 100);
  CHECK(ids->eod() == 99);
  CHECK_THROWS_WITH(ids->tokenize("x"), Contains("has no text tokenizer"));
  CHECK_THROWS_WITH(md::build_tokenizer(md::TokenizerOptions().tokenizer_type("PreTokenized")),
                    Contains("needs --vocab-size"));
  CHECK_THROWS_WITH(md::build_tokenizer(md::TokenizerOptions().tokenizer_type("GPT2")),
                    Contains("unknown --tokenizer-type 'GPT2'") && Contains("SentencePieceTokenizer"));
}

TEST_CASE("library-backed tokenizers run in a Python co-process", "[tokenizer]") {
  auto bpe = md::build_tokenizer(gpt2());
  auto json = md::build_tokenizer(
      md::TokenizerOptions().tokenizer_type("HuggingFaceTokenizer").tokenizer_model(kShipped + "/tokenizer.json"));
  CHECK(bpe->vocab_size() == 4096);
  CHECK(bpe->eod() == 0);  // '<|endoftext|>'
  CHECK(json->vocab_size() == 4096);
  CHECK(json->eod() == 0);
  const std::string text = "Return the module's docstring \xe2\x80\x94 na\xc3\xafvely.\n";
  const auto ids = bpe->tokenize(text);
  CHECK(ids.size() < text.size());  // merges were applied
  CHECK(ids == json->tokenize(text));  // one vocabulary, two files, two library paths
  CHECK(bpe->detokenize(ids) == text);
  // An error inside the co-process is reported, and the process keeps serving.
  CHECK_THROWS_WITH(bpe->detokenize({4096}), Contains("cannot detokenize id 4096"));
  CHECK(bpe->tokenize(text) == ids);

  // One process each, started and ended from several threads at once.
  std::vector<std::thread> threads;
  std::vector<std::vector<int64_t>> got(3);
  for (size_t i = 0; i < got.size(); ++i) {
    threads.emplace_back([&, i] { got[i] = md::build_tokenizer(gpt2())->tokenize(text); });
  }
  for (auto& t : threads) t.join();
  for (const auto& g : got) CHECK(g == ids);

  CHECK_THROWS_WITH(md::build_tokenizer(gpt2().merge_file("")), Contains("needs --merge-file"));
  CHECK_THROWS_WITH(md::build_tokenizer(gpt2().vocab_file(kShipped + "/none.json")),
                    Contains("none.json does not exist"));
  const char* prev = std::getenv("MEGATORCH_PYTHON");
  const std::string saved = prev ? prev : "";
  ::setenv("MEGATORCH_PYTHON", "false", 1);  // an interpreter that exits at once: reported, not waited for
  CHECK_THROWS_WITH(md::build_tokenizer(gpt2()), Contains("exited with status 1 while starting"));
  // An interpreter that hangs: stopped at the deadline, never waited on forever.
  const std::string hang = (std::filesystem::temp_directory_path() / "megatorch_hung_python.sh").string();
  std::ofstream(hang) << "#!/bin/sh\nsleep 60\n";
  std::filesystem::permissions(hang, std::filesystem::perms::owner_all);
  ::setenv("MEGATORCH_PYTHON", hang.c_str(), 1);
  ::setenv("MEGATORCH_TOKENIZER_TIMEOUT_S", "0.5", 1);
  CHECK_THROWS_WITH(md::build_tokenizer(gpt2()), Contains("did not answer within 0.5 s of starting"));
  ::unsetenv("MEGATORCH_TOKENIZER_TIMEOUT_S");
  std::filesystem::remove(hang);
  prev ? ::setenv("MEGATORCH_PYTHON", saved.c_str(), 1) : ::unsetenv("MEGATORCH_PYTHON");
}
