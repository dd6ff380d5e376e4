// The C++ API as docs/*.md show it to users, compiled against the installed headers and
// linked against the installed library, so a change that breaks documented user code
// fails here (CTest consumer_build) rather than in a user's build. Each function is one
// snippet, kept as the doc writes it, with its free variables made parameters; a snippet
// that changes in the docs should change here too. The README's example is compiled
// verbatim, extracted from README.md (readme_example.cpp, generated). docs/custom_models.md
// quotes examples/bert_classifier, vit and custom_loop, which the main build compiles.
//
// main() runs what is cheap on one process: the versions, a GPT step with the optimizer
// through train::gpt_model_parameters and through the deprecated optim:: names.
#include <megatorch/data/tokenizer.h>
#include <megatorch/megatorch.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <cmath>
#include <cstring>
#include <iostream>

#include "api_checks.h"

// The package's version (find_package), passed by CMakeLists.txt: the installed headers
// must say the same.
static_assert(MEGATORCH_VERSION_MAJOR == MEGATORCH_PACKAGE_VERSION_MAJOR, "version.h disagrees with the CMake package");
static_assert(MEGATORCH_VERSION_MINOR == MEGATORCH_PACKAGE_VERSION_MINOR, "version.h disagrees with the CMake package");
static_assert(MEGATORCH_VERSION_PATCH == MEGATORCH_PACKAGE_VERSION_PATCH, "version.h disagrees with the CMake package");
static_assert(MEGATORCH_VERSION == MEGATORCH_PACKAGE_VERSION_MAJOR * 10000 + MEGATORCH_PACKAGE_VERSION_MINOR * 100 +
                                       MEGATORCH_PACKAGE_VERSION_PATCH,
              "MEGATORCH_VERSION is MAJOR * 10000 + MINOR * 100 + PATCH");

namespace docs {

using namespace megatorch;

// docs/tp.md, "From C++".
void tp_mappings(const at::Tensor& x) {
  parallel::ParallelState state(parallel::ParallelStateOptions(/*tp=*/2, /*pp=*/2));  // from torchrun's env
  comm::Group tp(state, parallel::GroupKind::kTensor);
  auto y = comm::copy_to_tp_region(x, tp.name());     // f: identity forward, all-reduce backward
  auto z = comm::reduce_from_tp_region(y, tp.name()); // g: all-reduce forward, identity backward
  auto bytes = tp.stats()[comm::CommOp::kAllReduce].bytes;
  (void)z, (void)bytes;
}

// docs/tp.md, "Tensor- and sequence-parallel layers".
void tp_layers(const parallel::ParallelState& state, const at::Tensor& ids, const at::Tensor& labels) {
  auto tp = state.group_name(parallel::GroupKind::kTensor);
  tp::ColumnParallelLinear fc1(tp::ColumnParallelLinearOptions(1024, 4096).group(tp).sequence_parallel(true));
  tp::RowParallelLinear fc2(tp::RowParallelLinearOptions(4096, 1024).group(tp).sequence_parallel(true));

  auto config = transformer::TransformerConfig()
      .hidden_size(1024).num_attention_heads(16).num_query_groups(4)     // GQA
      .num_layers(24).seq_length(2048).vocab_size(50257)
      .normalization(transformer::Normalization::kRMSNorm)
      .activation(transformer::Activation::kSwiGLU)
      .position_embedding_type(transformer::Positions::kRope)
      .sequence_parallel(true).recompute(transformer::Recompute::kSelective);
  models::GPTModel gpt(models::GPTModelOptions(config).group(tp));       // or a layer range:
  models::GPTModel part(models::GPTModelOptions(config).group(tp).layer_begin(12).layer_end(24).pre_process(false));
  auto loss = gpt->loss(ids /*[b, s]*/, labels /*[b, s]*/);
  loss.backward();
  gpt->allreduce_sequence_parallel_grads();   // norms, row biases, positions under SP
}

// docs/zero.md.
void zero(models::GPTModel& model, const parallel::ParallelState& state, const at::Tensor& ids, const at::Tensor& labels) {
  using megatorch::parallel::GroupKind;
  auto params = megatorch::train::gpt_model_parameters({model});
  megatorch::optim::DistributedOptimizer opt(params.units, state.group_name(GroupKind::kData),
      megatorch::optim::DistributedOptimizerOptions().zero_stage(2).lr(3e-4).weight_decay(0.1).clip_grad(1.0)
          .model_parallel_groups({state.group_name(GroupKind::kTensor)}), params.info);
  megatorch::train::attach_unit_hooks({model}, opt);  // ZeRO-3, or overlap_param_gather
  opt.zero_grad(); model->loss(ids, labels).backward(); opt.step();
}

// docs/pipeline.md, "The executor".
void pipeline_executor(const transformer::TransformerConfig& config, const parallel::ParallelState& state,
                       const std::vector<pipeline::MicroBatch>& micro_batches) {
  pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config)
      .tp_group(state.group_name(parallel::GroupKind::kTensor))
      .pp_group(state.group_name(parallel::GroupKind::kPipeline))
      .virtual_chunks(2));                                // layers split evenly, or .layer_split({...})
  auto step = pipeline::run_pipeline_step(stage, micro_batches,
      pipeline::ExecutorOptions().schedule(pipeline::ScheduleKind::kInterleaved));
  stage->allreduce_tied_embedding_grads();                // first <-> last stage
  stage->allreduce_sequence_parallel_grads();
  auto timeline = pipeline::gather_timeline(step, state.group_name(parallel::GroupKind::kPipeline));
  pipeline::write_timeline_svg("timeline.svg", timeline); // real timings, same picture
  // The grouping that replaces the two allreduce_* calls.
  auto params = train::pipeline_stage_parameters(stage);
  (void)params, (void)train::optimizer_sums_tied_embedding(stage);
}

// docs/pipeline.md, "Any model: pipeline::Stage and ModuleStage" (MyEncoderChunk: any
// module whose forward takes a tensor).
struct MyEncoderChunkImpl : torch::nn::Module {
  MyEncoderChunkImpl(int64_t first_layer, int64_t num_layers) {
    embed = register_module("embed", torch::nn::Embedding(16, 8));
  }
  at::Tensor forward(const at::Tensor& tokens) { return embed->forward(tokens).sum(1); }
  torch::nn::Embedding embed{nullptr};
};
TORCH_MODULE(MyEncoderChunk);

void module_stage(const std::string& pp, const std::string& tp, const std::vector<pipeline::MicroBatch>& micro_batches) {
  std::vector<torch::nn::AnyModule> chunks{torch::nn::AnyModule(MyEncoderChunk(/*layers*/ 0, 2))};
  pipeline::ModuleStage stage(chunks, pipeline::ModuleStageOptions()
      .pp_group(pp).tp_group(tp)                       // the groups its parallel layers use
      .input("tokens")                                 // what the first virtual stage reads
      .loss([](const at::Tensor& logits, const pipeline::MicroBatch& mb) {
        return at::cross_entropy_loss(logits, mb.get("label")); })
      .tied({{"embedding", 0, "embed.weight"}}));      // shared across stages, by name
  auto step = pipeline::run_pipeline_step(stage, micro_batches, pipeline::ExecutorOptions());
  stage->allreduce_tied_grads();                       // or let the optimizer sum the tie
}

// docs/train.md, "Any model: the training loop" (my_chunks, my_loss, my_batches,
// my_validation_batches: the user's).
std::vector<torch::nn::AnyModule> my_chunks(const std::string& tp_group, int64_t pp_rank) {
  return {torch::nn::AnyModule(MyEncoderChunk(pp_rank, 1))};
}
at::Tensor my_loss(const at::Tensor& output, const pipeline::MicroBatch& mb) {
  return at::cross_entropy_loss(output, mb.get("label"));
}
std::vector<pipeline::MicroBatch> my_batches(int64_t step, int64_t dp_rank) { return {}; }
std::vector<pipeline::MicroBatch> my_validation_batches(int64_t i, int64_t dp_rank) { return {}; }

void training_loop() {
  train::TrainingLoop loop(train::TrainingLoopOptions()
      .tensor_parallel(2).pipeline_parallel(2).zero_stage(1).schedule("1f1b")
      .micro_batch_size(4).num_micro_batches(4).train_iters(200)
      .lr(1e-3).lr_warmup_iters(10).clip_grad(1.0).log_json("run.json")
      .eval_interval(50).eval_iters(2).save("ckpt").load("ckpt"));
  pipeline::ModuleStage stage(my_chunks(loop.tp_group(), loop.parallel_state().pp_rank()),
      pipeline::ModuleStageOptions().pp_group(loop.pp_group()).tp_group(loop.tp_group())
          .input("tokens").loss(my_loss));
  loop.set_model(stage.ptr());     // optimizer, ZeRO-3 hooks, and --load if it holds a checkpoint
  loop.train([&](int64_t step) { return my_batches(step, loop.dp_rank()); },   // this DP rank's
             [&](int64_t i) { return my_validation_batches(i, loop.dp_rank()); });
}

// docs/custom_models.md, "Context parallelism in your own model" (my_chunks: the
// model's chunks, whose attention crosses the CP group).
std::vector<torch::nn::AnyModule> my_cp_chunks(const std::string& cp_group) { return my_chunks("", 0); }
void context_parallel_module_stage() {
  train::TrainingLoop loop(train::TrainingLoopOptions().context_parallel(2));
  pipeline::ModuleStage stage(my_cp_chunks(loop.cp_group()),
      pipeline::ModuleStageOptions()
          .pp_group(loop.pp_group())
          .cp_group(loop.cp_group())
          .sequence_dims({{"tokens", 1}, {"targets", 1}})  // [b, s] both: cut along dim 1
          .input("tokens")
          .loss([](const at::Tensor& logits, const pipeline::MicroBatch& mb) {
            return at::cross_entropy_loss(logits.flatten(0, 1), mb.get("targets").flatten());
          }));
  loop.set_model(stage.ptr());
}

// docs/checkpoints.md.
void checkpoints(pipeline::PipelineStage& stage, const transformer::TransformerConfig& config,
                 const parallel::ParallelState& state, const std::string& world, int64_t iteration, int64_t n,
                 const nlohmann::json& rng_state_json) {
  auto entries = ckpt::pipeline_stage_entries(*stage);        // or gpt_model_entries(*model)
  // + the optimizer's own entries ("optim/..."), with begin/end for ZeRO shards
  ckpt::CheckpointState st{ckpt::gpt_config_json(config), {{"consumed_samples", n}}, rng_state_json};
  ckpt::save_checkpoint("ckpt/", iteration, entries, st, state.group_name(parallel::GroupKind::kWorld));
  // later, in any layout:
  auto loaded = ckpt::load_checkpoint("ckpt/", entries, ckpt::LoadOptions()
      .group(world).model_config(ckpt::gpt_shape_json(config)));   // latest, or .iteration(n)
}

// docs/data.md.
at::Tensor data(int64_t train_iters, int64_t global_batch, int64_t valid_samples, int64_t test_samples, int64_t i) {
  using namespace megatorch::data;
  GPTDatasets ds = build_gpt_datasets(GPTDataOptions()
      .blend(parse_data_path({"0.3", "data/a_text_document", "0.7", "data/b_text_document"}))
      .seq_length(1024).seed(1234).split("969,30,1")
      .num_samples({train_iters * global_batch, valid_samples, test_samples}));
  at::Tensor sample = ds.train->get(i);   // int64 [1025]: inputs sample[:-1], labels sample[1:]
  return sample;
}

// docs/tokenizers.md.
std::string tokenizers() {
  using namespace megatorch::data;
  auto tok = build_tokenizer(TokenizerOptions().tokenizer_type("GPT2BPETokenizer")
      .vocab_file("data/tokenizers/default-bpe/vocab.json")
      .merge_file("data/tokenizers/default-bpe/merges.txt"));
  std::vector<int64_t> ids = tok->tokenize("Return the module.");  // tok->vocab_size() 4096, tok->eod() 0
  std::string text = tok->detokenize(ids);
  return text;
}

}  // namespace docs

// What runs: one rank, an in-memory store (as examples/consumer/main.cpp).
int main() {
  using namespace megatorch;
  bool ok = true;
  auto check = [&ok](bool cond, const std::string& what) {
    if (!cond) std::cerr << "megatorch_api_check: FAILED: " << what << std::endl;
    ok = ok && cond;
  };
  // The headers' version is the library's (a stale install mixes them).
  check(megatorch::version() == MEGATORCH_VERSION_STRING,
        "megatorch::version() " + megatorch::version() + " == MEGATORCH_VERSION_STRING " MEGATORCH_VERSION_STRING);
  check(std::strcmp(MEGATORCH_VERSION_STRING, MEGATORCH_PACKAGE_VERSION) == 0,
        "MEGATORCH_VERSION_STRING == the CMake package's " MEGATORCH_PACKAGE_VERSION);

  parallel::ParallelState state(c10::make_intrusive<c10d::HashStore>(), 0, 1,
                                parallel::ParallelStateOptions().device("cpu"));
  auto config = transformer::TransformerConfig().hidden_size(32).num_attention_heads(4).num_layers(2)
                    .seq_length(16).vocab_size(64);
  models::GPTModel gpt(models::GPTModelOptions(config).group(state.group_name(parallel::GroupKind::kTensor)));
  at::manual_seed(0);
  const at::Tensor ids = at::randint(64, {2, 17});
  const at::Tensor inputs = ids.narrow(1, 0, 16), labels = ids.narrow(1, 1, 16);
  const at::Tensor before = gpt->loss(inputs, labels).detach();
  docs::zero(gpt, state, inputs, labels);                             // train:: names
  api_checks::old_readme_zero_snippet(gpt, state, inputs, labels);  // the deprecated optim:: names
  const at::Tensor after = gpt->loss(inputs, labels).detach();
  check(std::isfinite(after.item<double>()) && after.item<double>() < before.item<double>(),
        "two optimizer steps lower the loss");

  pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config)
                                    .tp_group(state.group_name(parallel::GroupKind::kTensor))
                                    .pp_group(state.group_name(parallel::GroupKind::kPipeline)));
  check(api_checks::old_names_forward(gpt, stage), "the deprecated optim:: names forward to train::");
  check(api_checks::old_schedule_checks_accept_everything(),
        "the deprecated schedule checks refuse nothing, and interleaved at VP 1 still names its need");

  std::cout << "megatorch " << megatorch::version() << ", loss " << before.item<double>() << " -> " << after.item<double>()
            << "\n" << (ok ? "api ok" : "api FAILED") << std::endl;
  return ok ? 0 : 1;
}
