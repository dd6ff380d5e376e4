// megatorch.cpp: the C++ model from Python. TransformerConfig is a plain class whose
// fields are keyword arguments and attributes (enums as Megatron's strings, dtype and
// device as torch objects); GPTModel, TransformerLayer, ParallelAttention and ParallelMLP
// are bound with torch::python::bind_module, so each is a torch.nn.Module delegating to
// the C++ module (parameters, train/eval, to(), hooks); state_dict/load_state_dict are
// bound here, as the wrapper cannot walk C++ children itself.
// A group is a registered c10d group's name or a torch.distributed group; "" or None
// means no tensor parallelism (for TransformerConfig.context_parallel_group: no context
// parallelism).
#include <megatorch/megatorch.h>
#include <torch/python.h>

#include <algorithm>
#include <cctype>
#include <functional>
#include <map>
#include <sstream>
#include <type_traits>
#include <vector>

namespace py = pybind11;
namespace tf = megatorch::transformer;
namespace fp8 = megatorch::fp8;
using Config = tf::TransformerConfig;

namespace {

// ---- enums <-> Megatron's strings ("LayerNorm", "rope", "selective", ...)
std::vector<tf::Normalization> values(tf::Normalization) { return {tf::Normalization::kLayerNorm, tf::Normalization::kRMSNorm}; }
std::vector<tf::Activation> values(tf::Activation) { return {tf::Activation::kGeluTanh, tf::Activation::kSwiGLU}; }
std::vector<tf::Positions> values(tf::Positions) { return {tf::Positions::kLearned, tf::Positions::kRope}; }
std::vector<tf::Recompute> values(tf::Recompute) { return {tf::Recompute::kNone, tf::Recompute::kSelective, tf::Recompute::kFull}; }
std::vector<tf::CpCommType> values(tf::CpCommType) { return {tf::CpCommType::kP2P, tf::CpCommType::kA2A}; }
std::vector<tf::RouterScore> values(tf::RouterScore) { return {tf::RouterScore::kSoftmax, tf::RouterScore::kSigmoid}; }
std::vector<tf::TokenDispatcher> values(tf::TokenDispatcher) {
  return {tf::TokenDispatcher::kAllToAll, tf::TokenDispatcher::kAllGather};
}

template <class T>
constexpr bool is_config_enum = std::is_same_v<T, tf::Normalization> || std::is_same_v<T, tf::Activation> ||
                                std::is_same_v<T, tf::Positions> || std::is_same_v<T, tf::Recompute> ||
                                std::is_same_v<T, tf::CpCommType> || std::is_same_v<T, tf::RouterScore> ||
                                std::is_same_v<T, tf::TokenDispatcher>;

std::string lower(std::string s) {
  for (auto& ch : s) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return s;
}

// A Python value for a field of type T, with an error that names the field.
template <class T>
T from_py(const py::handle& v, const std::string& field) {
  try {
    if constexpr (is_config_enum<T>) {
      const auto s = py::cast<std::string>(v);
      std::string valid;
      for (T e : values(T{})) {
        if (lower(s) == lower(tf::to_string(e))) return e;
        valid += std::string(valid.empty() ? "" : ", ") + "'" + tf::to_string(e) + "'";
      }
      throw py::value_error("TransformerConfig." + field + ": expected one of " + valid + ", got '" + s + "'");
    } else if constexpr (std::is_same_v<T, c10::Device>) {
      return py::isinstance<py::str>(v) ? c10::Device(py::cast<std::string>(v)) : py::cast<c10::Device>(v);
    } else {
      return py::cast<T>(v);
    }
  } catch (const py::cast_error&) {
    throw py::type_error("TransformerConfig." + field + ": cannot take a value of type " +
                         py::str(py::type::of(v)).cast<std::string>());
  }
}

template <class T>
py::object to_py(const T& v) {
  if constexpr (is_config_enum<T>) {
    return py::str(tf::to_string(v));
  } else {
    return py::cast(v);
  }
}

// A group given as a name, a torch.distributed ProcessGroup (its group_name) or None.
std::string group_name(const py::object& group) {
  if (group.is_none()) return "";
  if (py::isinstance<py::str>(group)) return group.cast<std::string>();
  if (py::hasattr(group, "group_name")) return group.attr("group_name").cast<std::string>();
  throw py::type_error("megatorch: expected a group name (str), a torch.distributed ProcessGroup or None, got " +
                       py::str(py::type::of(group)).cast<std::string>());
}

struct Field {
  std::string name;
  std::function<py::object(const Config&)> get;
  std::function<void(Config&, const py::handle&)> set;
};

template <class Get, class Set>
Field field(const char* name, Get get, Set set) {
  using T = std::decay_t<std::invoke_result_t<Get, const Config&>>;
  return {name, [get](const Config& c) { return to_py<T>(get(c)); },
          [set, name](Config& c, const py::handle& v) { set(c, from_py<T>(v, name)); }};
}

#define MT_FIELD(name) \
  field(#name, [](const Config& c) { return c.name(); }, [](Config& c, const auto& v) { c.name(v); })

// A group field: set from a name, a ProcessGroup or None (stored as its registered name,
// "" for None), read back as the name, so to_dict() and pickling stay plain strings.
Field group_field(const char* name, std::function<const std::string&(const Config&)> get,
                  std::function<void(Config&, std::string)> set) {
  return {name, [get](const Config& c) { return py::object(py::str(get(c))); },
          [set, name = std::string(name)](Config& c, const py::handle& v) {
            try {
              set(c, group_name(py::reinterpret_borrow<py::object>(v)));
            } catch (const py::builtin_exception&) {  // group_name's type_error, a cast_error
              throw py::type_error("TransformerConfig." + name + ": expected a group name (str), a " +
                                   "torch.distributed ProcessGroup or None, got " +
                                   py::str(py::type::of(v)).cast<std::string>());
            }
          }};
}

// TransformerConfig.fp8 (fp8/recipe.h's Fp8Options) as a dict: {"format": "hybrid", "recipe":
// "delayed", "amax_history_len": 16, "amax_compute_algo": "max", "margin": 0}; keys left out
// keep their defaults, None (or format "none") turns FP8 off.
Field fp8_field() {
  static const char* keys = "format, recipe, amax_history_len, amax_compute_algo, margin";
  return {"fp8",
          [](const Config& c) -> py::object {
            const fp8::Fp8Options& o = c.fp8();
            py::dict d;
            d["format"] = fp8::to_string(o.format());
            d["recipe"] = fp8::to_string(o.recipe());
            d["amax_history_len"] = o.amax_history_len();
            d["amax_compute_algo"] = fp8::to_string(o.amax_compute_algo());
            d["margin"] = o.margin();
            return std::move(d);
          },
          [](Config& c, const py::handle& v) {
            fp8::Fp8Options o;
            if (!v.is_none() && !py::isinstance<py::dict>(v)) {
              throw py::type_error(std::string("TransformerConfig.fp8: expected a dict with keys among ") + keys +
                                   ", or None, got " + py::str(py::type::of(v)).cast<std::string>());
            }
            try {
              for (const auto& [k, val] : v.is_none() ? py::dict() : py::reinterpret_borrow<py::dict>(v)) {
                const auto key = py::cast<std::string>(k);
                if (key == "format") {
                  const auto f = py::cast<std::string>(val);
                  o.format(f == "none" ? fp8::Format::kNone : fp8::parse_format(f));
                } else if (key == "recipe") {
                  o.recipe(fp8::parse_recipe(py::cast<std::string>(val)));
                } else if (key == "amax_history_len") {
                  o.amax_history_len(py::cast<int64_t>(val));
                } else if (key == "amax_compute_algo") {
                  o.amax_compute_algo(fp8::parse_amax_algo(py::cast<std::string>(val)));
                } else if (key == "margin") {
                  o.margin(py::cast<int64_t>(val));
                } else {
                  throw py::value_error("TransformerConfig.fp8: unknown key '" + key + "'; the keys are " + keys);
                }
              }
              o.validate("TransformerConfig.fp8");
            } catch (const c10::Error& e) {
              throw py::value_error(e.what_without_backtrace());
            }
            c.fp8(o);
          }};
}

// TransformerConfig.rope_scaling (transformer/rope.h) as a dict in HF's names: {"rope_type":
// "llama3", "factor": 8.0, "original_max_position_embeddings": 8192, ...}; keys left out keep
// their defaults, None is the default (unscaled) RoPE.
Field rope_scaling_field() {
  using megatorch::transformer::RopeScaling;
  static const char* keys = "rope_type, factor, original_max_position_embeddings, low_freq_factor, high_freq_factor, "
                            "beta_fast, beta_slow, attention_factor, mscale, mscale_all_dim, truncate";
  return {"rope_scaling",
          [](const Config& c) -> py::object {
            const RopeScaling& s = c.rope_scaling();
            py::dict d;
            d["rope_type"] = megatorch::transformer::to_string(s.type());
            d["factor"] = s.factor();
            d["original_max_position_embeddings"] = s.original_max_position_embeddings();
            d["low_freq_factor"] = s.low_freq_factor();
            d["high_freq_factor"] = s.high_freq_factor();
            d["beta_fast"] = s.beta_fast();
            d["beta_slow"] = s.beta_slow();
            d["attention_factor"] = s.attention_factor();
            d["mscale"] = s.mscale();
            d["mscale_all_dim"] = s.mscale_all_dim();
            d["truncate"] = s.truncate();
            return std::move(d);
          },
          [](Config& c, const py::handle& v) {
            RopeScaling s;
            if (!v.is_none() && !py::isinstance<py::dict>(v)) {
              throw py::type_error(std::string("TransformerConfig.rope_scaling: expected a dict with keys among ") +
                                   keys + ", or None, got " + py::str(py::type::of(v)).cast<std::string>());
            }
            try {
              for (const auto& [k, val] : v.is_none() ? py::dict() : py::reinterpret_borrow<py::dict>(v)) {
                const auto key = py::cast<std::string>(k);
                if (key == "rope_type") s.type(megatorch::transformer::parse_rope_type(py::cast<std::string>(val)));
                else if (key == "factor") s.factor(py::cast<double>(val));
                else if (key == "original_max_position_embeddings") s.original_max_position_embeddings(py::cast<int64_t>(val));
                else if (key == "low_freq_factor") s.low_freq_factor(py::cast<double>(val));
                else if (key == "high_freq_factor") s.high_freq_factor(py::cast<double>(val));
                else if (key == "beta_fast") s.beta_fast(py::cast<double>(val));
                else if (key == "beta_slow") s.beta_slow(py::cast<double>(val));
                else if (key == "attention_factor") s.attention_factor(py::cast<double>(val));
                else if (key == "mscale") s.mscale(py::cast<double>(val));
                else if (key == "mscale_all_dim") s.mscale_all_dim(py::cast<double>(val));
                else if (key == "truncate") s.truncate(py::cast<bool>(val));
                else throw py::value_error("TransformerConfig.rope_scaling: unknown key '" + key + "'; the keys are " + keys);
              }
              s.validate();
            } catch (const c10::Error& e) {
              throw py::value_error(e.what_without_backtrace());
            }
            c.rope_scaling(s);
          }};
}

// Every field of TransformerConfig, in declaration order (config.h documents each).
const std::vector<Field>& fields() {
  static const std::vector<Field> all = {
      MT_FIELD(hidden_size), MT_FIELD(num_attention_heads), MT_FIELD(num_query_groups), MT_FIELD(kv_channels),
      MT_FIELD(ffn_hidden_size), MT_FIELD(num_layers), MT_FIELD(seq_length),
      MT_FIELD(max_position_embeddings), MT_FIELD(vocab_size), MT_FIELD(make_vocab_size_divisible_by),
      MT_FIELD(normalization), MT_FIELD(norm_epsilon), MT_FIELD(activation),
      MT_FIELD(position_embedding_type), MT_FIELD(rotary_base), MT_FIELD(rotary_percent), rope_scaling_field(),
      MT_FIELD(attention_dropout),
      MT_FIELD(hidden_dropout), MT_FIELD(add_bias_linear), MT_FIELD(add_qkv_bias),
      MT_FIELD(add_attention_bias), MT_FIELD(add_mlp_bias), MT_FIELD(qk_layernorm),
      MT_FIELD(tie_embeddings), MT_FIELD(sliding_window), MT_FIELD(layer_types), MT_FIELD(causal_attention),
      MT_FIELD(sequence_parallel),
      group_field(
          "context_parallel_group",
          [](const Config& c) -> const std::string& { return c.context_parallel_group(); },
          [](Config& c, std::string g) { c.context_parallel_group(std::move(g)); }),
      MT_FIELD(cp_comm_type), MT_FIELD(recompute),
      MT_FIELD(num_experts), MT_FIELD(moe_router_topk), MT_FIELD(moe_ffn_hidden_size), MT_FIELD(moe_layer_freq),
      MT_FIELD(moe_first_k_dense), MT_FIELD(moe_shared_expert_intermediate_size), MT_FIELD(moe_router_score_function),
      MT_FIELD(moe_router_pre_softmax), MT_FIELD(moe_router_norm_topk_prob), MT_FIELD(moe_router_topk_scaling_factor),
      MT_FIELD(moe_aux_loss_coeff), MT_FIELD(moe_z_loss_coeff), MT_FIELD(moe_router_enable_expert_bias),
      MT_FIELD(moe_router_bias_update_rate), MT_FIELD(moe_expert_capacity_factor),
      MT_FIELD(moe_pad_expert_input_to_capacity), MT_FIELD(moe_token_dispatcher_type), MT_FIELD(moe_grouped_gemm),
      group_field(
          "expert_parallel_group",
          [](const Config& c) -> const std::string& { return c.expert_parallel_group(); },
          [](Config& c, std::string g) { c.expert_parallel_group(std::move(g)); }),
      group_field(
          "expert_tensor_parallel_group",
          [](const Config& c) -> const std::string& { return c.expert_tensor_parallel_group(); },
          [](Config& c, std::string g) { c.expert_tensor_parallel_group(std::move(g)); }),
      MT_FIELD(params_dtype),
      MT_FIELD(device), MT_FIELD(init_std), MT_FIELD(seed),
      MT_FIELD(shard_local_init), MT_FIELD(fused_kernels), MT_FIELD(cuda_graph),
      fp8_field(), MT_FIELD(num_layers_at_start_in_bf16), MT_FIELD(num_layers_at_end_in_bf16),
  };
  return all;
}
#undef MT_FIELD

void set_fields(Config& c, const py::dict& kwargs) {
  for (const auto& [key, value] : kwargs) {
    const auto name = py::cast<std::string>(key);
    auto it = std::find_if(fields().begin(), fields().end(), [&](const Field& f) { return f.name == name; });
    if (it == fields().end()) {
      std::string known;
      for (const auto& f : fields()) known += (known.empty() ? "" : ", ") + f.name;
      throw py::type_error("TransformerConfig has no field '" + name + "'; the fields are: " + known);
    }
    it->set(c, value);
  }
}

py::dict as_dict(const Config& c) {
  py::dict d;
  for (const auto& f : fields()) d[py::str(f.name)] = f.get(c);
  return d;
}

std::string repr(const Config& c) {
  std::ostringstream out;
  out << "TransformerConfig(";
  for (size_t i = 0; i < fields().size(); ++i) {
    out << (i ? ", " : "") << fields()[i].name << "=" << py::repr(fields()[i].get(c)).cast<std::string>();
  }
  return out.str() + ")";
}

// Dropout streams for a layer built on its own, seeded as GPTModel seeds its own
// (config.seed, tp rank); GPTModel makes one when none is given.
std::shared_ptr<megatorch::tp::RngTracker> rng_for(const Config& c, const std::string& group) {
  auto rng = std::make_shared<megatorch::tp::RngTracker>();
  rng->seed(c.seed(), megatorch::tp::tp_info(group).rank, c.device());
  return rng;
}

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

// state_dict() / load_state_dict() over the module's parameters and buffers, by their
// C++ names (the same names GPTModel's parity tests and checkpoints use).
template <class M>
void add_state_dict(torch::python::detail::PyModuleClass<M>& cls) {
  cls.def(
      "state_dict",
      [](M& self, const std::string& prefix, bool keep_vars) {
        py::dict out;
        for (const auto& items : {self.named_parameters(), self.named_buffers()}) {
          for (const auto& item : items) out[py::str(prefix + item.key())] = keep_vars ? item.value() : item.value().detach();
        }
        return out;
      },
      py::kw_only(), py::arg("prefix") = "", py::arg("keep_vars") = false);
  cls.def(
      "load_state_dict",
      [](M& self, const std::map<std::string, at::Tensor>& state, bool strict) {
        std::vector<std::pair<std::string, at::Tensor>> targets;
        for (const auto& items : {self.named_parameters(), self.named_buffers()}) {
          for (const auto& item : items) targets.emplace_back(item.key(), item.value());
        }
        std::vector<std::string> missing, unexpected;
        for (const auto& [name, t] : targets) {
          auto it = state.find(name);
          if (it == state.end()) {
            missing.push_back(name);
          } else if (it->second.sizes() != t.sizes()) {
            throw py::value_error("load_state_dict: '" + name + "' has shape " + c10::str(it->second.sizes()) +
                                  ", the module's is " + c10::str(t.sizes()));
          }
        }
        for (const auto& [name, t] : state) {
          auto same = [&name = name](const auto& target) { return target.first == name; };
          if (std::find_if(targets.begin(), targets.end(), same) == targets.end()) unexpected.push_back(name);
        }
        if (strict && (!missing.empty() || !unexpected.empty())) {
          throw py::key_error("load_state_dict: missing keys [" + c10::Join(", ", missing) + "], unexpected keys [" +
                              c10::Join(", ", unexpected) + "]");
        }
        torch::NoGradGuard no_grad;
        for (auto& [name, t] : targets) {
          if (state.count(name)) t.copy_(state.at(name));
        }
        return py::make_tuple(missing, unexpected);
      },
      py::arg("state_dict"), py::arg("strict") = true, "Copies the tensors in; returns (missing_keys, unexpected_keys)");
}

using release_gil = py::call_guard<py::gil_scoped_release>;

}  // namespace

PYBIND11_MODULE(_cpp, m) {
  m.doc() = "megatorch's C++ model (GPTModel, TransformerLayer, ...) as torch.nn.Modules";

  py::class_<Config> config(m, "TransformerConfig",
                     "The one description of a GPT-style model (include/megatorch/transformer/config.h).\n"
                     "Every field is a keyword argument and an attribute; enums are strings:\n"
                     "normalization 'LayerNorm'|'RMSNorm', activation 'gelu_tanh'|'swiglu',\n"
                     "position_embedding_type 'learned_absolute'|'rope', recompute 'none'|'selective'|'full',\n"
                     "cp_comm_type 'p2p'|'a2a', moe_router_score_function 'softmax'|'sigmoid',\n"
                     "moe_token_dispatcher_type 'alltoall'|'allgather'; params_dtype a torch.dtype, device a torch.device or a string;\n"
                     "context_parallel_group, expert_parallel_group and expert_tensor_parallel_group a group name, a torch.distributed ProcessGroup\n"
                     "or None (read back as its name, '' for none).");
  config.def(py::init([](const py::kwargs& kwargs) {
        Config c;
        set_fields(c, kwargs);
        return c;
      }))
      .def("replace",
           [](const Config& c, const py::kwargs& kwargs) {
             Config out = c;
             set_fields(out, kwargs);
             return out;
           },
           "A copy with the given fields changed.")
      .def("to_dict", &as_dict, "{field: value} for every field (the keyword arguments that rebuild it)")
      .def("validate", &Config::validate, py::arg("tp_size") = 1, py::arg("cp_size") = 1, py::arg("ep_size") = 1,
           py::arg("etp_size") = 1, "Every constraint against a TP (and CP, EP, expert-TP) size.")
      .def_property_readonly("head_dim", &Config::head_dim)
      .def_property_readonly("ffn", &Config::ffn, "ffn_hidden_size, or its default when 0")
      .def_property_readonly("query_groups", &Config::query_groups)
      .def("__repr__", &repr)
      .def(py::pickle(&as_dict, [](const py::dict& d) {
        Config c;
        set_fields(c, d);
        return c;
      }));
  for (const auto& f : fields()) {
    config.def_property(f.name.c_str(), py::cpp_function([get = f.get](const Config& c) { return get(c); }),
                        py::cpp_function([set = f.set](Config& c, const py::object& v) { set(c, v); }));
  }

  using megatorch::models::GPTModelImpl;
  using megatorch::models::GPTModelOptions;
  auto gpt = torch::python::bind_module<GPTModelImpl, /*force_enable=*/true>(m, "GPTModel");
  const auto gpt_forward = [](GPTModelImpl& self, const at::Tensor& input, const std::optional<at::Tensor>& position_ids,
                              const std::optional<at::Tensor>& document_ids) {
    return self.forward(input, tf::PackedSequence{or_undefined(position_ids), or_undefined(document_ids)});
  };
  add_state_dict(gpt);
  gpt.def(py::init([](const Config& c, const py::object& group, int64_t layer_begin, int64_t layer_end,
                       bool pre_process, bool post_process) {
             return std::make_shared<GPTModelImpl>(GPTModelOptions(c)
                                                       .group(group_name(group))
                                                       .layer_begin(layer_begin)
                                                       .layer_end(layer_end)
                                                       .pre_process(pre_process)
                                                       .post_process(post_process));
           }),
           py::arg("config"), py::arg("group") = py::none(), py::arg("layer_begin") = 0, py::arg("layer_end") = -1,
           py::arg("pre_process") = true, py::arg("post_process") = true,
           "The model's layers [layer_begin, layer_end) (-1: num_layers), with the embedding (pre_process) and the\n"
           "head (post_process). Like the C++ model it seeds torch's default generator with config.seed and its\n"
           "dropout streams with config.seed + tp rank.")
      .def("forward", gpt_forward, py::arg("input"), py::arg("position_ids") = py::none(),
           py::arg("document_ids") = py::none(), release_gil(),
           "token ids [b, s] (or hidden states [s, b, h] without pre_process) -> logits shard [s, b, Vp/tp] "
           "(or hidden states without post_process); position_ids / document_ids [b, s]: packed documents "
           "(pack_documents)")
      .def("__call__", gpt_forward, py::arg("input"), py::arg("position_ids") = py::none(),
           py::arg("document_ids") = py::none(), release_gil())
      .def("loss", &GPTModelImpl::loss, py::arg("ids"), py::arg("labels"), py::arg("ignore_index") = -100,
           release_gil(), "Mean loss over the non-ignored tokens of ids [b, s], labels [b, s]")
      .def("per_token_loss", &GPTModelImpl::per_token_loss, py::arg("logits"), py::arg("labels"),
           py::arg("ignore_index") = -100, release_gil(), "Loss [s, b] from a logits shard and labels [b, s]")
      .def("allreduce_sequence_parallel_grads", &GPTModelImpl::allreduce_sequence_parallel_grads, release_gil())
      .def("sequence_parallel_parameters", &GPTModelImpl::sequence_parallel_parameters)
      .def("output_weight", &GPTModelImpl::output_weight)
      .def("cuda_graph_captures", &GPTModelImpl::cuda_graph_captures,
           "with config.cuda_graph: forward/backward graph pairs captured so far")
      .def("cuda_graph_fallback_reason", &GPTModelImpl::cuda_graph_fallback_reason,
           "with config.cuda_graph: why the layers ran eagerly ('' while they were captured)")
      .def_property_readonly("config", [](const GPTModelImpl& self) { return self.options.config(); })
      .def_property_readonly("group", [](const GPTModelImpl& self) { return self.options.group(); })
      .def_property_readonly("layer_range", [](const GPTModelImpl& self) {
        return py::make_tuple(self.options.layer_begin(), self.options.layer_end());
      });

  using tf::TransformerLayerImpl;
  auto layer = torch::python::bind_module<TransformerLayerImpl, /*force_enable=*/true>(m, "TransformerLayer");
  add_state_dict(layer);
  layer.def(py::init([](const Config& c, const py::object& group, int64_t layer_number) {
             const auto name = group_name(group);
             return std::make_shared<TransformerLayerImpl>(
                 tf::TransformerLayerOptions(c).group(name).layer_number(layer_number).rng(rng_for(c, name)));
           }),
           py::arg("config"), py::arg("group") = py::none(), py::arg("layer_number") = 0,
           "Layer `layer_number` of a GPTModel (same weights); its dropout streams are seeded as GPTModel's\n"
           "(this seeds torch's default generator with config.seed).")
      .def("forward",
           [](TransformerLayerImpl& self, const at::Tensor& x, const std::optional<at::Tensor>& rope_freqs) {
             return self.forward(x, or_undefined(rope_freqs));
           },
           py::arg("x"), py::arg("rope_freqs") = py::none(), release_gil(),
           "x [s, b, h] ([s/tp, b, h] with sequence parallelism) -> same shape")
      .def("sequence_parallel_parameters", &TransformerLayerImpl::sequence_parallel_parameters)
      .def_property_readonly("config", [](const TransformerLayerImpl& self) { return self.options.config(); });

  using tf::ParallelAttentionImpl;
  auto attention = torch::python::bind_module<ParallelAttentionImpl, /*force_enable=*/true>(m, "ParallelAttention");
  add_state_dict(attention);
  attention.def(py::init([](const Config& c, const py::object& group, const std::string& name, int64_t layer_number) {
             const auto g = group_name(group);
             return std::make_shared<ParallelAttentionImpl>(
                 tf::ParallelAttentionOptions(c).group(g).name(name).layer_number(layer_number).rng(rng_for(c, g)));
           }),
           py::arg("config"), py::arg("group") = py::none(), py::arg("name") = "attention",
           py::arg("layer_number") = 0)
      .def("forward",
           [](ParallelAttentionImpl& self, const at::Tensor& x, const std::optional<at::Tensor>& rope_freqs) {
             return self.forward(x, or_undefined(rope_freqs));
           },
           py::arg("x"), py::arg("rope_freqs") = py::none(), release_gil())
      .def("core_attention",
           [](ParallelAttentionImpl& self, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
             return self.core_attention(q, k, v);
           },
           py::arg("q"), py::arg("k"), py::arg("v"), release_gil(), "softmax(QK^T/sqrt(d))V: q [s, b, heads, d], k/v [s, b, groups, d] -> [s, b, heads*d]");

  using tf::ParallelMLPImpl;
  auto mlp = torch::python::bind_module<ParallelMLPImpl, /*force_enable=*/true>(m, "ParallelMLP");
  add_state_dict(mlp);
  mlp.def(py::init([](const Config& c, const py::object& group, const std::string& name) {
             return std::make_shared<ParallelMLPImpl>(tf::ParallelMLPOptions(c).group(group_name(group)).name(name));
           }),
           py::arg("config"), py::arg("group") = py::none(), py::arg("name") = "mlp")
      .def("forward", &ParallelMLPImpl::forward, py::arg("x"), release_gil());

  // Checkpoints of a GPTModel (include/megatorch/ckpt): sharded, resharding on load.
  m.def(
      "save_checkpoint",
      [](GPTModelImpl& model, const std::string& dir, int64_t iteration, const py::object& group, bool writer) {
        auto entries = megatorch::ckpt::gpt_model_entries(model, megatorch::ckpt::GPTEntriesOptions().writer(writer));
        megatorch::ckpt::CheckpointState state;
        state.model_config = megatorch::ckpt::gpt_config_json(model.options.config());
        const std::string name = group_name(group);  // reads the Python object: before the GIL goes
        py::gil_scoped_release no_gil;
        megatorch::ckpt::save_checkpoint(dir, iteration, entries, state, name);
      },
      py::arg("model"), py::arg("dir"), py::arg("iteration"), py::arg("group") = py::none(), py::arg("writer") = true,
      "Saves the model's parameters as checkpoint `iteration` under `dir`. `group`: every rank taking part\n"
      "(the world), None for one process; writer=False on data-parallel replicas.");
  m.def(
      "load_checkpoint",
      [](GPTModelImpl& model, const std::string& dir, int64_t iteration, const py::object& group) {
        auto entries = megatorch::ckpt::gpt_model_entries(model);
        const auto opts = megatorch::ckpt::LoadOptions()
                              .iteration(iteration)
                              .group(group_name(group))
                              .model_config(megatorch::ckpt::gpt_shape_json(model.options.config()));
        megatorch::ckpt::LoadedCheckpoint loaded;
        {
          py::gil_scoped_release no_gil;
          loaded = megatorch::ckpt::load_checkpoint(dir, entries, opts);
        }
        return loaded.iteration;
      },
      py::arg("model"), py::arg("dir"), py::arg("iteration") = -1, py::arg("group") = py::none(),
      "Loads checkpoint `iteration` (-1: the latest) of `dir` into the model, whatever layout saved it;\n"
      "returns the iteration.");
  m.def(
      "checkpoint_config",
      [](const std::string& dir, int64_t iteration) {
        return megatorch::ckpt::gpt_config_from_json(megatorch::ckpt::read_metadata(dir, iteration).at("model_config"));
      },
      py::arg("dir"), py::arg("iteration") = -1, "The TransformerConfig a checkpoint was saved with.");
  m.def("read_checkpoint_tensors", &megatorch::ckpt::read_tensors, py::arg("dir"), py::arg("prefix") = "",
        py::arg("iteration") = -1,
        "Every tensor of a checkpoint whose key starts with prefix, whole, by key ('model/...', 'optim/exp_avg/...',\n"
        "'optim/grad/...' with gpt_pretrain --save-grads), whatever layout saved it.");

  m.def(
      "pack_documents",
      [](const at::Tensor& tokens, int64_t eod, bool reset_position_ids, bool reset_attention_mask) {
        const auto p = tf::pack_documents(tokens, eod, reset_position_ids, reset_attention_mask);
        const auto maybe = [](const at::Tensor& t) { return t.defined() ? py::cast(t) : py::none(); };
        return py::make_tuple(maybe(p.position_ids), maybe(p.document_ids));
      },
      py::arg("tokens"), py::arg("eod"), py::arg("reset_position_ids") = true, py::arg("reset_attention_mask") = true,
      "Packed documents of token ids [b, s] split after each `eod` (Megatron's --reset-position-ids,\n"
      "--reset-attention-mask): (position_ids, document_ids), each [b, s] int64 or None when not asked for;\n"
      "pass them to GPTModel.forward.");
  m.def(
      "document_causal_attention",
      [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& document_ids, double scale,
         int64_t window, double dropout) {
        return tf::document_causal_attention(q, k, v, tf::document_runs(document_ids), dropout, scale, window);
      },
      py::arg("q"), py::arg("k"), py::arg("v"), py::arg("document_ids"), py::arg("scale"), py::arg("window") = 0,
      py::arg("dropout") = 0.0, release_gil(),
      "Causal attention inside each packed document, block by block: q [b, heads, s, d], k/v [b, groups, s, d],\n"
      "document_ids [b, s] -> [b, heads, s, d] (no s x s mask is made).");
  m.def("rope_frequencies",
        static_cast<at::Tensor (*)(int64_t, int64_t, double, c10::Device)>(&tf::rope_frequencies),
        py::arg("seq_length"), py::arg("head_dim"), py::arg("base") = 10000.0,
        py::arg("device") = c10::Device(c10::kCPU),
        "RoPE angles [s, 1, 1, head_dim] for TransformerLayer/ParallelAttention.forward(x, rope_freqs)");
  m.def("rope_frequencies",
        static_cast<at::Tensor (*)(int64_t, const Config&, c10::Device)>(&tf::rope_frequencies),
        py::arg("seq_length"), py::arg("config"), py::arg("device") = c10::Device(c10::kCPU),
        "RoPE angles [s, 1, 1, rotary_dim] of a TransformerConfig: its rotary_percent, rotary_base and rope_scaling");

  // Context parallelism's layout (include/megatorch/transformer/context_parallel.h).
  m.def("context_parallel_positions", &tf::context_parallel_positions, py::arg("seq_length"), py::arg("cp_size"),
        py::arg("cp_rank"), py::arg("device") = c10::Device(c10::kCPU),
        "The global positions of CP rank cp_rank's tokens, in local order (int64 [seq_length / cp_size]): the\n"
        "sequence is cut into 2 cp_size chunks and rank r holds chunks r and 2 cp_size - 1 - r.");
  m.def("context_parallel_slice", &tf::context_parallel_slice, py::arg("x"), py::arg("dim"), py::arg("cp_size"),
        py::arg("cp_rank"), "The part of x (of size seq_length along dim) that CP rank cp_rank holds, in local order.");
}
