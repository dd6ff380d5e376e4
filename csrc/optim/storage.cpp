#include "megatorch/optim/storage.h"

#include <c10/core/StorageImpl.h>

#include "megatorch/check.h"

namespace megatorch::optim {

void resize_storage(const at::Tensor& t, int64_t bytes) {
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  if (static_cast<int64_t>(impl->nbytes()) == bytes) return;
  MEGATORCH_CHECK(impl->resizable() && impl->allocator() != nullptr,
                  "resize_storage: expected a resizable storage made by an allocator (a tensor from at::empty), got one "
                  "that is not (from_blob or a fixed view)");
  // No copy: the caller refills it (all-gather) before any read.
  impl->set_data_ptr_noswap(bytes == 0 ? at::DataPtr(nullptr, impl->device()) : impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

int64_t storage_bytes(const at::Tensor& t) { return static_cast<int64_t>(t.storage().nbytes()); }

}  // namespace megatorch::optim
