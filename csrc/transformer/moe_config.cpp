// TransformerConfig's mixture-of-experts constraints and names (moe/moe_layer.h).
#include <cmath>

#include "megatorch/check.h"
#include "megatorch/transformer/config.h"
#include "megatorch/util/enum_names.h"

namespace megatorch::transformer {

void TransformerConfig::validate_moe(int64_t tp, int64_t ep, int64_t etp) const {
  MEGATORCH_CHECK(ep >= 1 && etp >= 1, "expected expert-parallel and expert-tensor-parallel sizes >= 1 to validate ",
                  "against, got ", ep, " and ", etp);
  MEGATORCH_CHECK(num_experts_ >= 0, "expected --num-experts >= 0 (0: a dense model), got ", num_experts_);
  if (num_experts_ == 0) {
    MEGATORCH_CHECK(ep == 1 && etp == 1, "expected --expert-model-parallel-size and --expert-tensor-parallel-size 1 ",
                    "for a dense model, got ", ep, " and ", etp, "; set --num-experts to train a mixture of experts");
    return;
  }
  MEGATORCH_CHECK(moe_router_topk_ >= 1 && moe_router_topk_ <= num_experts_, "expected --moe-router-topk in [1, ",
                  num_experts_, "] (--num-experts), got ", moe_router_topk_);
  MEGATORCH_CHECK(moe_ffn_hidden_size_ >= 0, "expected --moe-ffn-hidden-size >= 0 (0: --ffn-hidden-size), got ",
                  moe_ffn_hidden_size_);
  MEGATORCH_CHECK(moe_layer_freq_ >= 1, "expected --moe-layer-freq >= 1 (every N-th layer is an MoE layer), got ",
                  moe_layer_freq_);
  MEGATORCH_CHECK(moe_first_k_dense_ >= 0, "expected --moe-first-k-dense >= 0, got ", moe_first_k_dense_);
  MEGATORCH_CHECK(moe_shared_expert_intermediate_size_ >= 0,
                  "expected --moe-shared-expert-intermediate-size >= 0 (0: no shared expert), got ",
                  moe_shared_expert_intermediate_size_);
  MEGATORCH_CHECK(moe_shared_expert_intermediate_size_ % tp == 0, "expected --moe-shared-expert-intermediate-size (",
                  moe_shared_expert_intermediate_size_, ") to be divisible by the tensor-parallel size (", tp,
                  "): the shared expert is a tensor-parallel MLP");
  MEGATORCH_CHECK(std::isfinite(moe_router_topk_scaling_factor_) && moe_router_topk_scaling_factor_ > 0,
                  "expected a finite --moe-router-topk-scaling-factor > 0, got ", moe_router_topk_scaling_factor_);
  MEGATORCH_CHECK(std::isfinite(moe_aux_loss_coeff_) && moe_aux_loss_coeff_ >= 0 && std::isfinite(moe_z_loss_coeff_) &&
                      moe_z_loss_coeff_ >= 0,
                  "expected finite --moe-aux-loss-coeff and --moe-z-loss-coeff >= 0, got ", moe_aux_loss_coeff_,
                  " and ", moe_z_loss_coeff_);
  MEGATORCH_CHECK(std::isfinite(moe_router_bias_update_rate_) && moe_router_bias_update_rate_ >= 0,
                  "expected a finite --moe-router-bias-update-rate >= 0, got ", moe_router_bias_update_rate_);
  MEGATORCH_CHECK(std::isfinite(moe_expert_capacity_factor_),
                  "expected a finite --moe-expert-capacity-factor (<= 0: dropless), got ", moe_expert_capacity_factor_);
  MEGATORCH_CHECK(!moe_pad_expert_input_to_capacity_ || moe_expert_capacity_factor_ > 0,
                  "--moe-pad-expert-input-to-capacity needs a capacity: set --moe-expert-capacity-factor > 0");
  MEGATORCH_CHECK(num_experts_ % ep == 0, "expected --num-experts (", num_experts_,
                  ") to be divisible by --expert-model-parallel-size (", ep, "): each expert-parallel rank holds ",
                  "num_experts / ep whole experts");
  MEGATORCH_CHECK(moe_ffn() % etp == 0, "expected the experts' FFN size (--moe-ffn-hidden-size, else --ffn-hidden-size: ",
                  moe_ffn(), ") to be divisible by --expert-tensor-parallel-size (", etp, "): each expert-tensor-",
                  "parallel rank holds F / etp of every local expert's columns");
}

const char* to_string(RouterScore s) { return s == RouterScore::kSoftmax ? "softmax" : "sigmoid"; }
const char* to_string(TokenDispatcher d) { return d == TokenDispatcher::kAllToAll ? "alltoall" : "allgather"; }

RouterScore parse_router_score(const std::string& s) {
  return util::parse_enum(s, {RouterScore::kSoftmax, RouterScore::kSigmoid}, "--moe-router-score-function");
}
TokenDispatcher parse_token_dispatcher(const std::string& s) {
  return util::parse_enum(s, {TokenDispatcher::kAllToAll, TokenDispatcher::kAllGather}, "--moe-token-dispatcher-type");
}

}  // namespace megatorch::transformer
