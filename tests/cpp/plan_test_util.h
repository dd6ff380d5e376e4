#pragma once
// Shapes the planner's unit tests share.
#include "megatorch/plan/model_spec.h"

namespace plan_test {

// Mixtral 8x7B's shape (46.7B parameters, 12.9B active): SwiGLU experts without biases.
inline megatorch::plan::ModelSpec mixtral() {
  megatorch::plan::ModelSpec m;
  m.name = "mixtral";
  m.num_layers = 32, m.hidden_size = 4096, m.num_attention_heads = 32, m.num_query_groups = 8;
  m.ffn_hidden_size = 14336, m.vocab_size = 32000, m.seq_length = 4096;
  m.swiglu = m.rms_norm = true, m.learned_positions = m.add_bias_linear = m.tie_embeddings = false;
  m.num_experts = 8, m.moe_router_topk = 2;
  return m;
}

}  // namespace plan_test
