#pragma once

// The ForwardLayers RPC of the Worker service (proto/moe_ep/v1/worker.proto):
// runs a core::DistributedLayerStack (core/layer_stack.h) under the layout,
// all-to-all switch and sparse pattern of ConfigureLayers, on the group's
// world collective (the data plane's collective(): Gloo, or the host view of
// the NCCL group). The layers' communication steps run on the host executor
// for Gloo and on the device executor (kernels::StagedStepExecutor) for NCCL
// (core/step_program.h; issue 11); the stand-in compute and the MoE dispatch
// run on the host over the world collective either way. The stack, and the
// core::ParallelGroups it runs on, are built lazily on the first call after
// Configure() and rebuilt when the configuration, the request's stack spec or
// the group generation changes.
//
// One call, on every rank:
//   1. checks the request by itself and against the configuration (sizes,
//      the tokens tensor [n, H] fp32/bf16, the memory cap);
//   2. votes through the caller's `vote` (the Worker service's cross-rank
//      vote, core/agreement.h) with its local status and the stack spec field
//      by field, so every rank learns whether every other rank accepted its
//      request and got the same one: a rank with a bad request returns its
//      own error, its peers kAborted naming it; ranks with different requests
//      all return kAborted naming the field. Nobody has built or run anything
//      at that point, and the collectives stay in step, so the group stays
//      usable. Then one all-gather of "needs a build" per rank;
//   3. builds (when any rank needs it: all ranks build together) the sub-group
//      under the tag "layer_stack.gen<generation>.build<b>" (Gloo store keys
//      are write-once, so every build gets a fresh tag), the step executor
//      and the stack;
//   4. runs DistributedLayerStack::Forward.
// Steps 3 and 4 pass call gates (server/call_gate.h, see Run): once any rank
// is past its call's deadline or cancelled, all ranks stop at the same gate
// with kDeadlineExceeded / kCancelled naming it, and the group stays usable.
// Errors leave the runner as it was (a failed build keeps the previous stack).
//
// Not thread-safe: the Worker service calls it under its collective slot.
// Source: DESIGN §2-§4, §8; issue 4 ("A layer-stack forward RPC").

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/agreement.h"
#include "core/collective.h"
#include "core/layer_plan.h"
#include "core/layer_stack.h"
#include "core/layer_stack_memory.h"
#include "core/parallel_groups.h"
#include "moe_ep/v1/worker.pb.h"
#include "server/call_gate.h"

namespace moe_ep::server {

// The capacity a ForwardLayers spec gets when capacity_tokens is 0.
inline constexpr int64_t kDefaultStackCapacityTokens = 1024;

// ResolveLayerStackConfig()
//
// The core::LayerStackConfig of `spec` under the configured `layout`,
// `sparse_layers` ([configured layers]), `a2a_enabled` and `model`
// (ConfigureLayers.model; its 0 fields mean "not given"). Zero fields of
// `spec` take the model's value (see LayerStackSpec in worker.proto); the
// first spec.num_layers (0 = all) entries of `sparse_layers` run.
// Errors (kInvalidArgument naming "stack.<field>", expected vs got): a size
// unset in both spec and model, negative, or beyond the worker's limits
// (H <= 2^20, I <= 2^24, experts <= 2^16, capacity <= 2^24); a spec size that
// differs from a non-zero model size; num_layers outside [0, configured];
// dense_intermediate_size unset while a dense layer runs; rms_eps < 0; and
// core::ValidateLayerStackConfig's errors (num_experts < tp_size, top_k >
// num_experts, dense I not a multiple of tp_size, ...).
// Pure and thread-safe.
absl::StatusOr<core::LayerStackConfig> ResolveLayerStackConfig(
    const v1::LayerStackSpec& spec, const core::ParallelLayout& layout,
    const std::vector<bool>& sparse_layers, bool a2a_enabled, const v1::ModelDescription& model);

class LayerStackRunner {
 public:
  // The cross-rank vote Run takes part in: this rank's local status and its
  // spec fields in, the vote's result out (core::RunVote's contract).
  using VoteFn =
      std::function<absl::Status(absl::Status local, std::vector<core::BallotField> fields)>;

  // Records the configuration of ConfigureLayers (the stack is rebuilt on
  // the next Run). Does no communication.
  void Configure(const core::ParallelLayout& layout, std::vector<bool> sparse_layers,
                 bool a2a_enabled, const v1::ModelDescription& model);
  // Drops the configuration and the stack (Leave / re-Join). Must run before
  // the world collective the stack was built on is destroyed.
  void Reset();

  bool configured() const { return configured_; }
  // Bytes the built stack holds (core::EstimateLayerStackBytes); 0 when none.
  int64_t held_bytes() const { return held_bytes_; }

  // Run()
  //
  // One ForwardLayers call (see the file comment) on `world` (this rank's
  // group of generation `generation`, rank world.rank()); `vote` runs over
  // `world` exactly once once the runner is configured. `memory_cap_bytes`
  // (0 = unlimited) bounds `other_held_bytes` (workspace and experts the
  // worker already holds) plus the stack's core::EstimateLayerStackBytes.
  // Call gates over `world` for `call` (server/call_gate.h): before, within
  // ("ForwardLayers: building layer <l> of <n>", l >= 1) and after a build
  // ("ForwardLayers: before the layer-stack build", "... after the
  // layer-stack build, before layer 0 of <n>") and before each
  // layer l >= 1 ("ForwardLayers: before layer <l> of <n> (layers 0-<l-1>
  // ran)"). None writes a response; a stop at the build's gates keeps the
  // previous stack (a stop between layers keeps the one just built).
  // REQUIRES: configured(). A collective over `world`.
  // Errors: as ForwardLayers in worker.proto: kInvalidArgument,
  // kResourceExhausted, kAborted, the gates' kDeadlineExceeded / kCancelled,
  // and the collective's and the stack's errors.
  absl::Status Run(core::ControlCollective& world, int64_t generation, const CallBound& call,
                   const VoteFn& vote, const v1::ForwardLayersRequest& request,
                   int64_t memory_cap_bytes, int64_t other_held_bytes,
                   v1::ForwardLayersResponse* response);

 private:
  bool configured_ = false;
  core::ParallelLayout layout_;
  std::vector<bool> sparse_layers_;
  bool a2a_enabled_ = true;
  v1::ModelDescription model_;

  // The built stack, the configuration it was built from (its fingerprint)
  // and the generation of the world it runs on. `stack_` points into
  // `groups_`, which points into the world collective.
  std::unique_ptr<core::ParallelGroups> groups_;
  std::unique_ptr<core::DistributedLayerStack> stack_;
  uint64_t built_fingerprint_ = 0;
  bool stale_ = true;  // Configure() since the last build: rebuild on the next Run
  int64_t built_generation_ = 0;
  int64_t held_bytes_ = 0;
  // Builds in this generation (part of the sub-group's Gloo tag).
  int64_t builds_ = 0;
};

}  // namespace moe_ep::server
