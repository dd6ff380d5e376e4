// megatorch-dataset: inspect Megatron indexed datasets and the GPT samples megatorch draws
// from them.
//
//   megatorch-dataset info PREFIX                 header facts as JSON (validates the files)
//   megatorch-dataset docs PREFIX [--limit N]     each document as a JSON line {"ids": [...]}
//       [--tokenizer-type T ...]                  ... or as {"text": ...}, detokenized (JSONL
//                                                 for megatorch-preprocess, e.g. with another tokenizer)
//   megatorch-dataset samples --data-path [W] P ... --seq-length S --seed 1234
//       --split 969,30,1 --num-samples T V E --out DIR
//     writes DIR/{train,valid,test}.bin: int64 [n, S+1] token ids, sample by sample, in
//     the order the trainer reads them; and DIR/indices.json with the sample counts and,
//     for a single prefix, each split's document / sample / shuffle index
#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "megatorch/check.h"
#include "megatorch/data/gpt_datasets.h"
#include "megatorch/data/indexed_dataset.h"
#include "megatorch/data/tokenizer_flags.h"
#include "megatorch/io/atomic_file.h"
#include "megatorch/util/cli_last_wins.h"

namespace md = megatorch::data;
using nlohmann::json;

namespace {

int info(const std::string& prefix) {
  const md::IndexedDataset ds(prefix);
  json j;
  j["prefix"] = prefix;
  j["dtype"] = md::dtype_name(ds.dtype());
  j["dtype_code"] = static_cast<int>(ds.dtype());
  j["sequences"] = ds.num_sequences();
  j["documents"] = ds.num_documents();
  j["tokens"] = ds.num_tokens();
  j["has_modes"] = ds.has_modes();
  std::cout << j.dump() << "\n";
  return 0;
}

int docs(const std::string& prefix, int64_t limit, const md::TokenizerOptions* text) {
  const md::IndexedDataset ds(prefix);
  const auto tokenizer = text ? md::build_tokenizer(*text) : nullptr;
  const int64_t n = limit >= 0 ? std::min(limit, ds.num_documents()) : ds.num_documents();
  for (int64_t d = 0; d < n; ++d) {
    json ids = json::array();
    std::vector<int64_t> all;
    for (int64_t s = ds.document_index(d); s < ds.document_index(d + 1); ++s) {
      std::vector<int64_t> t(static_cast<size_t>(ds.sequence_length(s)));
      ds.read(s, 0, -1, t.data());
      all.insert(all.end(), t.begin(), t.end());
      json seq(t);
      ids.push_back(seq);
    }
    if (!tokenizer) {
      std::cout << json{{"ids", ids}}.dump() << "\n";
      continue;
    }
    if (!all.empty() && all.back() == tokenizer->eod()) all.pop_back();  // --append-eod's, not text
    // Bytes a tokenizer split mid-character print as U+FFFD rather than failing the dump.
    std::cout << json{{"text", tokenizer->detokenize(all)}}.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  }
  return 0;
}

template <typename T>
json vec(const std::vector<T>& v) {
  return json(v);
}

int samples(const std::vector<std::string>& data_path, int64_t seq_length, int64_t seed, const std::string& split,
            const std::vector<int64_t>& num_samples, const std::string& out_dir) {
  MEGATORCH_CHECK(num_samples.size() == 3, "--num-samples takes 3 counts (train valid test), got ", num_samples.size());
  const md::GPTDatasets ds = md::build_gpt_datasets(md::GPTDataOptions()
                                                        .blend(md::parse_data_path(data_path))
                                                        .seq_length(seq_length)
                                                        .seed(seed)
                                                        .split(split)
                                                        .num_samples({num_samples[0], num_samples[1], num_samples[2]}));
  json report;
  for (md::Split s : {md::Split::kTrain, md::Split::kValid, md::Split::kTest}) {
    const auto& d = ds[s];
    const std::string name = md::split_name(s);
    // Written aside and renamed into place: a failed dump leaves no partial file.
    megatorch::io::AtomicFile f(out_dir + "/" + name + ".bin");
    for (int64_t i = 0; i < d->size(); ++i) {
      const at::Tensor t = d->get(i);
      f.write(t.data_ptr<int64_t>(), static_cast<size_t>(t.numel()) * 8);
    }
    f.commit();
    json j{{"size", d->size()}};
    if (const auto* g = dynamic_cast<const md::GPTDataset*>(d.get())) {
      j["num_epochs"] = g->num_epochs();
      j["document_index"] = vec(g->document_index());
      j["sample_index"] = vec(g->sample_index());
      j["shuffle_index"] = vec(g->shuffle_index());
    } else if (const auto* b = dynamic_cast<const md::BlendedDataset*>(d.get())) {
      j["weights"] = vec(b->weights());
      j["dataset_index"] = vec(b->dataset_index());
      j["dataset_sample_index"] = vec(b->dataset_sample_index());
    }
    report[name] = j;
  }
  megatorch::io::write_file_atomically(out_dir + "/indices.json", report.dump() + "\n");
  std::printf("train %lld, valid %lld, test %lld samples of %lld tokens -> %s\n", static_cast<long long>(ds.train->size()),
              static_cast<long long>(ds.valid->size()), static_cast<long long>(ds.test->size()),
              static_cast<long long>(seq_length + 1), out_dir.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Inspect Megatron indexed datasets and megatorch's GPT samples"};
  app.require_subcommand(1);
  std::string prefix;
  int64_t limit = -1;
  auto* info_cmd = app.add_subcommand("info", "Validate PREFIX.bin/.idx and print its header as JSON");
  info_cmd->add_option("prefix", prefix, "Dataset prefix (without .bin/.idx)")->required();
  auto* docs_cmd = app.add_subcommand("docs", "Print each document as a JSON line {\"ids\": [[sequence ids]...]}");
  docs_cmd->add_option("prefix", prefix, "Dataset prefix (without .bin/.idx)")->required();
  docs_cmd->add_option("--limit", limit, "Print at most N documents");
  md::TokenizerOptions text;
  md::add_tokenizer_options(*docs_cmd, text);

  std::vector<std::string> data_path;
  int64_t seq_length = 0, seed = 1234;
  std::string split = "969,30,1", out_dir;
  std::vector<int64_t> num_samples{-1, -1, -1};
  auto* samples_cmd = app.add_subcommand("samples", "Write the train/valid/test samples as int64 arrays");
  samples_cmd->add_option("--data-path", data_path, "PREFIX... or W1 P1 W2 P2 ... as Megatron's --data-path")->required();
  samples_cmd->add_option("--seq-length", seq_length, "Tokens per sample input (samples hold one more)")->required();
  samples_cmd->add_option("--seed", seed, "Shuffle seed")->capture_default_str();
  samples_cmd->add_option("--split", split, "train,valid,test shares")->capture_default_str();
  samples_cmd->add_option("--num-samples", num_samples, "Samples wanted per split (train valid test; -1 = one epoch)")
      ->expected(3);
  samples_cmd->add_option("--out", out_dir, "Output directory")->required();
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = megatorch::util::parse_or_exit(app, argc, argv, "megatorch-dataset")) return *code;

  try {
    if (*info_cmd) return info(prefix);
    if (*docs_cmd) return docs(prefix, limit, docs_cmd->count("--tokenizer-type") ? &text : nullptr);
    return samples(data_path, seq_length, seed, split, num_samples, out_dir);
  } catch (const c10::Error& e) {
    std::cerr << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "megatorch-dataset: " << e.what() << "\n";
    return 1;
  }
}
