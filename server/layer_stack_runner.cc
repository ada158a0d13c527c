#include "server/layer_stack_runner.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/types/span.h"
#include "core/agreement.h"
#include "core/bf16.h"
#include "core/dp_padding.h"
#include "core/status_macros.h"
#include "core/stop_check.h"
#include "server/request_options.h"
#include "server/tensor_codec.h"

#ifdef MOE_EP_HAVE_CUDA
#include "kernels/staged_step_executor.h"
#endif

namespace moe_ep::server {
namespace {

// kMaxHidden, kMaxExperts and kMaxTokens: server/request_options.h's.
constexpr int64_t kMaxIntermediate = int64_t{1} << 24;
constexpr int64_t kMaxCapacity = int64_t{1} << 24;
constexpr float kDefaultRmsEps = 1e-6f;
constexpr absl::string_view kStopHint =
    "send it again with a longer deadline, fewer layers (stack.num_layers) or smaller sizes";

// The fields of a resolved stack spec the ranks vote on (issue 12 item 2).
std::vector<core::BallotField> StackFields(const core::LayerStackConfig& c, int64_t epoch) {
  uint32_t eps_bits = 0;
  std::memcpy(&eps_bits, &c.rms_eps, sizeof(eps_bits));
  return {{"epoch", epoch},
          {"stack.num_layers", static_cast<int64_t>(c.sparse_layers.size())},
          {"stack.hidden_size", c.hidden},
          {"stack.dense_intermediate_size", c.dense_intermediate},
          {"stack.moe_intermediate_size", c.moe_intermediate},
          {"stack.num_experts", c.num_experts},
          {"stack.top_k", c.top_k},
          {"stack.seed", static_cast<int64_t>(c.seed)},
          {"stack.rms_eps (bits)", eps_bits},
          {"stack.allow_reduce_scatter", c.allow_reduce_scatter ? 1 : 0},
          {"stack.capacity_tokens", c.capacity_tokens}};
}

uint64_t ConfigFingerprint(const core::LayerStackConfig& c) {
  uint32_t eps_bits = 0;
  std::memcpy(&eps_bits, &c.rms_eps, sizeof(eps_bits));
  std::string sparse;
  for (bool s : c.sparse_layers) sparse.push_back(s ? 'S' : 'D');
  return core::Fingerprint64(absl::StrCat(
      "tp=", c.layout.tp_size, ",attn_dp=", c.layout.attn_dp_size,
      ",dense_tp=", c.layout.effective_moe_dense_tp_size(), ",layers=", sparse,
      ",a2a=", c.a2a_enabled, ",H=", c.hidden, ",dense_I=", c.dense_intermediate,
      ",moe_I=", c.moe_intermediate, ",E=", c.num_experts, ",K=", c.top_k, ",seed=", c.seed,
      ",eps=", eps_bits, ",rs=", c.allow_reduce_scatter, ",N=", c.capacity_tokens));
}

// `spec_value` unless 0, else `model_value`; kInvalidArgument when both are 0,
// either is negative or above `max`, or both are set and differ.
absl::StatusOr<int64_t> SpecOrModel(const char* field, const char* model_field, int64_t spec_value,
                                    int64_t model_value, int64_t max) {
  if (spec_value < 0 || spec_value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("stack.", field, ": expected in [0, ", max, "], got ", spec_value));
  }
  if (spec_value > 0 && model_value > 0 && spec_value != model_value) {
    return absl::InvalidArgumentError(absl::StrCat("stack.", field, ": expected ", model_value,
                                                   " (the configured model.", model_field,
                                                   ") or 0, got ", spec_value));
  }
  const int64_t value = spec_value > 0 ? spec_value : model_value;
  if (value < 1 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat("stack.", field, ": required (the configured model has no ", model_field,
                     "); expected in [1, ", max, "], got ", value));
  }
  return value;
}

// The tokens tensor as fp32 [n, H].
absl::StatusOr<DecodedTensor<float>> DecodeTokens(const v1::Tensor& tensor, int64_t hidden) {
  DecodedTensor<float> tokens;
  if (tensor.dtype() == v1::DTYPE_BF16) {
    ASSIGN_OR_RETURN(DecodedTensor<core::bf16_t> bf16, DecodeBf16(tensor, "tokens", 2));
    tokens.shape = bf16.shape;
    tokens.values.resize(bf16.values.size());
    for (size_t i = 0; i < bf16.values.size(); ++i) {
      tokens.values[i] = core::Bf16ToFloat(bf16.values[i]);
    }
  } else {
    ASSIGN_OR_RETURN(tokens, DecodeFloat32(tensor, "tokens", 2));
  }
  if (tokens.shape[1] != hidden) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens.shape[1]: expected ", hidden, " (the stack's hidden size), got ", tokens.shape[1]));
  }
  if (tokens.shape[0] > kMaxTokens) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens.shape[0]: expected <= ", kMaxTokens, ", got ", tokens.shape[0]));
  }
  return tokens;
}

// The executor of the stack's communication steps on `groups`: the device
// executor on NCCL groups, the host executor on Gloo groups.
absl::StatusOr<std::unique_ptr<core::StepExecutor>> MakeStepExecutor(
    const core::ParallelGroups& groups, int64_t hidden) {
  if (groups.world().backend() == "nccl") {
#ifdef MOE_EP_HAVE_CUDA
    ASSIGN_OR_RETURN(std::unique_ptr<kernels::StagedStepExecutor> device,
                     kernels::StagedStepExecutor::Create(groups, hidden));
    return std::unique_ptr<core::StepExecutor>(std::move(device));
#else
    return absl::FailedPreconditionError(
        "ForwardLayers: NCCL groups need a CUDA build (the device step executor)");
#endif
  }
  return std::unique_ptr<core::StepExecutor>(
      std::make_unique<core::HostStepExecutor>(&groups, hidden));
}

}  // namespace

absl::StatusOr<core::LayerStackConfig> ResolveLayerStackConfig(
    const v1::LayerStackSpec& spec, const core::ParallelLayout& layout,
    const std::vector<bool>& sparse_layers, bool a2a_enabled, const v1::ModelDescription& model) {
  const int configured = static_cast<int>(sparse_layers.size());
  if (spec.num_layers() < 0 || spec.num_layers() > configured) {
    return absl::InvalidArgumentError(absl::StrCat("stack.num_layers: expected in [0, ", configured,
                                                   "] (0 = all configured layers), got ",
                                                   spec.num_layers()));
  }
  core::LayerStackConfig c;
  c.layout = layout;
  const int num_layers = spec.num_layers() > 0 ? spec.num_layers() : configured;
  c.sparse_layers.assign(sparse_layers.begin(), sparse_layers.begin() + num_layers);
  c.a2a_enabled = a2a_enabled;
  ASSIGN_OR_RETURN(c.hidden, SpecOrModel("hidden_size", "hidden_size", spec.hidden_size(),
                                         model.hidden_size(), kMaxHidden));
  const bool any_sparse =
      std::find(c.sparse_layers.begin(), c.sparse_layers.end(), true) != c.sparse_layers.end();
  const bool any_dense =
      std::find(c.sparse_layers.begin(), c.sparse_layers.end(), false) != c.sparse_layers.end();
  // Expert sizes: required only when a sparse layer runs.
  if (any_sparse) {
    ASSIGN_OR_RETURN(
        c.moe_intermediate,
        SpecOrModel("moe_intermediate_size", "moe_intermediate_size", spec.moe_intermediate_size(),
                    model.moe_intermediate_size(), kMaxIntermediate));
  }
  ASSIGN_OR_RETURN(int64_t experts, SpecOrModel("num_experts", "num_experts", spec.num_experts(),
                                                model.num_experts(), kMaxExperts));
  ASSIGN_OR_RETURN(int64_t top_k,
                   SpecOrModel("top_k", "top_k", spec.top_k(), model.top_k(), kMaxExperts));
  c.num_experts = static_cast<int>(experts);
  c.top_k = static_cast<int>(top_k);
  const int64_t dense_i = spec.dense_intermediate_size();
  if (dense_i < 0 || dense_i > kMaxIntermediate) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stack.dense_intermediate_size: expected in [0, ", kMaxIntermediate, "], got ", dense_i));
  }
  if (dense_i == 0 && any_dense) {
    return absl::InvalidArgumentError(
        "stack.dense_intermediate_size: required (a multiple of tp_size) when a dense layer runs");
  }
  c.dense_intermediate = dense_i > 0 ? dense_i : layout.tp_size;
  c.seed = spec.seed();
  if (!(spec.rms_eps() >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("stack.rms_eps: expected >= 0 (0 = 1e-6), got ", spec.rms_eps()));
  }
  c.rms_eps = spec.rms_eps() > 0.0f ? spec.rms_eps() : kDefaultRmsEps;
  c.allow_reduce_scatter = spec.allow_reduce_scatter();
  if (spec.capacity_tokens() < 0 || spec.capacity_tokens() > kMaxCapacity) {
    return absl::InvalidArgumentError(
        absl::StrCat("stack.capacity_tokens: expected in [0, ", kMaxCapacity,
                     "] (0 = ", kDefaultStackCapacityTokens, "), got ", spec.capacity_tokens()));
  }
  c.capacity_tokens =
      spec.capacity_tokens() > 0 ? spec.capacity_tokens() : kDefaultStackCapacityTokens;
  absl::Status valid = core::ValidateLayerStackConfig(c);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("stack: ", valid.message()));
  return c;
}

void LayerStackRunner::Configure(const core::ParallelLayout& layout,
                                 std::vector<bool> sparse_layers, bool a2a_enabled,
                                 const v1::ModelDescription& model) {
  configured_ = true;
  layout_ = layout;
  sparse_layers_ = std::move(sparse_layers);
  a2a_enabled_ = a2a_enabled;
  model_ = model;
  stale_ = true;
}

void LayerStackRunner::Reset() {
  stack_.reset();
  groups_.reset();
  configured_ = false;
  sparse_layers_.clear();
  model_.Clear();
  built_fingerprint_ = 0;
  stale_ = true;
  built_generation_ = 0;
  held_bytes_ = 0;
  builds_ = 0;
}

absl::Status LayerStackRunner::Run(core::ControlCollective& world, int64_t generation,
                                   const CallBound& call, const VoteFn& vote,
                                   const v1::ForwardLayersRequest& request,
                                   int64_t memory_cap_bytes, int64_t other_held_bytes,
                                   v1::ForwardLayersResponse* response) {
  const absl::Time start = absl::Now();
  if (!configured_) {
    return absl::FailedPreconditionError("ForwardLayers requires ConfigureLayers first");
  }
  if (generation != built_generation_) {
    // A stack of an older group must not outlive it; tags restart per group.
    stack_.reset();
    groups_.reset();
    held_bytes_ = 0;
    builds_ = 0;
    built_generation_ = generation;
  }

  // 1. Local checks (no state changes).
  struct Prepared {
    core::LayerStackConfig config;
    DecodedTensor<float> tokens;
    uint64_t fingerprint = 0;
    int64_t bytes = 0;
  };
  auto prepare = [&]() -> absl::StatusOr<Prepared> {
    Prepared p;
    if (request.epoch() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("epoch: expected >= 0, got ", request.epoch()));
    }
    ASSIGN_OR_RETURN(p.config, ResolveLayerStackConfig(request.stack(), layout_, sparse_layers_,
                                                       a2a_enabled_, model_));
    ASSIGN_OR_RETURN(p.tokens, DecodeTokens(request.tokens(), p.config.hidden));
    p.fingerprint = ConfigFingerprint(p.config);
    ASSIGN_OR_RETURN(p.bytes, core::EstimateLayerStackBytes(p.config, world.rank()));
    const bool reuse = stack_ != nullptr && !stale_ && built_fingerprint_ == p.fingerprint;
    if (!reuse && memory_cap_bytes > 0 && other_held_bytes + p.bytes > memory_cap_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "ForwardLayers: the layer stack needs ", p.bytes, " bytes (weights and all-to-all ",
          "workspace) on top of ", other_held_bytes, " held, more than the memory cap of ",
          memory_cap_bytes, " bytes (--memory-cap-bytes)"));
    }
    return p;
  };
  absl::StatusOr<Prepared> prepared = prepare();

  // 2. The vote (identity, local status, the stack spec field by field),
  // then whether any rank needs a build.
  const bool ok = prepared.ok();
  RETURN_IF_ERROR(vote(prepared.status(), ok ? StackFields(prepared->config, request.epoch())
                                             : std::vector<core::BallotField>{}));
  const bool needs_build =
      stack_ == nullptr || stale_ || built_fingerprint_ != prepared->fingerprint;
  ASSIGN_OR_RETURN(std::vector<int64_t> builds, core::AllGatherInt64(world, needs_build ? 1 : 0));
  const bool any_build =
      std::any_of(builds.begin(), builds.end(), [](int64_t b) { return b != 0; });

  // 3. Build when any rank needs it (all ranks together: Split is collective).
  // Call gates (server/call_gate.h) before and after it: a stop keeps the
  // previous stack (the new one is dropped).
  const int num_layers = static_cast<int>(prepared->config.sparse_layers.size());
  int64_t build_us = 0;
  if (any_build) {
    const absl::Time build_start = absl::Now();
    RETURN_IF_ERROR(
        CallGate(world, call, "ForwardLayers: before the layer-stack build", kStopHint));
    const std::string tag = absl::StrCat("layer_stack.gen", generation, ".build", ++builds_);
    ASSIGN_OR_RETURN(std::unique_ptr<core::ParallelGroups> groups,
                     core::ParallelGroups::Create(&world, prepared->config.layout, tag));
    ASSIGN_OR_RETURN(std::unique_ptr<core::StepExecutor> executor,
                     MakeStepExecutor(*groups, prepared->config.hidden));
    // A layer's weights stop early once the call is past its deadline or
    // cancelled (call.Expired latches it); the next gate then stops every
    // rank (core::DistributedLayerStack::Create; server/call_gate.h).
    absl::StatusOr<std::unique_ptr<core::DistributedLayerStack>> stack =
        core::DistributedLayerStack::Create(
            groups.get(), prepared->config, std::move(executor),
            [&](int layer) {
              return CallGate(
                  world, call,
                  absl::StrCat("ForwardLayers: building layer ", layer, " of ", num_layers),
                  kStopHint);
            },
            call.StopCheck());
    if (!stack.ok() && !core::IsLocalStop(stack.status())) return stack.status();
    // After a local stop in the last layer the peers wait here: this gate
    // stops them all.
    RETURN_IF_ERROR(CallGate(
        world, call,
        absl::StrCat("ForwardLayers: after the layer-stack build, before layer 0 of ", num_layers),
        kStopHint));
    RETURN_IF_ERROR(stack.status());
    stack_ = *std::move(stack);
    groups_ = std::move(groups);
    built_fingerprint_ = prepared->fingerprint;
    stale_ = false;
    held_bytes_ = prepared->bytes;
    build_us = absl::ToInt64Microseconds(absl::Now() - build_start);
  }

  // 4. The layers.
  const absl::Time forward_start = absl::Now();
  const int64_t n = prepared->tokens.shape[0];
  ASSIGN_OR_RETURN(std::vector<float> output,
                   stack_->Forward(prepared->tokens.values, n, [&](int layer) {
                     return CallGate(world, call,
                                     absl::StrCat("ForwardLayers: before layer ", layer, " of ",
                                                  num_layers, " (layers 0-", layer - 1, " ran)"),
                                     kStopHint);
                   }));
  const int64_t forward_us = absl::ToInt64Microseconds(absl::Now() - forward_start);

  response->Clear();
  const std::vector<int64_t> shape = {n, prepared->config.hidden};
  *response->mutable_output() = EncodeFloat32(output, shape);
  v1::ForwardLayersTimings* timings = response->mutable_timings();
  timings->set_build_us(build_us);
  timings->set_forward_us(forward_us);
  timings->set_total_us(absl::ToInt64Microseconds(absl::Now() - start));
  response->set_rebuilt(any_build);
  response->set_dp_rank(groups_->dp_rank());
  response->set_attn_tp_rank(groups_->attn_tp_rank());
  const core::DpGatherLayout& dp = stack_->last_layout();
  response->set_padding_mode(core::DpPaddingModeName(dp.mode));
  response->set_global_rows(dp.global_rows);
  response->set_local_rows(dp.local_rows);
  for (core::AfterMlpOp op : stack_->last_after_mlp_ops()) {
    response->add_after_mlp_ops(core::StepName(op));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::server
