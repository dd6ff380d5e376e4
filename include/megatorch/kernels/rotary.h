#pragma once
// rotary_embedding: RoPE with the rotate-half convention. input [s, b, heads, d],
// freqs [s, 1, 1, r] (angles; r even, r <= d): the first r channels become
// x·cos + rotate_half(x)·sin, the other d - r pass through. cos and sin of the angles
// are taken once per (position, channel), in fp32. The freqs get no gradient (they are
// a function of positions, not learned). Operator: torch.ops.megatorch.rotary_embedding.
#include <ATen/Tensor.h>

namespace megatorch::kernels {

at::Tensor rotary_embedding(const at::Tensor& input, const at::Tensor& freqs);  // differentiable in input

at::Tensor rotary_embedding_forward(const at::Tensor& input, const at::Tensor& freqs);
// The transposed rotation of grad: the gradient of the input.
at::Tensor rotary_embedding_backward(const at::Tensor& grad, const at::Tensor& freqs);

}  // namespace megatorch::kernels
