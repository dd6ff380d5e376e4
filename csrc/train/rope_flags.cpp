// gpt_pretrain's RoPE scaling flags (--use-rope-scaling, --rope-type, --rope-scaling-factor,
// --original-max-position-embeddings) resolved into a transformer::RopeScaling.
#include "rope_flags.h"

#include "megatorch/check.h"

namespace megatorch::train::detail {

transformer::RopeScaling rope_scaling_of(const TrainArguments& a) {
  using transformer::RopeType;
  const bool flags = a.use_rope_scaling || a.given.count("rope-type") || a.given.count("rope-scaling-factor") ||
                     a.given.count("original-max-position-embeddings");
  transformer::RopeScaling s;
  if (a.use_rope_scaling) {
    MEGATORCH_CHECK(a.rope_type == "default" || a.rope_type == "llama3", "gpt_pretrain: --use-rope-scaling is Llama ",
                    "3.1's llama3 scaling, but --rope-type is '", a.rope_type, "'; give one of them");
    s.type(RopeType::kLlama3).factor(a.rope_scaling_factor).low_freq_factor(1).high_freq_factor(4);
    s.original_max_position_embeddings(a.original_max_position_embeddings > 0 ? a.original_max_position_embeddings
                                                                               : 8192);
  } else {
    s.type(transformer::parse_rope_type(a.rope_type));
    if (s.type() != RopeType::kDefault) {
      s.factor(a.rope_scaling_factor);
      const int64_t fallback = a.max_position_embeddings > 0 ? a.max_position_embeddings : a.seq_length;
      s.original_max_position_embeddings(a.original_max_position_embeddings > 0 ? a.original_max_position_embeddings
                                                                                : fallback);
    }
  }
  if (!a.checkpoint_rope_scaling) return s;
  if (!flags) return *a.checkpoint_rope_scaling;
  MEGATORCH_CHECK(s.type() == a.checkpoint_rope_scaling->type() && s.factor() == a.checkpoint_rope_scaling->factor() &&
                      s.original_max_position_embeddings() ==
                          a.checkpoint_rope_scaling->original_max_position_embeddings(),
                  "gpt_pretrain: the RoPE scaling flags (", transformer::to_string(s.type()), ", factor ", s.factor(),
                  ", original context ", s.original_max_position_embeddings(), ") disagree with the checkpoint in ",
                  a.load, " (", transformer::to_string(a.checkpoint_rope_scaling->type()), ", factor ",
                  a.checkpoint_rope_scaling->factor(), ", original context ",
                  a.checkpoint_rope_scaling->original_max_position_embeddings(),
                  ") under --use-checkpoint-args; drop the flags to train the checkpoint's model");
  return *a.checkpoint_rope_scaling;
}


}  // namespace megatorch::train::detail
