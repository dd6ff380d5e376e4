// megatorch-generate: text generation from a checkpoint with a KV cache, launched by
// torchrun like the trainer (or run directly as one process):
//   torchrun --nproc-per-node=2 --no-python build/bin/megatorch-generate --load ckpt/ \
//     --tensor-model-parallel-size 2 --prompt "def main(" --max-new-tokens 48
// The model's shape comes from the checkpoint (saved at any layout); world size must be
// tp x pp. Greedy unless --temperature, --top-k or --top-p is given. Rank 0 prints each
// prompt with its continuation and writes --output-json (one JSON line per prompt).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "megatorch/check.h"
#include "megatorch/ckpt/checkpoint.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "megatorch/comm/group.h"
#include "megatorch/data/tokenizer.h"
#include "megatorch/data/tokenizer_flags.h"
#include "megatorch/inference/kv_cache.h"
#include "megatorch/inference/text_generator.h"
#include "megatorch/parallel/launch_env.h"
#include "megatorch/parallel/parallel_state.h"
#include "megatorch/pipeline/pipeline_stage.h"
#include "megatorch/util/cli_last_wins.h"

namespace mt = megatorch;
using mt::parallel::GroupKind;
using nlohmann::json;

namespace {

struct Args {
  std::string load;
  int64_t iteration = -1;
  int64_t tp = 1, pp = 1;
  std::vector<std::string> prompts;
  std::string prompts_file;
  int64_t max_new_tokens = 32;
  double temperature = 1.0;
  int64_t top_k = 0;
  double top_p = 0.0;
  int64_t seed = 1234;
  bool ignore_eod = false;
  std::string device = "cpu";
  std::string backend = "auto";
  std::string output_json;
  mt::data::TokenizerOptions tokenizer;
  bool sample = false;           // set from the flags given
  bool tokenizer_given = false;  // --tokenizer-type on the command line
};

struct Prompt {
  std::string text;  // empty for an {"ids": ...} prompt
  std::vector<int64_t> ids;
};

// The text the generated ids add to the prompt. Decoded with the prompt and the prompt's
// own decoding cut off: SentencePiece-style decoders drop a sequence's leading space, so
// the continuation decoded alone would lose the space between prompt and answer.
std::string continuation_text(mt::data::Tokenizer& tokenizer, const std::vector<int64_t>& prompt,
                              const std::vector<int64_t>& generated) {
  std::vector<int64_t> prompt_ok;
  for (int64_t id : prompt) {
    if (id < tokenizer.vocab_size()) prompt_ok.push_back(id);
  }
  std::vector<int64_t> all = prompt_ok;
  all.insert(all.end(), generated.begin(), generated.end());
  const std::string whole = tokenizer.detokenize(all), head = tokenizer.detokenize(prompt_ok);
  if (whole.compare(0, head.size(), head) == 0) return whole.substr(head.size());
  return tokenizer.detokenize(generated);
}

// Every prompt, tokenized: --prompt flags first, then the file's lines in order.
std::vector<Prompt> read_prompts(const Args& a, mt::data::Tokenizer& tokenizer) {
  std::vector<Prompt> out;
  auto from_text = [&](const std::string& text) {
    MEGATORCH_CHECK(tokenizer.has_text(), "megatorch-generate: a text prompt needs a tokenizer with text; ",
                    tokenizer.name(), " has ids only: give {\"ids\": [...]} lines in --prompts-file or pick "
                    "--tokenizer-type");
    out.push_back({text, tokenizer.tokenize(text)});
  };
  for (const auto& p : a.prompts) from_text(p);
  if (!a.prompts_file.empty()) {
    std::ifstream in(a.prompts_file);
    MEGATORCH_CHECK(in.good(), "megatorch-generate: cannot open --prompts-file '", a.prompts_file, "'");
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      json j;
      try {
        j = json::parse(line);
      } catch (const std::exception& e) {
        MEGATORCH_FAIL("megatorch-generate: ", a.prompts_file, ":", n, " is not JSON (", e.what(), ")");
      }
      if (j.is_object() && j.contains("text") && j.at("text").is_string()) {
        from_text(j.at("text").get<std::string>());
      } else if (j.is_object() && j.contains("ids") && j.at("ids").is_array()) {
        try {
          out.push_back({"", j.at("ids").get<std::vector<int64_t>>()});
        } catch (const std::exception& e) {
          MEGATORCH_FAIL("megatorch-generate: ", a.prompts_file, ":", n, ": expected \"ids\" to be integers (", e.what(), ")");
        }
      } else {
        MEGATORCH_FAIL("megatorch-generate: ", a.prompts_file, ":", n, ": expected {\"text\": \"...\"} or {\"ids\": [...]}, got ",
                       line);
      }
    }
  }
  MEGATORCH_CHECK(!out.empty(), "megatorch-generate: expected at least one prompt: give --prompt TEXT or --prompts-file "
                  "FILE (JSONL, {\"text\": ...} or {\"ids\": [...]} per line)");
  return out;
}

// Rank 0 reads and tokenizes the prompts (one tokenizer process, not one per rank); the
// ids go to every rank as [ok, eod, count, lengths..., ids...]. A failure on rank 0 is
// sent too, so the other ranks stop instead of waiting.
std::vector<std::vector<int64_t>> share_prompts(const std::vector<Prompt>& prompts, int64_t eod, bool ok,
                                                int64_t& eod_out, mt::comm::Group& world) {
  std::vector<int64_t> flat{ok ? 1 : 0, eod, static_cast<int64_t>(prompts.size())};
  for (const auto& p : prompts) flat.push_back(static_cast<int64_t>(p.ids.size()));
  for (const auto& p : prompts) flat.insert(flat.end(), p.ids.begin(), p.ids.end());
  at::Tensor size = at::tensor({static_cast<int64_t>(flat.size())}, at::kLong);
  world.broadcast(size, 0);
  at::Tensor data = world.rank() == 0 ? at::tensor(flat, at::kLong) : at::empty({size.item<int64_t>()}, at::kLong);
  world.broadcast(data, 0);
  const int64_t* d = data.data_ptr<int64_t>();
  MEGATORCH_CHECK(d[0] == 1, "megatorch-generate: rank 0 could not read the prompts (its error says why)");
  eod_out = d[1];
  const int64_t count = d[2];
  std::vector<std::vector<int64_t>> out(count);
  int64_t at = 3 + count;
  for (int64_t i = 0; i < count; ++i) {
    out[i].assign(d + at, d + at + d[3 + i]);
    at += d[3 + i];
  }
  return out;
}

int run(const Args& a) {
  const char* world_env = std::getenv("WORLD_SIZE");
  const int64_t world = world_env ? mt::parallel::LaunchEnv::from_environment().world_size : 1;
  MEGATORCH_CHECK(world == a.tp * a.pp, "megatorch-generate: expected world size = tensor x pipeline parallel size = ",
                  a.tp, " x ", a.pp, " = ", a.tp * a.pp, " (generation has no data parallelism), got ", world,
                  " processes; launch torchrun --nproc-per-node=", a.tp * a.pp, " or change the sizes");
  MEGATORCH_CHECK(mt::ckpt::latest_iteration(a.load) >= 0 || a.iteration >= 0, "megatorch-generate: --load '", a.load,
                  "' holds no checkpoint (no latest_checkpointed_iteration.txt); train with --save or import one with "
                  "megatorch-hf import");
  const json meta = mt::ckpt::read_metadata(a.load, a.iteration);
  mt::transformer::TransformerConfig base;
  base.hidden_dropout(0).attention_dropout(0).sequence_parallel(false);
  auto config = mt::ckpt::gpt_config_from_json(meta.at("model_config"), base);
  config.validate(a.tp);
  const auto sampling = mt::inference::SamplingOptions()
                            .greedy(!a.sample)
                            .temperature(a.temperature)
                            .top_k(a.top_k)
                            .top_p(a.top_p);
  sampling.validate();

  auto options = mt::parallel::ParallelStateOptions(a.tp, a.pp).name("generate").device(a.device).backend(a.backend);
  std::unique_ptr<mt::parallel::ParallelState> state =
      world_env ? std::make_unique<mt::parallel::ParallelState>(options)
                : std::make_unique<mt::parallel::ParallelState>(c10::make_intrusive<c10d::HashStore>(), 0, 1, options);
  config.device(state->device());
  const bool rank0 = state->rank() == 0;
  mt::comm::Group world_group(*state, GroupKind::kWorld);

  std::unique_ptr<mt::data::Tokenizer> tokenizer;
  std::vector<Prompt> prompts;
  int64_t eod = -1;
  if (rank0) {
    try {
      auto t = a.tokenizer;
      if (t.vocab_size() < 0) t.vocab_size(config.vocab_size());
      tokenizer = mt::data::build_tokenizer(t);
      prompts = read_prompts(a, *tokenizer);
      eod = tokenizer->eod();
      const bool text = std::any_of(prompts.begin(), prompts.end(), [](const Prompt& p) { return !p.text.empty(); });
      // Text through another model's tokenizer is garbage without an error: the default
      // (ByteLevel) is taken only for a model of its vocabulary; any prompt id outside the
      // model's is refused below.
      MEGATORCH_CHECK(!text || a.tokenizer_given || config.vocab_size() == mt::data::kByteLevelVocabSize,
                      "megatorch-generate: text prompts need the model's tokenizer: the checkpoint's vocabulary is ",
                      config.vocab_size(), " ids, not the default ByteLevel's ", mt::data::kByteLevelVocabSize,
                      "; give --tokenizer-type (and --tokenizer-model or --vocab-file/--merge-file)");
    } catch (...) {
      try {
        share_prompts({}, -1, false, eod, world_group);  // tells the others, which then fail
      } catch (const c10::Error&) {
      }
      throw;  // this rank's own error, which says why
    }
  }
  const auto ids = share_prompts(prompts, eod, true, eod, world_group);
  const int64_t stop = a.ignore_eod ? -1 : eod;
  // Every prompt checked before anything runs.
  for (size_t i = 0; i < ids.size(); ++i) {
    try {
      MEGATORCH_CHECK(!ids[i].empty(), "megatorch-generate: expected a prompt of at least one token, got none");
      for (int64_t id : ids[i]) {
        MEGATORCH_CHECK(id >= 0 && id < config.vocab_size(), "megatorch-generate: expected prompt ids in [0, ",
                        config.vocab_size(), ") (the model's vocabulary), got ", id);
      }
      mt::inference::check_sequence_length(config, static_cast<int64_t>(ids[i].size()) + a.max_new_tokens);
    } catch (const c10::Error& e) {
      MEGATORCH_FAIL("prompt ", i + 1, " (", ids[i].size(), " tokens): ", e.what_without_backtrace());
    }
  }

  auto stage = mt::pipeline::PipelineStage(
      mt::pipeline::PipelineStageOptions(config)
          .tp_group(state->group_name(GroupKind::kTensor))
          .pp_group(a.pp > 1 ? state->group_name(GroupKind::kPipeline) : ""));
  auto entries = mt::ckpt::pipeline_stage_entries(*stage);
  // The model is built from this checkpoint's own configuration: no comparison needed
  // (the load still checks every tensor's shape).
  const auto loaded = mt::ckpt::load_checkpoint(a.load, entries,
                                                mt::ckpt::LoadOptions()
                                                    .iteration(meta.at("iteration").get<int64_t>())
                                                    .group(state->group_name(GroupKind::kWorld)));
  if (rank0) {
    std::printf("[megatorch] generate: %s (iteration %ld, saved by %ld ranks) at tp %ld x pp %ld on %s; %s, %ld new "
                "tokens at most\n",
                loaded.path.c_str(), static_cast<long>(loaded.iteration), static_cast<long>(loaded.world_size),
                static_cast<long>(a.tp), static_cast<long>(a.pp), state->device().str().c_str(),
                a.sample ? "sampling" : "greedy", static_cast<long>(a.max_new_tokens));
    std::fflush(stdout);
  }

  mt::inference::TextGenerator generator(
      stage->chunk(0), mt::inference::TextGeneratorOptions().pp_group(a.pp > 1 ? state->group_name(GroupKind::kPipeline) : ""));
  at::Generator rng = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(a.seed));
  // Each prompt starts from --seed: its continuation does not depend on the other prompts.
  auto reseed = [&] {
    std::lock_guard<std::mutex> lock(rng.mutex());
    rng.set_current_seed(static_cast<uint64_t>(a.seed));
  };
  std::ofstream out;
  if (rank0 && !a.output_json.empty()) {
    out.open(a.output_json);
    MEGATORCH_CHECK(out.good(), "megatorch-generate: cannot write --output-json '", a.output_json, "'");
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    reseed();
    const auto generated = generator.generate(
        ids[i], mt::inference::GenerationOptions().max_new_tokens(a.max_new_tokens).sampling(sampling).stop_token(stop),
        rng);
    if (!rank0) continue;
    json line{{"prompt_ids", ids[i]}, {"generated_ids", generated}};
    if (tokenizer->has_text()) {
      auto body = generated;
      if (!body.empty() && body.back() == stop) body.pop_back();  // the end of document is no text
      // Rows beyond the tokenizer's ids (HF models often have spare ones) have no text.
      body.erase(std::remove_if(body.begin(), body.end(), [&](int64_t id) { return id >= tokenizer->vocab_size(); }),
                 body.end());
      const std::string prompt_text = prompts[i].text.empty() ? tokenizer->detokenize(ids[i]) : prompts[i].text;
      line["prompt"] = prompt_text;
      line["text"] = continuation_text(*tokenizer, ids[i], body);
      std::printf("--- prompt %zu: %s\n%s%s\n", i + 1, prompt_text.c_str(), prompt_text.c_str(),
                  line["text"].get<std::string>().c_str());
    } else {
      std::printf("--- prompt %zu: %s\n%s\n", i + 1, json(ids[i]).dump().c_str(), json(generated).dump().c_str());
    }
    std::fflush(stdout);
    if (out.is_open()) out << line.dump(-1, ' ', false, json::error_handler_t::replace) << "\n";
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"megatorch-generate: text generation with a KV cache from a megatorch checkpoint (any layout)"};
  Args a;
  app.add_option("--load", a.load, "checkpoint directory (its model configuration is used)")->required();
  app.add_option("--iteration", a.iteration, "iteration to load (-1: the latest)")->capture_default_str();
  app.add_option("--tensor-model-parallel-size", a.tp, "TP size to run at (any, whatever the checkpoint's)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--pipeline-model-parallel-size", a.pp, "pipeline stages (run in turn for each token)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  // Cumulative, unlike every other flag (which takes its last value): each --prompt adds a prompt.
  app.add_option("--prompt", a.prompts, "a text prompt; each --prompt adds one")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  app.add_option("--prompts-file", a.prompts_file, "JSONL file, one {\"text\": \"...\"} or {\"ids\": [...]} per line");
  app.add_option("--max-new-tokens", a.max_new_tokens, "tokens to generate per prompt")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  auto* temperature = app.add_option("--temperature", a.temperature, "sample from softmax(logits / T)");
  auto* top_k = app.add_option("--top-k", a.top_k, "sample among the k most likely tokens (0: all; 1: greedy)");
  auto* top_p = app.add_option("--top-p", a.top_p, "sample within the nucleus of probability p (0: off)");
  app.add_option("--seed", a.seed, "seed of the sampling generator")->capture_default_str();
  app.add_flag("--ignore-eod", a.ignore_eod, "do not stop at the tokenizer's end-of-document token");
  app.add_option("--device", a.device, "cpu, auto (cuda:LOCAL_RANK when CUDA is available), cuda or cuda:N")
      ->capture_default_str();
  app.add_option("--distributed-backend", a.backend, "backend of device tensors: auto (NCCL on CUDA), nccl, gloo")
      ->check(CLI::IsMember({"auto", "nccl", "gloo"}))
      ->capture_default_str();
  app.add_option("--output-json", a.output_json,
                 "write one JSON line per prompt: prompt_ids, generated_ids, and prompt and text when the tokenizer "
                 "has text");
  mt::data::add_tokenizer_options(app, a.tokenizer);
  // A repeated flag takes its last value, as in Megatron (launch scripts append overrides).
  if (auto code = mt::util::parse_or_exit(app, argc, argv, "megatorch-generate")) return *code;
  // Greedy unless a sampling flag is given: then top-k, then top-p on logits / temperature.
  a.sample = temperature->count() + top_k->count() + top_p->count() > 0;
  a.tokenizer_given = app.count("--tokenizer-type") > 0;
  try {
    return run(a);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "megatorch: megatorch-generate: %s\n", e.what());
    return 1;
  }
}
