#include "client/desired_state.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/model_source.h"
#include "client/placement_request.h"
#include "client/targets.h"
#include "core/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/message_differencer.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {
namespace {

// The prefix every value name of `e` starts with, up to its last '_'
// ("EXPERT_KIND_" of EXPERT_KIND_UNSPECIFIED, _SWIGLU, _IDENTITY).
std::string EnumPrefix(const google::protobuf::EnumDescriptor& e) {
  std::string prefix = e.value_count() > 0 ? e.value(0)->name() : "";
  for (int i = 1; i < e.value_count(); ++i) {
    const std::string& name = e.value(i)->name();
    size_t n = 0;
    while (n < prefix.size() && n < name.size() && prefix[n] == name[n]) ++n;
    prefix.resize(n);
  }
  const size_t cut = prefix.rfind('_');
  return cut == std::string::npos ? "" : prefix.substr(0, cut + 1);
}

// `value` of an enum field as the proto names it: itself when it is a value
// name, else prefix + upper(value) when that is one ("swiglu" ->
// "EXPERT_KIND_SWIGLU"); anything else is left for the parser to refuse.
void NormalizeEnumValue(const google::protobuf::EnumDescriptor& e, nlohmann::json* value) {
  if (!value->is_string()) return;
  const std::string text = value->get<std::string>();
  if (e.FindValueByName(text) != nullptr) return;
  const std::string full = EnumPrefix(e) + absl::AsciiStrToUpper(text);
  if (e.FindValueByName(full) != nullptr) *value = full;
}

// Rewrites the enum values of every field of `object`, a JSON object of
// message `d`, and of its nested messages (ParseDesiredStateJson).
void NormalizeEnums(const google::protobuf::Descriptor& d, nlohmann::json* object) {
  if (!object->is_object()) return;
  for (auto& [key, value] : object->items()) {
    const google::protobuf::FieldDescriptor* f = d.FindFieldByName(key);
    if (f == nullptr) f = d.FindFieldByCamelcaseName(key);
    if (f == nullptr) continue;  // the parser names the unknown field
    auto one = [&](nlohmann::json* v) {
      if (f->enum_type() != nullptr) NormalizeEnumValue(*f->enum_type(), v);
      if (f->message_type() != nullptr) NormalizeEnums(*f->message_type(), v);
    };
    if (f->is_repeated() && value.is_array()) {
      for (nlohmann::json& v : value) one(&v);
    } else {
      one(&value);
    }
  }
}

}  // namespace

absl::StatusOr<v1::DesiredState> ParseDesiredStateJson(absl::string_view json) {
  v1::DesiredState state;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  // Lowercase enum names ("swiglu") as the CLI spells them; text that is not
  // JSON goes to the parser as it is, for its message.
  std::string text(json);
  try {
    nlohmann::json parsed = nlohmann::json::parse(text);
    NormalizeEnums(*v1::DesiredState::descriptor(), &parsed);
    text = parsed.dump();
  } catch (const nlohmann::json::exception&) {
  }
  const auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(text.data(), text.size()), &state, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("desired state: not a moe_ep.v1.DesiredState in JSON: ", status.ToString()));
  }
  return state;
}

std::string ExampleDesiredStateJson() {
  return R"({
  "targets": ["127.0.0.1:50051", "127.0.0.1:50052"],
  "backend": "gloo",
  "model": "qwen3-30b-a3b",
  "layers": 2,
  "capacity_tokens": 384,
  "dispatch_dtype": "bf16",
  "experts": {"kind": "swiglu", "seed": 1},
  "group_timeout_ms": 60000
})";
}

std::string DesiredStateHelp() {
  return absl::StrCat(
      "--state FILE is a moe_ep.v1.DesiredState (proto/moe_ep/v1/coordinator.proto) in its "
      "JSON form. Exactly one of \"targets\" (rank i = targets[i]) and \"headless_service\" "
      "({\"service\", \"replicas\", \"port\", \"procs_per_pod\", \"port_step\"}); the rest "
      "defaults when left out: backend ",
      kDefaultStateBackend, ", model ", kDefaultStateModel, ", layers ", kDefaultStateLayers,
      ", capacity_tokens ", kDefaultStateCapacityTokens,
      ", dispatch_dtype bf16 (or fp8_e4m3), "
      "experts {kind swiglu (or identity), seed}, group_timeout_ms ",
      kDefaultStateGroupTimeoutMs, ", rpc_timeout_ms ", kDefaultStateRpcTimeoutMs,
      ". Enum values as the CLI spells them (\"swiglu\") or as the proto does "
      "(\"EXPERT_KIND_SWIGLU\"). `moe-ep coordinator --state FILE --check` validates a file "
      "and exits. Example:\n",
      ExampleDesiredStateJson(), "\n");
}

absl::StatusOr<v1::DesiredState> ReadDesiredStateFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--state: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  auto state = ParseDesiredStateJson(text.str());
  if (!state.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", state.status().message()));
  }
  return state;
}

v1::DesiredState WithDefaults(const v1::DesiredState& state) {
  v1::DesiredState out = state;
  if (out.backend().empty()) out.set_backend(kDefaultStateBackend);
  if (out.model().empty()) out.set_model(kDefaultStateModel);
  if (out.layers() == 0) out.set_layers(kDefaultStateLayers);
  if (out.capacity_tokens() == 0) out.set_capacity_tokens(kDefaultStateCapacityTokens);
  if (out.dispatch_dtype() == v1::DISPATCH_DTYPE_UNSPECIFIED) {
    out.set_dispatch_dtype(v1::DISPATCH_DTYPE_BF16);
  }
  if (out.experts().kind() == v1::EXPERT_KIND_UNSPECIFIED) {
    out.mutable_experts()->set_kind(v1::EXPERT_KIND_SWIGLU);
  }
  if (out.group_timeout_ms() == 0) out.set_group_timeout_ms(kDefaultStateGroupTimeoutMs);
  if (out.rpc_timeout_ms() == 0) out.set_rpc_timeout_ms(kDefaultStateRpcTimeoutMs);
  if (out.has_headless_service()) {
    v1::HeadlessService* h = out.mutable_headless_service();
    if (h->procs_per_pod() == 0) h->set_procs_per_pod(1);
    if (h->pod_prefix().empty()) {
      h->set_pod_prefix(std::string(*absl::StrSplit(h->service(), '.').begin()));
    }
  }
  return out;
}

bool SameDesiredState(const v1::DesiredState& a, const v1::DesiredState& b) {
  return google::protobuf::util::MessageDifferencer::Equals(WithDefaults(a), WithDefaults(b));
}

namespace {

absl::Status ValidateHeadless(const v1::HeadlessService& h) {
  if (h.service().empty()) {
    return absl::InvalidArgumentError("headless_service.service: empty (e.g. \"moe-ep-worker\")");
  }
  if (h.replicas() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("headless_service.replicas: expected >= 1, got ", h.replicas()));
  }
  if (h.port() < 1 || h.port() > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("headless_service.port: expected 1..65535, got ", h.port()));
  }
  if (h.procs_per_pod() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("headless_service.procs_per_pod: expected >= 0, got ", h.procs_per_pod()));
  }
  if (h.port_step() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("headless_service.port_step: expected >= 0, got ", h.port_step()));
  }
  return absl::OkStatus();
}

absl::Status NonNegative(absl::string_view field, int64_t value) {
  if (value >= 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": expected >= 0, got ", value));
}

}  // namespace

absl::Status ValidateDesiredState(const v1::DesiredState& state) {
  const bool has_targets = state.targets_size() > 0;
  if (has_targets == state.has_headless_service()) {
    return absl::InvalidArgumentError(
        absl::StrCat("targets / headless_service: expected exactly one, got ",
                     has_targets ? "both" : "neither"));
  }
  std::set<std::string> seen;
  for (int r = 0; r < state.targets_size(); ++r) {
    auto hp = SplitHostPort(state.targets(r));
    if (!hp.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("targets[", r, "]: ", hp.status().message()));
    }
    if (!seen.insert(state.targets(r)).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "targets[", r, "]: ", state.targets(r), " appears twice (two ranks cannot share one)"));
    }
  }
  if (state.has_headless_service()) RETURN_IF_ERROR(ValidateHeadless(state.headless_service()));
  if (!state.backend().empty() && state.backend() != "gloo" && state.backend() != "nccl" &&
      state.backend() != "auto") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend: expected gloo, nccl or auto, got \"", state.backend(), "\""));
  }
  RETURN_IF_ERROR(NonNegative("layers", state.layers()));
  RETURN_IF_ERROR(NonNegative("capacity_tokens", state.capacity_tokens()));
  RETURN_IF_ERROR(NonNegative("group_timeout_ms", state.group_timeout_ms()));
  RETURN_IF_ERROR(NonNegative("rpc_timeout_ms", state.rpc_timeout_ms()));
  RETURN_IF_ERROR(NonNegative("redundant_slots_per_rank", state.redundant_slots_per_rank()));
  if (state.placement_size() == 0 && state.redundant_slots_per_rank() > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("placement: redundant_slots_per_rank is ", state.redundant_slots_per_rank(),
                     ", so a placement table of every rank's slots is needed, got none"));
  }
  const v1::DesiredState full = WithDefaults(state);
  auto model = ResolveModel(full.model());
  if (!model.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model: ", model.status().message()));
  }
  const int sparse = model->NumSparseLayers();
  if (full.layers() > sparse) {
    return absl::InvalidArgumentError(absl::StrCat("layers: ", model->name, " has ", sparse,
                                                   " sparse layers, asked for ", full.layers()));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::optional<core::PlacementTable>> DesiredPlacement(const v1::DesiredState& state,
                                                                     int num_experts, int world) {
  if (state.placement_size() == 0) return std::optional<core::PlacementTable>();
  if (state.placement_size() != world) {
    return absl::InvalidArgumentError(absl::StrCat("placement: expected one entry per rank (",
                                                   world, "), got ", state.placement_size()));
  }
  const int expected_slots = (num_experts + world - 1) / world + state.redundant_slots_per_rank();
  std::vector<std::vector<int>> slots;
  for (int r = 0; r < world; ++r) {
    const auto& experts = state.placement(r).slot_experts();
    if (experts.size() != expected_slots) {
      return absl::InvalidArgumentError(absl::StrCat(
          "placement[", r, "].slot_experts: expected ", expected_slots, " slots (ceil(",
          num_experts, " experts / ", world, " ranks) + redundant_slots_per_rank ",
          state.redundant_slots_per_rank(), "), got ", experts.size()));
    }
    slots.emplace_back(experts.begin(), experts.end());
  }
  absl::StatusOr<core::PlacementTable> table =
      core::PlacementTable::FromSlotExperts(num_experts, std::move(slots));
  if (!table.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("placement: ", table.status().message()));
  }
  return std::optional<core::PlacementTable>(*std::move(table));
}

absl::StatusOr<GroupRequests> BuildGroupRequests(const v1::DesiredState& state, int world) {
  RETURN_IF_ERROR(ValidateDesiredState(state));
  const v1::DesiredState full = WithDefaults(state);
  ASSIGN_OR_RETURN(core::ModelDescription model, ResolveModel(full.model()));
  if (model.num_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat("model: ", model.name, " has ",
                                                   model.num_experts, " experts, fewer than the ",
                                                   world, " ranks"));
  }
  GroupRequests out;
  v1::ConfigureLayersRequest& configure = out.configure;
  configure.mutable_layout()->set_tp_size(world);
  configure.mutable_layout()->set_attn_dp_size(world);
  configure.mutable_layout()->set_moe_dense_tp_size(1);
  configure.set_a2a_enabled(true);
  v1::ModelDescription* md = configure.mutable_model();
  md->set_name(model.name);
  md->set_hidden_size(model.hidden_size);
  md->set_num_layers(model.num_layers);
  md->set_num_experts(model.num_experts);
  md->set_top_k(model.top_k);
  md->set_moe_intermediate_size(model.moe_intermediate_size);
  for (bool b : model.sparse_layers) md->add_sparse_layers(b);

  v1::AllocateWorkspaceRequest& allocate = out.allocate;
  allocate.set_hidden_size(model.hidden_size);
  allocate.set_top_k(model.top_k);
  allocate.set_num_experts(model.num_experts);
  allocate.set_capacity_tokens(full.capacity_tokens());
  allocate.set_dispatch_dtype(full.dispatch_dtype());
  allocate.set_invalid_expert_id(v1::INVALID_EXPERT_ID_MINUS_ONE);

  allocate.set_redundant_slots_per_rank(full.redundant_slots_per_rank());

  const std::vector<int> sparse = model.SparseLayerIndices();
  ASSIGN_OR_RETURN(std::optional<core::PlacementTable> table,
                   DesiredPlacement(full, model.num_experts, world));
  if (table.has_value()) {
    for (int i = 0; i < full.layers(); ++i) {
      out.placements.push_back(MakeInstallPlacementRequest(sparse[i], *table));
    }
  }
  for (int i = 0; i < full.layers(); ++i) {
    v1::LoadExpertsRequest load;
    load.set_layer(sparse[i]);
    load.set_kind(full.experts().kind());
    load.set_seed(full.experts().seed());
    load.set_safetensors_path(full.experts().safetensors_path());
    load.set_name_pattern(full.experts().name_pattern());
    load.set_intermediate_size(model.moe_intermediate_size);
    if (model.shared_expert.present()) {
      load.mutable_shared_expert()->set_intermediate_size(model.shared_expert.intermediate_size);
      load.mutable_shared_expert()->set_sigmoid_gate(model.shared_expert.sigmoid_gate);
    }
    out.load.push_back(std::move(load));
  }
  return out;
}

}  // namespace moe_ep::client
