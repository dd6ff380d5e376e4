// stage_entries: checkpoint entries of any pipeline::Stage, named independently of the
// layout (GPT by its global layer index, a ModuleStage by ModuleStageImpl::global_name).
#include "megatorch/check.h"
#include "megatorch/ckpt/gpt_checkpoint.h"
#include "megatorch/ckpt/module_checkpoint.h"
#include "megatorch/pipeline/module_stage.h"
#include "megatorch/tp/tp_group.h"

namespace megatorch::ckpt {

std::vector<ShardedEntry> stage_entries(pipeline::Stage& stage, bool writer, const std::string& prefix) {
  if (auto* gpt = dynamic_cast<pipeline::PipelineStageImpl*>(&stage)) {
    return pipeline_stage_entries(*gpt, GPTEntriesOptions().prefix(prefix).writer(writer));
  }
  auto* ms = dynamic_cast<pipeline::ModuleStageImpl*>(&stage);
  MEGATORCH_CHECK(ms != nullptr, "checkpoint: expected a pipeline::ModuleStage or a GPT PipelineStage; for another "
                  "Stage implementation build its entries with ckpt::module_entries");
  std::vector<ShardedEntry> out;
  const int64_t tp_rank = tp::tp_info(ms->options.tp_group()).rank;
  for (int64_t c = 0; c < ms->num_chunks(); ++c) {
    auto o = ModuleEntriesOptions()
                 .prefix(prefix)
                 .writer(writer)
                 .tp_rank(tp_rank)
                 .sequence_parallel(ms->options.sequence_parallel())
                 .rename([ms, c](const std::string& name) { return ms->global_name(c, name); })
                 // A tie is written once, by its first copy.
                 .writes([ms, c](const std::string& name) {
                   for (const auto& t : ms->options.tied()) {
                     if (t.chunk == c && t.parameter == name) return ms->ties().is_primary({t.name, c, {}});
                   }
                   return true;
                 });
    for (auto& e : module_entries(*ms->chunk_module(c), o)) out.push_back(std::move(e));
  }
  return out;
}

}  // namespace megatorch::ckpt
