// comm::Group(name) resolves through a per-thread cache (csrc/comm/group_cache.h): a name
// registered again must reach the new group, a destroyed group must not be kept alive,
// and the counters and sequence numbers stay exact per name across handles and threads.
// A fake c10d backend (it only counts, or fails every wait) gives groups of any size in
// one process.
#include <catch2/catch.hpp>
#include <megatorch/megatorch.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include <atomic>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

using megatorch::comm::CommOp;
using megatorch::comm::Group;
namespace comm = megatorch::comm;

namespace {

class FakeWork : public c10d::Work {
 public:
  explicit FakeWork(bool fail) : fail_(fail) {}
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override {
    if (fail_) throw std::runtime_error("fake backend: the peer is gone");
    return true;
  }

 private:
  bool fail_;
};

// Counts the all-reduces it is given and leaves the tensors as they are.
class FakeBackend : public c10d::Backend {
 public:
  FakeBackend(int rank, int size) : Backend(rank, size) {}
  const std::string getBackendName() const override { return "fake"; }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    allreduces.fetch_add(1);
    return c10::make_intrusive<FakeWork>(fail.load());
  }
  std::atomic<int> allreduces{0};
  std::atomic<bool> fail{false};
};

struct FakeGroup {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<FakeBackend> backend;
};

// Rank 0 of a group of `size`, registered under `name` unless `name` is empty.
FakeGroup fake_group(int size, const std::string& name = "") {
  FakeGroup g;
  g.pg = c10::make_intrusive<c10d::ProcessGroup>(c10::make_intrusive<c10d::HashStore>(), 0, size);
  g.backend = c10::make_intrusive<FakeBackend>(0, size);
  g.pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, g.backend);
  g.pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
  if (!name.empty()) c10d::register_process_group(name, g.pg);
  return g;
}

}  // namespace

TEST_CASE("a group name registered again resolves to the new group", "[comm_cache]") {
  const std::string name = "cache_again";
  comm::reset_comm_stats(name);
  FakeGroup first = fake_group(2, name);
  auto x = torch::ones({3});
  Group(name).all_reduce(x);
  CHECK(Group(name).size() == 2);
  CHECK(first.backend->allreduces == 1);

  // The first group stays alive (held here), so only the registry tells them apart.
  c10d::unregister_process_group(name);
  CHECK_THROWS_WITH(Group(name), Catch::Contains("expected a process group registered under the name 'cache_again'"));
  FakeGroup second = fake_group(4, name);
  Group g(name);
  CHECK(g.process_group().get() == second.pg.get());
  CHECK(g.size() == 4);
  g.all_reduce(x);
  Group(name).all_reduce(x);
  CHECK(first.backend->allreduces == 1);
  CHECK(second.backend->allreduces == 2);
  // Counters are per name: the new group counts on from the old one's.
  CHECK(comm::comm_stats(name)[CommOp::kAllReduce].calls == 3);
  CHECK(comm::comm_stats(name)[CommOp::kAllReduce].bytes == 3 * 3 * 4);
  c10d::unregister_process_group(name);
}

TEST_CASE("the cache keeps no destroyed group alive", "[comm_cache]") {
  const std::string name = "cache_released";
  std::optional<c10::weak_intrusive_ptr<c10d::ProcessGroup>> watch;
  {
    FakeGroup g = fake_group(2, name);
    watch.emplace(g.pg);
    auto x = torch::ones({2});
    Group(name).all_reduce(x);  // cached now
    c10d::unregister_process_group(name);
  }
  CHECK(watch->expired());  // no strong reference left anywhere: its backends are released
}

TEST_CASE("sequence numbers in errors and counters stay exact across threads", "[comm_cache]") {
  const std::string name = "cache_threads";
  comm::reset_comm_stats(name);
  FakeGroup g = fake_group(2, name);
  constexpr int kThreads = 4, kEach = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      auto x = torch::ones({5}, torch::kDouble);
      for (int i = 0; i < kEach; ++i) Group(name).all_reduce(x);  // a Group per call, a cache per thread
    });
  }
  for (auto& t : threads) t.join();
  const auto stats = comm::comm_stats(name);
  CHECK(stats[CommOp::kAllReduce].calls == kThreads * kEach);
  CHECK(stats[CommOp::kAllReduce].bytes == kThreads * kEach * 5 * 8);
  CHECK(g.backend->allreduces == kThreads * kEach);

  // Failed waits name the operation's sequence number: the next ones after all the above.
  g.backend->fail = true;
  auto x = torch::ones({5});
  const std::string where = " on group 'cache_threads' (rank 0 of 2, backend fake";
  CHECK_THROWS_WITH(Group(name).all_reduce(x),
                    Catch::Contains("collective all_reduce #" + std::to_string(kThreads * kEach) + where) &&
                        Catch::Contains("the peer is gone"));
  CHECK_THROWS_WITH(Group(name).all_reduce(x),
                    Catch::Contains("collective all_reduce #" + std::to_string(kThreads * kEach + 1) + where));
  // A reset zeroes the counters, not the sequence.
  comm::reset_comm_stats(name);
  CHECK(comm::comm_stats(name).total().calls == 0);
  CHECK_THROWS_WITH(Group(name).all_reduce(x),
                    Catch::Contains("collective all_reduce #" + std::to_string(kThreads * kEach + 2) + where));
  CHECK(comm::comm_stats(name)[CommOp::kAllReduce].calls == 1);
  c10d::unregister_process_group(name);
}

TEST_CASE("record_comm gives every operation of a group its own sequence number", "[comm_cache]") {
  namespace detail = comm::detail;
  comm::reset_comm_stats("cache_seq");
  detail::CounterSlot* slot = detail::counter_slot("cache_seq");
  CHECK(slot == detail::counter_slot("cache_seq"));  // one slot per name
  CHECK(slot != detail::counter_slot("cache_seq_other"));
  const int64_t first = detail::record_comm(*slot, CommOp::kBarrier, 0);
  constexpr int kThreads = 4, kEach = 1000;
  std::vector<std::vector<int64_t>> seen(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kEach; ++i) seen[t].push_back(detail::record_comm(*slot, CommOp::kSend, 2));
    });
  }
  for (auto& t : threads) t.join();
  std::set<int64_t> all;
  for (const auto& s : seen) all.insert(s.begin(), s.end());
  CHECK(all.size() == static_cast<size_t>(kThreads * kEach));
  CHECK(*all.begin() == first + 1);
  CHECK(*all.rbegin() == first + kThreads * kEach);
  CHECK(comm::comm_stats("cache_seq")[CommOp::kSend].calls == kThreads * kEach);
  CHECK(comm::comm_stats("cache_seq")[CommOp::kSend].bytes == 2 * kThreads * kEach);
  CHECK(comm::comm_stats("cache_seq")[CommOp::kBarrier].calls == 1);
}

TEST_CASE("every operation and mapping of the enums has a name and every mapping an operator", "[comm_cache]") {
  CHECK(comm::CommStats{}.to_map().size() == 2 * comm::kNumCommOps + 2);
  for (int i = 0; i < comm::kNumCommOps; ++i) CHECK(std::string(comm::comm_op_name(static_cast<CommOp>(i))) != "?");
  for (int i = 0; i < comm::kNumMappings; ++i) {
    CHECK(std::string(comm::mapping_name(static_cast<comm::Mapping>(i))) != "?");
    // Every mapping is registered as an operator.
    CHECK(c10::Dispatcher::singleton().findSchema(
        {std::string("megatorch::") + comm::mapping_name(static_cast<comm::Mapping>(i)), ""}).has_value());
  }
}
