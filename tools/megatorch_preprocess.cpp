// megatorch-preprocess: JSONL -> Megatron indexed dataset (.bin/.idx), with the flag names
// of Megatron-LM's tools/preprocess_data.py.
//
//   megatorch-preprocess --input docs.jsonl --output-prefix out/my --json-keys text
//       --tokenizer-type ByteLevel --append-eod --workers 2
//   -> out/my_text_document.bin, out/my_text_document.idx
//
//   megatorch-preprocess --input docs.jsonl --output-prefix out/my_bpe --json-keys text
//       --tokenizer-type GPT2BPETokenizer --vocab-file data/tokenizers/default-bpe/vocab.json
//       --merge-file data/tokenizers/default-bpe/merges.txt --append-eod --workers 4
//
//   megatorch-preprocess --input ids.jsonl --output-prefix out/my --json-keys ids
//       --tokenizer-type PreTokenized --vocab-size 50257 --eod-id 50256 --append-eod
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "megatorch/check.h"
#include "megatorch/data/preprocess.h"
#include "megatorch/data/tokenizer_flags.h"
#include "megatorch/util/cli_last_wins.h"

namespace md = megatorch::data;

int main(int argc, char** argv) {
  CLI::App app{"Tokenize a JSONL file into Megatron's indexed dataset format (.bin/.idx)"};
  std::string input, output_prefix;
  md::TokenizerOptions tokenizer;
  std::vector<std::string> json_keys{"text"};
  bool append_eod = false;
  int64_t workers = 1;
  int64_t max_line_bytes = md::PreprocessOptions().max_line_bytes();
  app.add_option("--input", input, "JSONL file, one JSON object per line")->required();
  app.add_option("--output-prefix", output_prefix, "Writes PREFIX_KEY_document.bin/.idx for each json key")->required();
  app.add_option("--json-keys", json_keys, "Keys whose values become documents")->capture_default_str();
  app.add_flag("--append-eod", append_eod, "Append the end-of-document id to every non-empty document");
  md::add_tokenizer_options(app, tokenizer);
  app.add_option("--vocab-size", tokenizer.vocab_size(), "PreTokenized: size of the vocabulary (ids must be below it)");
  app.add_option("--workers", workers, "Threads that parse and tokenize")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--max-line-bytes", max_line_bytes, "A longer JSONL line fails with its line number")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "megatorch-preprocess")) return *code;

  try {
    const auto t0 = std::chrono::steady_clock::now();
    const md::PreprocessReport r = md::preprocess_jsonl(md::PreprocessOptions()
                                                            .input(input)
                                                            .output_prefix(output_prefix)
                                                            .json_keys(json_keys)
                                                            .append_eod(append_eod)
                                                            .tokenizer(tokenizer)
                                                            .workers(workers)
                                                            .max_line_bytes(max_line_bytes));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("processed %lld documents (%.2f MB) in %.2f s with %s (vocab %lld), dtype %s\n",
                static_cast<long long>(r.lines), static_cast<double>(r.input_bytes) / 1e6, s, r.tokenizer.c_str(),
                static_cast<long long>(r.vocab_size), r.dtype.c_str());
    for (const auto& o : r.outputs) {
      std::printf("  %s: %lld documents, %lld sequences, %lld tokens -> %s.bin/.idx\n", o.key.c_str(),
                  static_cast<long long>(o.documents), static_cast<long long>(o.sequences), static_cast<long long>(o.tokens),
                  o.prefix.c_str());
    }
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";  // what() would add a C++ backtrace
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "megatorch-preprocess: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
