// Expert parallelism: an MoE layer and a whole GPT at EP sizes > 1 and expert-TP 2 (alone,
// over DP, folded onto TP with SP, inside pipeline stages) give the outputs, loss and every
// gradient of one rank holding every expert (1e-5, fp32), with both token dispatchers; the
// dispatch moves exactly the routed rows (all-to-all) or every token (all-gather), ETP
// each rank's rows etp - 1 times each way.
#include <catch2/catch.hpp>
#include <torch/torch.h>

#include "gpt_test_util.h"
#include "megatorch/moe/moe_layer.h"
#include "mp_util.h"
#include "tolerance.h"

using megatorch::comm::CommOp;
using megatorch::comm::Group;
using megatorch::models::GPTModel;
using megatorch::models::GPTModelOptions;
using megatorch::parallel::GroupKind;
using megatorch::parallel::ParallelState;
using megatorch::transformer::TokenDispatcher;
using megatorch::transformer::TransformerConfig;
namespace moe = megatorch::moe;
namespace pipeline = megatorch::pipeline;

namespace {

at::Tensor randn(std::vector<int64_t> shape, int64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen);
}

// Rows [ep_rank E/ep, (ep_rank + 1) E/ep) of a whole-model expert tensor.
at::Tensor local_experts(const at::Tensor& full, int64_t ep_rank, int64_t ep_size) {
  const int64_t n = full.size(0) / ep_size;
  return full.narrow(0, ep_rank * n, n);
}

// The part of a whole-model expert tensor (fc1_weight [E, h, F1], fc2_weight [E, F, h],
// fc1_bias [E, F1], fc2_bias [E, h]) on EP rank `ep_rank`, expert-TP rank `etp_rank`:
// the local experts, of those fc1's F1/etp columns (of gate and of up for SwiGLU, `glu`
// 2) and fc2's F/etp rows; fc2's bias whole.
at::Tensor expert_shard(const std::string& name, const at::Tensor& full, int64_t ep_rank, int64_t ep, int64_t etp_rank,
                        int64_t etp, int64_t glu) {
  const at::Tensor mine = local_experts(full, ep_rank, ep);
  const auto ends = [&name](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  const int64_t dim = ends("fc1_weight") ? 2 : ends("fc2_weight") || ends("fc1_bias") ? 1 : -1;
  if (dim < 0 || etp == 1) return mine;
  const int64_t parts = ends("fc2_weight") ? 1 : glu;
  std::vector<at::Tensor> pieces;
  for (const auto& block : mine.chunk(parts, dim)) pieces.push_back(block.chunk(etp, dim)[etp_rank]);
  return at::cat(pieces, dim);
}

const char* name_of(TokenDispatcher d) { return megatorch::transformer::to_string(d); }

// The layer and the one-rank reference on the same input [5, 2, 16] and output gradient
// (seeded by `seed` and this rank), forward and backward; `group`'s traffic of the layer's
// forward is kept apart.
struct LayerRun {
  at::Tensor x, out, want, grad, want_grad;  // grad: the input's
  megatorch::comm::CommStats forward;
};
LayerRun run_against_reference(moe::MoELayer& layer, moe::MoELayer& ref, Group& group, int64_t seed, int64_t rank) {
  LayerRun r;
  r.x = randn({5, 2, 16}, seed + rank);
  const at::Tensor g = randn({5, 2, 16}, seed + 50 + rank);
  auto xr = r.x.clone().requires_grad_(), xd = r.x.clone().requires_grad_();
  group.reset_stats();
  r.out = layer->forward(xd);
  r.forward = group.stats();
  r.want = ref->forward(xr);
  r.out.backward(g);
  r.want.backward(g);
  r.grad = xd.grad(), r.want_grad = xr.grad();
  return r;
}

// The input and router gradients equal the reference's, and each expert parameter's is its
// shard (expert_shard) of the reference's summed over every rank's tokens.
void check_gradients(moe::MoELayer& layer, moe::MoELayer& ref, const LayerRun& run, Group& world, int64_t ep_rank,
                     int64_t ep, int64_t etp_rank, int64_t etp, int64_t glu) {
  CHECK_CLOSE(run.grad, run.want_grad);
  CHECK_CLOSE(layer->router->weight.grad(), ref->router->weight.grad());
  CHECK_DETECTS_ERROR(layer->router->weight.grad(), ref->router->weight.grad());
  for (const auto& p : layer->experts->named_parameters()) {
    at::Tensor full = ref->experts->named_parameters()[p.key()].grad().clone();
    world.all_reduce(full);
    INFO(p.key());
    CHECK_CLOSE(p.value().grad(), expert_shard(p.key(), full, ep_rank, ep, etp_rank, etp, glu));
  }
}

}  // namespace

TEST_CASE("An MoE layer at EP = world equals one rank's; the dispatch moves exactly the routed rows", "[mp][moe]") {
  const int64_t world = mp::world_size();
  auto st = mp::state(1, 1, "moe_layer", 1, world);
  const std::string ep = st->group_name(GroupKind::kExpert);
  Group epg(ep), worldg(*st, GroupKind::kWorld);
  REQUIRE(epg.size() == world);
  for (TokenDispatcher type : {TokenDispatcher::kAllToAll, TokenDispatcher::kAllGather}) {
    for (double cf : {0.0, 0.75}) {
      INFO(name_of(type) << " capacity factor " << cf);
      const auto base = TransformerConfig()
                            .hidden_size(16)
                            .num_attention_heads(2)
                            .num_experts(2 * world)
                            .moe_router_topk(2)
                            .moe_ffn_hidden_size(12)
                            .moe_aux_loss_coeff(0.01)
                            .moe_z_loss_coeff(0.001)
                            .moe_expert_capacity_factor(cf)
                            .moe_token_dispatcher_type(type)
                            .init_std(0.3)
                            .seed(5);
      moe::MoELayer ref{moe::MoELayerOptions(base)};
      moe::MoELayer layer{moe::MoELayerOptions(TransformerConfig(base).expert_parallel_group(ep))};
      const int64_t h = 16, t = 10, e = base.num_experts(), local = e / world;
      const LayerRun run = run_against_reference(layer, ref, epg, 40, st->rank());
      const auto& forward_stats = run.forward;
      CHECK_CLOSE(run.out, run.want);
      // The rows each rank's experts process, from every rank's routing (the reference's).
      const auto routing = ref->router->forward(run.x.reshape({t, h}));
      const at::Tensor rows = worldg.all_gather(routing.selection.sum(1), 0).reshape({world, e});  // [src, expert]
      const int64_t me = st->rank();
      const int64_t sent = rows[me].sum().item<int64_t>() - rows[me].narrow(0, me * local, local).sum().item<int64_t>();
      const int64_t received =
          rows.narrow(1, me * local, local).sum().item<int64_t>() - rows[me].narrow(0, me * local, local).sum().item<int64_t>();
      const auto all_stats = epg.stats();
      const int64_t row_bytes = h * 4;
      if (type == TokenDispatcher::kAllToAll) {
        // Out: my rows for remote experts; back: the outputs of the rows I received.
        CHECK(forward_stats[CommOp::kAllToAll].bytes == (sent + received) * row_bytes);
        CHECK(forward_stats[CommOp::kAllToAll].calls == 2);
        CHECK(all_stats[CommOp::kAllToAll].bytes == 2 * (sent + received) * row_bytes);
      } else {
        // Tokens, router weights (fp32) and selections (bytes) gathered; outputs reduce-scattered.
        CHECK(forward_stats[CommOp::kAllGather].bytes == t * h * 4 + t * e * 4 + t * e);
        CHECK(forward_stats[CommOp::kReduceScatter].bytes == world * t * h * 4);
        CHECK(forward_stats[CommOp::kAllToAll].calls == 0);
      }
      // An expert's gradient gathers every rank's tokens routed to it.
      check_gradients(layer, ref, run, worldg, me, world, 0, 1, 1);
      CHECK(layer->stats().dropped.item<int64_t>() == ref->stats().dropped.item<int64_t>());
    }
  }
}

TEST_CASE("An MoE layer with expert tensor parallelism equals one rank's; ETP moves each rank's rows etp - 1 times",
          "[mp][moe]") {
  const int64_t world = mp::world_size();
  // (ep, etp): every expert split over all ranks, and (at 4 ranks) EP 2 x ETP 2.
  std::vector<std::pair<int64_t, int64_t>> layouts{{1, world}};
  if (world == 4) layouts.push_back({2, 2});
  int64_t n = 0;
  for (const auto& [ep, etp] : layouts) {
    auto st = mp::state(1, 1, "moe_etp_" + std::to_string(n++), 1, ep, etp);
    const std::string epn = st->group_name(GroupKind::kExpert), etpn = st->group_name(GroupKind::kExpertTensor);
    Group etpg(etpn), worldg(*st, GroupKind::kWorld);
    REQUIRE(etpg.size() == etp);
    for (bool swiglu : {false, true}) {
      for (TokenDispatcher type : {TokenDispatcher::kAllToAll, TokenDispatcher::kAllGather}) {
        INFO("ep " << ep << " etp " << etp << (swiglu ? " swiglu" : " gelu") << " " << name_of(type));
        auto base = TransformerConfig()
                        .hidden_size(16)
                        .num_attention_heads(2)
                        .num_experts(4)
                        .moe_router_topk(2)
                        .moe_ffn_hidden_size(12)
                        .add_bias_linear(true)
                        .moe_aux_loss_coeff(0.01)
                        .moe_token_dispatcher_type(type)
                        .init_std(0.3)
                        .seed(6);
        if (swiglu) base.activation(megatorch::transformer::Activation::kSwiGLU);
        moe::MoELayer ref{moe::MoELayerOptions(base)};
        moe::MoELayer layer{moe::MoELayerOptions(
            TransformerConfig(base).expert_parallel_group(ep > 1 ? epn : "").expert_tensor_parallel_group(etpn))};
        // Biases are initialised to zero: give them values so that their paths are tested.
        {
          torch::NoGradGuard no_grad;
          for (auto* m : {&ref, &layer}) {
            (*m)->experts->fc1_bias.copy_(expert_shard("fc1_bias", randn({4, swiglu ? 24 : 12}, 7),
                                                       m == &ref ? 0 : st->ep_rank(), m == &ref ? 1 : ep,
                                                       m == &ref ? 0 : st->etp_rank(), m == &ref ? 1 : etp, swiglu ? 2 : 1));
            (*m)->experts->fc2_bias.copy_(local_experts(randn({4, 16}, 8), m == &ref ? 0 : st->ep_rank(), m == &ref ? 1 : ep));
          }
        }
        const int64_t h = 16, t = 10;
        const LayerRun run = run_against_reference(layer, ref, etpg, 60, st->rank());
        CHECK_CLOSE(run.out, run.want);
        if (ep == 1 && type == TokenDispatcher::kAllToAll) {
          // Each rank's routed rows, all-gathered (sent to etp - 1 ranks) and reduce-scattered
          // back (every other rank's rows sent to it); backward the same, transposed.
          const at::Tensor rows =
              etpg.all_gather(ref->router->forward(run.x.reshape({t, h})).selection.sum().reshape({1}), 0);
          const int64_t mine = rows[etpg.rank()].item<int64_t>(), all = rows.sum().item<int64_t>();
          const int64_t row_bytes = h * 4;
          CHECK(run.forward[CommOp::kAllToAll].bytes == ((etp - 1) * mine + (all - mine)) * row_bytes);
          CHECK(etpg.stats()[CommOp::kAllToAll].bytes == 2 * ((etp - 1) * mine + (all - mine)) * row_bytes);
        }
        // Each expert shard's gradient holds every rank's rows routed to its expert.
        check_gradients(layer, ref, run, worldg, st->ep_rank(), ep, st->etp_rank(), etp, swiglu ? 2 : 1);
      }
    }
  }
}

namespace {

struct EpLayout {
  int64_t tp, pp, ep, cp = 1;
  bool sp = true;  // with tp > 1
  int64_t etp = 1;
};

std::string describe(const EpLayout& l) {
  return "tp " + std::to_string(l.tp) + " pp " + std::to_string(l.pp) + " ep " + std::to_string(l.ep) + " etp " +
         std::to_string(l.etp) + " cp " + std::to_string(l.cp) + (l.tp > 1 && !l.sp ? " no SP" : "");
}

std::vector<pipeline::MicroBatch> micro_batches(const TransformerConfig& c, int64_t m, int64_t first) {
  std::vector<pipeline::MicroBatch> mbs;
  for (int64_t i = 0; i < m; ++i) {
    auto d = gpt_test::batch_ids(2, c.seq_length(), c.vocab_size(), 500 + first + i);
    mbs.push_back({d.narrow(1, 0, c.seq_length()), d.narrow(1, 1, c.seq_length())});
  }
  return mbs;
}

}  // namespace

TEST_CASE("GPT with experts at EP 2 and 4 and ETP 2 (over DP, with TP2 + SP, with PP2, with CP2) equals EP 1",
          "[mp][moe]") {
  const int64_t world = mp::world_size();
  std::vector<EpLayout> layouts{{1, 1, world}};
  if (world % 2 == 0) layouts.push_back({1, 1, 2, 2});  // EP over the ranks splitting each sequence
  if (world % 2 == 0) layouts.push_back({1, 1, 1, 1, true, 2});  // each expert split over two DP ranks
  if (world == 4) {
    layouts.push_back({1, 1, 2});  // two expert-data-parallel replicas of each expert
    layouts.push_back({2, 1, 2});  // EP folded onto TP: each TP rank routes its SP share
    layouts.push_back({2, 1, 2, 1, false});  // without SP both TP ranks route every token
    layouts.push_back({2, 1, 4});  // EP over TP x DP
    layouts.push_back({1, 2, 2});  // EP inside each pipeline stage
    layouts.push_back({2, 1, 2, 1, true, 2});  // ETP = TP (Megatron's default), EP over DP
    layouts.push_back({2, 1, 1, 1, false, 2});  // ETP = TP without SP: both send every token
    layouts.push_back({1, 2, 1, 1, true, 2});  // ETP inside each pipeline stage
  }
  const std::vector<std::pair<std::string, TransformerConfig>> variants{
      {"softmax-gelu-aux-z", gpt_test::base_config().num_experts(4).moe_ffn_hidden_size(24)},
      {"sigmoid-swiglu-shared-freq2", gpt_test::variants()[1].config.num_experts(8).moe_router_topk(3)
                                          .moe_router_score_function(megatorch::transformer::RouterScore::kSigmoid)
                                          .moe_router_norm_topk_prob(true)
                                          .moe_router_topk_scaling_factor(2.0)
                                          .moe_shared_expert_intermediate_size(32)
                                          .moe_layer_freq(2)},
  };
  int64_t cases = 0;
  for (const auto& layout : layouts) {
    auto st = mp::state(layout.tp, layout.pp, "moegpt_" + std::to_string(cases), layout.cp, layout.ep, layout.etp);
    Group tpg(*st, GroupKind::kTensor), dpg(*st, GroupKind::kData), edpg(*st, GroupKind::kExpertData);
    Group gradg(*st, GroupKind::kDataContext);
    // DP x CP: the ranks the optimizer averages over (each CP rank's loss is c x its share).
    const int64_t dp = dpg.size(), replicas = gradg.size(), ep_rank = st->ep_rank(), etp_rank = st->etp_rank();
    for (const auto& [vname, vconfig] : variants) {
      if (vconfig.num_experts() % layout.ep != 0) continue;  // at world sizes other than 2 and 4
      for (TokenDispatcher type : {TokenDispatcher::kAllToAll, TokenDispatcher::kAllGather}) {
        ++cases;
        INFO(vname << " " << describe(layout) << " " << name_of(type));
        const auto ref_config = TransformerConfig(vconfig)
                                    .num_layers(4)
                                    .seq_length(8)
                                    .moe_aux_loss_coeff(0.01)
                                    .moe_z_loss_coeff(0.001)
                                    .moe_token_dispatcher_type(type);
        const auto config = TransformerConfig(ref_config)
                                .sequence_parallel(layout.tp > 1 && layout.sp)
                                .context_parallel_group(layout.cp > 1 ? st->group_name(GroupKind::kContext) : "")
                                .expert_parallel_group(st->group_name(GroupKind::kExpert))
                                .expert_tensor_parallel_group(st->group_name(GroupKind::kExpertTensor));
        const int64_t m = 2 * layout.pp;
        // Reference: every DP rank's micro-batches on one rank, every expert.
        GPTModel full{GPTModelOptions(ref_config)};
        moe::set_aux_loss_backward_scale(*full, 1.0 / static_cast<double>(dp * m));
        double ref_loss = 0;
        for (int64_t d = 0; d < dp; ++d) {
          for (const auto& mb : micro_batches(ref_config, m, d * m)) {
            auto l = full->loss(mb.ids, mb.labels) / static_cast<double>(dp * m);
            l.backward();
            ref_loss += l.item<double>();
          }
        }
        pipeline::PipelineStage stage(pipeline::PipelineStageOptions(config).tp_group(tpg.name()).pp_group(
            layout.pp > 1 ? st->group_name(GroupKind::kPipeline) : ""));
        auto result = pipeline::run_pipeline_step(stage, micro_batches(ref_config, m, st->dp_rank() * m),
                                                  pipeline::ExecutorOptions());
        stage->allreduce_tied_grads();
        stage->allreduce_sequence_parallel_grads();
        if (st->pp_rank() == layout.pp - 1) {
          at::Tensor loss = result.loss.to(at::kDouble).reshape({1});
          gradg.all_reduce(loss);
          CHECK(loss.item<double>() / static_cast<double>(replicas) == Approx(ref_loss).epsilon(1e-5));
        }
        // The optimizer's reductions: dense gradients averaged over DP x CP; an expert's
        // summed over its expert-DP replicas (which hold other tokens) and divided by DP x CP
        // (and by TP without SP, whose ranks send it the same tokens).
        const int64_t copies = layout.tp > 1 && !layout.sp ? layout.tp : 1;
        gpt_test::for_each_stage_gradient(
            stage, full, config, tpg.rank(), tpg.size(),
            [&](const std::string& key, const std::string& name, const at::Tensor& p, const at::Tensor& want) {
              at::Tensor grad = p.grad().clone();
              const bool expert = name.find(".experts.") != std::string::npos;
              (expert ? edpg : gradg).all_reduce(grad);
              grad.div_(static_cast<double>(expert ? replicas * copies : replicas));
              const int64_t glu = config.activation() == megatorch::transformer::Activation::kSwiGLU ? 2 : 1;
              const at::Tensor expected =
                  expert ? expert_shard(name, want, ep_rank, layout.ep, etp_rank, layout.etp, glu) : want;
              INFO(key << " (" << name << ")");
              CHECK_CLOSE(grad, expected);
            });
      }
    }
  }
  CHECK(cases > 0);
}
