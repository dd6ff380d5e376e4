#pragma once
// A process group that only knows its rank and size, registered by name for as long as
// it lives: layers built on it see rank r of a TP group of n in one process, enough to
// check what they derive from their place in the group (shard shapes, layouts, flags).
// It runs no collective.
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <string>

namespace fake_tp {

class RankOnlyBackend : public c10d::Backend {
 public:
  RankOnlyBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "rank-only"; }
};

class Group {
 public:
  Group(std::string name, int rank, int size) : name_(std::move(name)) {
    pg_ = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), rank, size);
    pg_->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM,
                    c10::make_intrusive<RankOnlyBackend>(rank, size));
    pg_->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
    c10d::register_process_group(name_, pg_);
  }
  ~Group() { c10d::unregister_process_group(name_); }
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
};

}  // namespace fake_tp
