// Context-parallel attention (context_parallel.h) against SDPA on the whole sequence:
// every rank builds the same full q, k, v, takes its part with context_parallel_slice and
// checks its slice of the output and of the gradients; plus the layout, the refusals,
// the work counters and the exact bytes on the CP group. With attention dropout the
// reference applies the keyed mask (attention_dropout.h) to the whole sequence's softmax.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include <cmath>
#include <sstream>
#include <string>

#include "mp_util.h"
#include "tolerance.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::parallel::GroupKind;
using megatorch::transformer::context_parallel_attention;
using megatorch::transformer::context_parallel_counters;
using megatorch::transformer::context_parallel_positions;
using megatorch::transformer::context_parallel_slice;
using megatorch::transformer::ContextParallelAttentionOptions;
using megatorch::transformer::CpCommType;
using megatorch::transformer::reset_context_parallel_counters;
namespace transformer = megatorch::transformer;

namespace {

constexpr int64_t kBatch = 2, kSeq = 48, kHeadDim = 8;  // 48: 2c divides it for c = 1..4

struct Case {
  int64_t heads, groups;
  bool causal;
  CpCommType comm;
  bool sdpa;
  double dropout = 0.0;
  int64_t head_offset = 0;  // q's first head's global index: the dropout mask's head key
  bool documents = false;   // packed documents (kDocuments) whose boundaries cross the chunks
  int64_t window = 0;       // sliding window (0: none)
  std::string describe(int64_t c) const {
    std::ostringstream s;
    s << megatorch::transformer::to_string(comm) << " c=" << c << " heads=" << heads << " groups=" << groups
      << (causal ? " causal" : " bidirectional") << (sdpa ? " sdpa" : " math") << " dropout=" << dropout
      << " head_offset=" << head_offset << " documents=" << documents << " window=" << window;
    return s.str();
  }
};

// Each row's documents, [kBatch, kSeq]: lengths 5, 20, 1, 22 and 30, 18, so that documents
// start and end inside the CP chunks and one holds a single token.
at::Tensor document_ids() {
  std::vector<at::Tensor> rows;
  for (const auto& lengths : std::vector<std::vector<int64_t>>{{5, 20, 1, 22}, {30, 18}}) {
    std::vector<at::Tensor> parts;
    for (size_t d = 0; d < lengths.size(); ++d) parts.push_back(torch::full({lengths[d]}, int64_t(d), torch::kLong));
    rows.push_back(torch::cat(parts));
  }
  return torch::stack(rows);
}

const at::Tensor kDropoutKey = torch::tensor(int64_t{0x5eed1234abcdLL});

// The same full tensors on every rank: q, k, v and the upstream gradient, fp32.
struct Full {
  at::Tensor q, k, v, grad;
};

Full make_full(int64_t heads, int64_t groups, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({kBatch, heads, kSeq, kHeadDim}), torch::randn({kBatch, groups, kSeq, kHeadDim}),
          torch::randn({kBatch, groups, kSeq, kHeadDim}), torch::randn({kBatch, heads, kSeq, kHeadDim})};
}

ContextParallelAttentionOptions options(const std::string& group, const Case& c) {
  auto o = ContextParallelAttentionOptions(group).comm_type(c.comm).causal(c.causal).use_sdpa(c.sdpa).window(c.window);
  if (c.dropout > 0) o.dropout(c.dropout).dropout_key(kDropoutKey).head_offset(c.head_offset);
  if (c.documents) {
    const at::Tensor ids = document_ids();
    o.documents(std::make_shared<const transformer::PackedDocuments>(
        transformer::PackedDocuments{ids, transformer::document_runs(ids)}));
  }
  return o;
}

// The pairs key j, query i may attend on the whole sequence, [b or 1, 1, S, S], written out:
// causal, within the window, within the document.
at::Tensor reference_mask(const Case& c) {
  const at::Tensor i = torch::arange(kSeq, torch::kLong).unsqueeze(1), j = torch::arange(kSeq, torch::kLong);
  at::Tensor allowed = torch::ones({kSeq, kSeq}, torch::kBool);
  if (c.causal) allowed = allowed & (j <= i);
  if (c.window > 0) allowed = allowed & (i - j < c.window);
  allowed = allowed.unsqueeze(0);
  if (c.documents) {
    const at::Tensor ids = document_ids();
    allowed = allowed & (ids.unsqueeze(2) == ids.unsqueeze(1));
  }
  return allowed.unsqueeze(1);
}

// Attention on the whole sequence: SDPA, or with dropout softmax · keep / (1 - p) written out.
at::Tensor reference_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Case& c) {
  const bool masked = c.documents || c.window > 0;
  if (c.dropout == 0) {
    return at::scaled_dot_product_attention(q, k, v, masked ? c10::optional<at::Tensor>(reference_mask(c)) : std::nullopt,
                                            0.0, c.causal && !masked, std::nullopt, /*enable_gqa=*/c.groups < c.heads);
  }
  const at::Tensor ke = k.repeat_interleave(c.heads / c.groups, 1), ve = v.repeat_interleave(c.heads / c.groups, 1);
  at::Tensor scores = at::matmul(q, ke.transpose(-2, -1)) / std::sqrt(static_cast<double>(kHeadDim));
  scores = scores.masked_fill(reference_mask(c).logical_not(), -INFINITY);
  const at::Tensor positions = torch::arange(kSeq, torch::kLong);
  const at::Tensor keep = transformer::attention_dropout_keep(
      kDropoutKey, kBatch, torch::arange(c.head_offset, c.head_offset + c.heads, torch::kLong), positions, positions,
      c.dropout);
  return at::matmul(at::softmax(scores, -1) * keep / (1 - c.dropout), ve);
}

// This rank's slice of the output and of dq, dk, dv against SDPA on the whole sequence.
void check_parity(const std::string& group, const Case& c, torch::Dtype dtype = torch::kFloat,
                  double rtol = tolerance::kRtol) {
  const Group g(group);
  const int64_t cp = g.size(), r = g.rank();
  INFO(c.describe(cp) << " " << c10::toString(dtype));
  const Full f = make_full(c.heads, c.groups, 1234 + c.heads * 10 + c.groups);
  auto q = f.q.clone().requires_grad_(), k = f.k.clone().requires_grad_(), v = f.v.clone().requires_grad_();
  at::Tensor ref = reference_attention(q, k, v, c);
  ref.backward(f.grad);
  auto mine = [&](const at::Tensor& x) { return context_parallel_slice(x, 2, cp, r); };
  // Fresh leaves (a group of one rank slices nothing).
  auto lq = mine(f.q).to(dtype).clone().requires_grad_(), lk = mine(f.k).to(dtype).clone().requires_grad_(),
       lv = mine(f.v).to(dtype).clone().requires_grad_();
  at::Tensor out = context_parallel_attention(lq, lk, lv, options(group, c));
  REQUIRE(out.sizes() == lq.sizes());
  CHECK(out.scalar_type() == dtype);
  out.backward(mine(f.grad).to(dtype));
  CHECK_CLOSE(out, mine(ref), rtol);
  CHECK_CLOSE(lq.grad(), mine(q.grad()), rtol);
  CHECK_CLOSE(lk.grad(), mine(k.grad()), rtol);
  CHECK_CLOSE(lv.grad(), mine(v.grad()), rtol);
}

// (2c-1)L^2 + L(L+1): what each CP rank computes per sample and head under the causal split.
int64_t causal_pairs(int64_t c) {
  const int64_t l = kSeq / (2 * c);
  return (2 * c - 1) * l * l + l * (l + 1);
}

}  // namespace

TEST_CASE("context-parallel layout: positions, slices and comm type names", "[mp][context_parallel]") {
  CHECK(torch::equal(context_parallel_positions(8, 2, 0), torch::tensor({0, 1, 6, 7}, torch::kLong)));
  CHECK(torch::equal(context_parallel_positions(8, 2, 1), torch::tensor({2, 3, 4, 5}, torch::kLong)));
  CHECK(torch::equal(context_parallel_positions(7, 1, 0), torch::arange(7, torch::kLong)));
  for (int64_t c : {2, 3, 4}) {
    std::vector<at::Tensor> all;
    for (int64_t r = 0; r < c; ++r) {
      const at::Tensor p = context_parallel_positions(24, c, r);
      CHECK(p.size(0) == 24 / c);
      CHECK((p.slice(0, 1) > p.slice(0, 0, -1)).all().item<bool>());  // increasing: causal is lower-triangular
      const at::Tensor x = torch::arange(24, torch::kLong).view({1, 24}).expand({3, 24});
      CHECK(torch::equal(context_parallel_slice(x, 1, c, r), x.index_select(1, p)));
      CHECK(torch::equal(context_parallel_slice(x, -1, c, r), x.index_select(1, p)));
      all.push_back(p);
    }
    CHECK(torch::equal(std::get<0>(torch::cat(all).sort()), torch::arange(24, torch::kLong)));  // a permutation
  }
  const at::Tensor x = torch::zeros({2, 10});
  CHECK(context_parallel_slice(x, 1, 1, 0).is_same(x));
  CHECK_THROWS_WITH(context_parallel_slice(x, 1, 2, 0),
                    Catch::Contains("expected the sequence length (10) to be divisible by 2 x the context-parallel "
                                    "size (2 x 2 = 4)") &&
                        Catch::Contains("--context-parallel-size"));
  CHECK_THROWS_WITH(context_parallel_positions(12, 2, 2), Catch::Contains("expected a CP rank in [0, 2), got 2"));
  CHECK_THROWS_WITH(context_parallel_slice(x, 2, 1, 0), Catch::Contains("expected dim in [-2, 2)"));
  CHECK(megatorch::transformer::parse_cp_comm_type("p2p") == CpCommType::kP2P);
  CHECK(megatorch::transformer::parse_cp_comm_type("a2a") == CpCommType::kA2A);
  CHECK(std::string(megatorch::transformer::to_string(CpCommType::kA2A)) == "a2a");
  CHECK_THROWS_WITH(megatorch::transformer::parse_cp_comm_type("ring"),
                    Catch::Contains("'p2p'") && Catch::Contains("'a2a'") && Catch::Contains("got 'ring'"));
}

TEST_CASE("ring attention matches SDPA on the whole sequence: outputs and gradients", "[mp][context_parallel]") {
  auto st = mp::state(1, 1, "cp_ring");
  const std::string world = st->group_name(GroupKind::kWorld);
  for (bool sdpa : {true, false})
    for (bool causal : {true, false})
      for (int64_t groups : {4, 2, 1}) check_parity(world, {4, groups, causal, CpCommType::kP2P, sdpa});
  // A group of one rank: plain attention, no communication.
  const std::string alone = st->group_name(GroupKind::kPipeline);
  REQUIRE(Group(alone).size() == 1);
  check_parity(alone, {4, 2, true, CpCommType::kP2P, true});
  check_parity(alone, {4, 2, true, CpCommType::kA2A, false});
}

TEST_CASE("ring attention on CP groups that are part of the world", "[mp][context_parallel]") {
  if (mp::world_size() % 2 != 0) return;
  auto st = mp::state(2, 1, "cp_sub");  // the two-rank TP groups serve as CP groups
  const std::string group = st->group_name(GroupKind::kTensor);
  REQUIRE(Group(group).size() == 2);
  for (bool sdpa : {true, false}) check_parity(group, {4, 2, true, CpCommType::kP2P, sdpa});
  check_parity(group, {4, 2, true, CpCommType::kA2A, true});
}

TEST_CASE("Ulysses attention matches SDPA on the whole sequence, and refuses heads it cannot split",
          "[mp][context_parallel]") {
  auto st = mp::state(1, 1, "cp_a2a");
  const std::string world = st->group_name(GroupKind::kWorld);
  const int64_t c = mp::world_size();
  if (c < 2) return;  // one rank: nothing to split, nothing to refuse
  for (bool causal : {true, false}) {
    check_parity(world, {2 * c, 2 * c, causal, CpCommType::kA2A, true});  // MHA
    check_parity(world, {2 * c, c, causal, CpCommType::kA2A, true});      // GQA: groups divisible by c
  }
  const Full f = make_full(c + 1, c + 1, 7);
  const Case bad{c + 1, c + 1, true, CpCommType::kA2A, true};
  auto mine = [&](const at::Tensor& x) { return context_parallel_slice(x, 2, c, mp::rank()); };
  CHECK_THROWS_WITH(context_parallel_attention(mine(f.q), mine(f.k), mine(f.v), options(world, bad)),
                    Catch::Contains("Ulysses (--cp-comm-type a2a)") &&
                        Catch::Contains("--context-parallel-size " + std::to_string(c)) &&
                        Catch::Contains("got " + std::to_string(c + 1) + " heads") &&
                        Catch::Contains("use --cp-comm-type p2p"));
  // The ring takes any head count, but GQA needs whole groups.
  check_parity(world, {c + 1, c + 1, true, CpCommType::kP2P, true});
  const Full g3 = make_full(4, 3, 8);
  const ContextParallelAttentionOptions ring(world);
  CHECK_THROWS_WITH(context_parallel_attention(mine(g3.q), mine(g3.k), mine(g3.v), ring),
                    Catch::Contains("expected the query heads (4) to be a multiple of the key/value heads (3)"));
}

TEST_CASE("context-parallel attention with dropout drops the keyed mask's pairs, at every c and comm type",
          "[mp][context_parallel]") {
  auto st = mp::state(1, 1, "cp_dropout");
  const std::string world = st->group_name(GroupKind::kWorld);
  const int64_t c = mp::world_size();
  for (bool causal : {true, false}) {
    for (int64_t groups : {4, 2}) check_parity(world, {4, groups, causal, CpCommType::kP2P, true, 0.3, 5});
    check_parity(world, {2 * c, c, causal, CpCommType::kA2A, true, 0.3, 5});
  }
  const std::string alone = st->group_name(GroupKind::kPipeline);  // c = 1: the same mask
  check_parity(alone, {4, 2, true, CpCommType::kP2P, true, 0.3, 0});
  if (c % 2 == 0) {  // CP groups inside the world, as TP x CP layouts make them
    auto sub = mp::state(2, 1, "cp_dropout_sub");
    check_parity(sub->group_name(GroupKind::kTensor), {4, 2, true, CpCommType::kP2P, false, 0.5, 4});
  }
  // The mask is not optional.
  const Full f = make_full(4, 4, 9);
  auto mine = [&](const at::Tensor& x) { return context_parallel_slice(x, 2, c, mp::rank()); };
  CHECK_THROWS_WITH(
      context_parallel_attention(mine(f.q), mine(f.k), mine(f.v), ContextParallelAttentionOptions(world).dropout(0.1)),
      Catch::Contains("needs a one-element int64 dropout_key") && Catch::Contains("draw_attention_dropout_key"));
  CHECK_THROWS_WITH(
      context_parallel_attention(mine(f.q), mine(f.k), mine(f.v), ContextParallelAttentionOptions(world).dropout(1.0)),
      Catch::Contains("expected a dropout probability in [0, 1), got 1"));
}

TEST_CASE("context-parallel attention inside packed documents and sliding windows, at every c and comm type",
          "[mp][context_parallel]") {
  auto st = mp::state(1, 1, "cp_documents");
  const std::string world = st->group_name(GroupKind::kWorld);
  const int64_t c = mp::world_size();
  for (bool documents : {true, false}) {
    for (int64_t window : {0, 7}) {
      if (!documents && window == 0) continue;  // the plain cases above
      for (int64_t groups : {4, 2}) check_parity(world, {4, groups, true, CpCommType::kP2P, true, 0.0, 0, documents, window});
      check_parity(world, {2 * c, c, true, CpCommType::kA2A, true, 0.0, 0, documents, window});
      // With attention dropout: the keyed mask inside the documents.
      check_parity(world, {4, 2, true, CpCommType::kP2P, true, 0.3, 5, documents, window});
      check_parity(world, {2 * c, c, true, CpCommType::kA2A, true, 0.3, 5, documents, window});
    }
  }
  check_parity(st->group_name(GroupKind::kPipeline), {4, 2, true, CpCommType::kP2P, true, 0.0, 0, true, 7});
}

TEST_CASE("bf16 context-parallel attention on CPU", "[mp][context_parallel]") {
  auto st = mp::state(1, 1, "cp_bf16");
  const std::string world = st->group_name(GroupKind::kWorld);
  for (bool sdpa : {true, false}) check_parity(world, {4, 2, true, CpCommType::kP2P, sdpa}, torch::kBFloat16, 2e-2);
  const int64_t c = mp::world_size();  // Ulysses needs heads divisible by c
  check_parity(world, {2 * c, 2 * c, true, CpCommType::kA2A, true}, torch::kBFloat16, 2e-2);
}

TEST_CASE("context-parallel work counters and exact bytes on the CP group", "[mp][context_parallel]") {
  auto st = mp::state(1, 1, "cp_bytes");
  Group g(*st, GroupKind::kWorld);
  const int64_t c = g.size(), l = kSeq / (2 * c);
  if (c < 2) return;  // one rank sends nothing
  const Full f = make_full(4, 2, 99);  // GQA: only the 2 key/value heads travel
  auto mine = [&](const at::Tensor& x) { return context_parallel_slice(x, 2, c, g.rank()); };
  const int64_t kv_bytes = 2 * static_cast<int64_t>(mine(f.k).nbytes());  // local K + V

  for (bool sdpa : {true, false}) {
    INFO("p2p " << (sdpa ? "sdpa" : "math"));
    auto q = mine(f.q).requires_grad_(), k = mine(f.k).requires_grad_(), v = mine(f.v).requires_grad_();
    g.reset_stats();
    reset_context_parallel_counters();
    at::Tensor out = context_parallel_attention(q, k, v, ContextParallelAttentionOptions(g.name()).use_sdpa(sdpa));
    auto s = g.stats();
    CHECK(s[CommOp::kSend].calls == c - 1);
    CHECK(s[CommOp::kSend].bytes == (c - 1) * kv_bytes);
    CHECK(s[CommOp::kRecv].calls == c - 1);
    CHECK(s[CommOp::kRecv].bytes == (c - 1) * kv_bytes);
    CHECK(s.total().bytes == 2 * (c - 1) * kv_bytes);
    const auto counters = context_parallel_counters();
    CHECK(counters.attention_calls == 1);
    CHECK(counters.unmasked_pairs == causal_pairs(c));
    CHECK(counters.unmasked_pairs == (2 * c - 1) * l * l + l * (l + 1));
    out.backward(mine(f.grad));
    // Backward: K, V again (c-1 hops) and the dK, dV buffers (c-1 hops, same size and dtype).
    s = g.stats();
    CHECK(s[CommOp::kSend].calls == 3 * (c - 1));
    CHECK(s[CommOp::kSend].bytes == (c - 1) * kv_bytes + (c - 1) * kv_bytes + (c - 1) * kv_bytes);  // fwd KV, KV, dKV
    CHECK(s[CommOp::kRecv].calls == 3 * (c - 1));
    CHECK(s[CommOp::kRecv].bytes == 3 * (c - 1) * kv_bytes);
    CHECK(s.total().bytes == 6 * (c - 1) * kv_bytes);
    CHECK(context_parallel_counters().attention_calls == 1);  // forward calls only
    // Every rank did the same work.
    const at::Tensor pairs = g.all_gather(torch::tensor({counters.unmasked_pairs}, torch::kLong));
    CHECK((pairs == causal_pairs(c)).all().item<bool>());
  }
  {
    INFO("p2p bidirectional");
    g.reset_stats();
    reset_context_parallel_counters();
    const auto bidirectional = ContextParallelAttentionOptions(g.name()).causal(false);
    context_parallel_attention(mine(f.q), mine(f.k), mine(f.v), bidirectional);
    CHECK(context_parallel_counters().unmasked_pairs == 2 * l * kSeq);  // 2L queries x S keys
    CHECK(g.stats()[CommOp::kSend].bytes == (c - 1) * kv_bytes);
  }
  {
    INFO("a2a");
    const Full m = make_full(2 * c, c, 98);  // GQA with heads and groups divisible by c
    auto q = mine(m.q).requires_grad_(), k = mine(m.k).requires_grad_(), v = mine(m.v).requires_grad_();
    g.reset_stats();
    reset_context_parallel_counters();
    at::Tensor out =
        context_parallel_attention(q, k, v, ContextParallelAttentionOptions(g.name()).comm_type(CpCommType::kA2A));
    // q, k, v in and the output (q's size) out, each (c-1)/c of its bytes.
    const int64_t moved = static_cast<int64_t>(2 * q.nbytes() + k.nbytes() + v.nbytes()) / c * (c - 1);
    auto s = g.stats();
    CHECK(s[CommOp::kAllToAll].calls == 4);
    CHECK(s[CommOp::kAllToAll].bytes == moved);
    CHECK(s.total().bytes == moved);
    CHECK(context_parallel_counters().unmasked_pairs == causal_pairs(c));  // the same work as the ring
    CHECK(context_parallel_counters().attention_calls == 1);
    out.backward(mine(m.grad));
    s = g.stats();
    CHECK(s[CommOp::kAllToAll].calls == 8);
    CHECK(s[CommOp::kAllToAll].bytes == 2 * moved);
    CHECK(s.total().bytes == 2 * moved);
  }
}
