#pragma once

// The replies of the moe_ep.v1.Worker service (proto/moe_ep/v1/worker.proto):
// core/ results turned into response messages (issue 10 item 5: the service
// validates, calls, replies; the proto shapes of the replies live here).
//
// Pure functions; thread-safe. Source: DESIGN §5-§9.

#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/ep_contract.h"
#include "core/ep_dispatcher.h"
#include "core/layer_plan.h"
#include "moe_ep/v1/worker.pb.h"
#include "server/data_plane.h"

namespace moe_ep::server {

// FillPlanReply()
//
// ConfigureLayers' layers: one v1::LayerPlan per entry of `plan` (modes and
// the step names of core/layer_plan.h); replaces `response`'s contents.
// Returns the number of sparse layers.
int FillPlanReply(const std::vector<core::LayerPlan>& plan, v1::ConfigureLayersResponse* response);

// AllocationReply()
//
// AllocateWorkspace's reply for `options` and what the data plane holds:
// bytes per token of dispatch and combine, the FlashInfer-compatible
// workspace, the allocated bytes and regions, the capacity.
// Errors: those of core::DispatchBytesPerToken / ComputeFlashInferWorkspace.
absl::StatusOr<v1::AllocateWorkspaceResponse> AllocationReply(
    const core::EpDispatcherOptions& options, const DataPlaneAllocation& held);

// FillForwardReply()
//
// Forward's timings (phase times of `step`, `total` wall time), R and the
// token and byte counters; the output tensor is set by the caller.
void FillForwardReply(const core::StepStats& step, absl::Duration total,
                      v1::ForwardResponse* response);

// FillBenchmarkReply()
//
// Benchmark's p50/p99 of dispatch and combine (core/percentile.h) and its
// logical bytes and GB/s: every token copy this rank sent, the local share
// included, times the bf16 bytes per token of `options`.
absl::Status FillBenchmarkReply(const core::EpDispatcherOptions& options, BenchmarkTimes times,
                                v1::BenchmarkResponse* response);

}  // namespace moe_ep::server
