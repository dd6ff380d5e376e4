#include "megatorch/transformer/attention_mask.h"

#include "megatorch/check.h"

namespace megatorch::transformer {

at::Tensor causal_window_mask(const at::Tensor& q_positions, const at::Tensor& k_positions, int64_t window) {
  MEGATORCH_CHECK(q_positions.dim() == 1 && k_positions.dim() == 1 && window >= 0,
                  "causal_window_mask: expected 1-d query and key positions and a window >= 0 (0: none), got ",
                  q_positions.sizes(), ", ", k_positions.sizes(), " and ", window);
  const at::Tensor distance = q_positions.unsqueeze(1) - k_positions.unsqueeze(0);  // [sq, sk]
  const at::Tensor visible = distance >= 0;
  return window > 0 ? visible.logical_and(distance < window) : visible;
}

at::Tensor visible_keys(const at::Tensor& q_positions, const at::Tensor& k_positions, bool causal, int64_t window,
                        const at::Tensor& documents) {
  const at::Tensor qp = q_positions.to(at::kLong), kp = k_positions.to(at::kLong);
  at::Tensor visible = causal ? causal_window_mask(qp, kp, window).unsqueeze(0)
                              : at::ones({1, qp.numel(), kp.numel()}, qp.options().dtype(at::kBool));
  if (!documents.defined()) return visible;
  MEGATORCH_CHECK(documents.dim() == 2, "visible_keys: expected document ids [b, S], got ", documents.sizes());
  const at::Tensor dq = documents.index_select(1, qp), dk = documents.index_select(1, kp);
  return visible.logical_and(dq.unsqueeze(2) == dk.unsqueeze(1));
}

}  // namespace megatorch::transformer
