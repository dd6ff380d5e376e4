#pragma once
// Shapes the planner's unit tests share.
#include "megatorch/plan/memory.h"
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

// The MoE layer tests/python/unit/test_plan_cli.py measures: (s, b, h, a) = (64, 2, 32, 4),
// 4 experts of F = 96, top-2, GeLU with biases.
inline megatorch::plan::ModelSpec small_moe_layer() {
  megatorch::plan::ModelSpec m;
  m.num_layers = 1, m.hidden_size = 32, m.num_attention_heads = 4, m.seq_length = 64, m.vocab_size = 256;
  m.num_experts = 4, m.moe_router_topk = 2, m.moe_ffn_hidden_size = 96;
  return m;
}

// fp32 on CPU with 4-byte hidden-dropout masks, flash attention and megatorch's extras (the
// LayerNorm statistics): how that test's real layer runs.
inline megatorch::plan::ActivationOptions cpu_fp32_activations() {
  megatorch::plan::ActivationOptions cpu;
  cpu.activation_bytes = cpu.mask_bytes = 4;
  cpu.megatorch_extras = cpu.flash_attention = true;
  return cpu;
}

}  // namespace plan_test
