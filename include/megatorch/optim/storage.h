#pragma once
// Freeing and re-allocating a tensor's storage in place (ZeRO-3, as FSDP does): views of
// the storage -- the parameters, and tensors autograd saved for backward -- stay valid
// and see the new bytes once the storage is filled again.
#include <ATen/Tensor.h>

namespace megatorch::optim {

// Gives `t`'s storage `bytes` bytes (0 frees it); the contents are undefined afterwards.
void resize_storage(const at::Tensor& t, int64_t bytes);
int64_t storage_bytes(const at::Tensor& t);

}  // namespace megatorch::optim
