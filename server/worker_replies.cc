#include "server/worker_replies.h"

#include <utility>

#include "core/percentile.h"
#include "core/status_macros.h"
#include "core/workspace.h"

namespace moe_ep::server {
namespace {

v1::ScatterMode ToProto(core::ScatterMode mode) {
  switch (mode) {
    case core::ScatterMode::kScattered:
      return v1::SCATTER_MODE_SCATTERED;
    case core::ScatterMode::kTpAttnFull:
      return v1::SCATTER_MODE_TP_ATTN_FULL;
    case core::ScatterMode::kFull:
      return v1::SCATTER_MODE_FULL;
  }
  return v1::SCATTER_MODE_UNSPECIFIED;
}

}  // namespace

int FillPlanReply(const std::vector<core::LayerPlan>& plan, v1::ConfigureLayersResponse* response) {
  response->Clear();
  int num_sparse = 0;
  for (const core::LayerPlan& p : plan) {
    v1::LayerPlan* out = response->add_layers();
    out->set_layer(p.layer);
    out->set_sparse(p.sparse);
    out->set_input_mode(ToProto(p.input));
    out->set_attention_mode(ToProto(p.attention));
    out->set_residual_mode(ToProto(p.residual));
    out->set_mlp_mode(ToProto(p.mlp));
    out->set_output_mode(ToProto(p.output));
    out->set_before_attention(core::StepName(p.before_attention));
    out->set_before_mlp(core::DescribeBeforeMlp(p));
    out->set_after_mlp(core::DescribeAfterMlp(p));
    num_sparse += p.sparse ? 1 : 0;
  }
  return num_sparse;
}

absl::StatusOr<v1::AllocateWorkspaceResponse> AllocationReply(
    const core::EpDispatcherOptions& options, const DataPlaneAllocation& held) {
  const core::WorkspaceSpec& ws = options.workspace;
  ASSIGN_OR_RETURN(int64_t dispatch_bytes,
                   core::DispatchBytesPerToken(ws.dtype, ws.hidden, ws.top_k));
  ASSIGN_OR_RETURN(core::FlashInferWorkspace flashinfer, core::ComputeFlashInferWorkspace(ws));
  v1::AllocateWorkspaceResponse out;
  out.set_dispatch_bytes_per_token(dispatch_bytes);
  out.set_combine_bytes_per_token(core::CombineBytesPerToken(ws.hidden));
  out.set_flashinfer_workspace_bytes(flashinfer.total_bytes);
  out.set_flashinfer_aux_bytes(flashinfer.aux_bytes);
  out.set_allocated_bytes(held.allocated_bytes);
  for (const core::WorkspaceRegion& region : held.regions) {
    v1::WorkspaceRegion* r = out.add_regions();
    r->set_name(region.name);
    r->set_offset_bytes(region.offset_bytes);
    r->set_size_bytes(region.size_bytes);
  }
  out.set_capacity_tokens(ws.capacity_tokens);
  out.set_max_slots_per_rank(core::SlotBudgetPerRank(options));
  return out;
}

void FillForwardReply(const core::StepStats& step, absl::Duration total,
                      v1::ForwardResponse* response) {
  v1::ForwardTimings* timings = response->mutable_timings();
  timings->set_dispatch_us(step.dispatch_us);
  timings->set_expert_us(step.expert_us);
  timings->set_combine_us(step.combine_us);
  timings->set_shared_expert_us(step.shared_us);
  timings->set_shared_overlap_us(step.shared_overlap_us);
  timings->set_total_us(absl::ToInt64Microseconds(total));
  response->set_runtime_max_tokens_per_rank(step.runtime_max_tokens_per_rank);
  response->set_tokens_sent(step.tokens_sent);
  response->set_bytes_sent(step.bytes_sent_remote);
  response->set_tokens_received(step.tokens_received);
  response->mutable_lost_experts()->Assign(step.lost_experts.begin(), step.lost_experts.end());
  response->set_lost_choices(step.lost_choices);
}

absl::Status FillBenchmarkReply(const core::EpDispatcherOptions& options, BenchmarkTimes times,
                                v1::BenchmarkResponse* response) {
  const int64_t hidden = options.workspace.hidden;
  ASSIGN_OR_RETURN(
      int64_t dispatch_per_token,
      core::DispatchBytesPerToken(core::DispatchDType::kBF16, hidden, options.workspace.top_k));
  const core::LatencySummary dispatch = core::Summarize(times.dispatch_us);
  const core::LatencySummary combine = core::Summarize(times.combine_us);
  response->set_data_plane(times.data_plane);
  response->set_dispatch_p50_us(dispatch.p50_us);
  response->set_dispatch_p99_us(dispatch.p99_us);
  response->set_combine_p50_us(combine.p50_us);
  response->set_combine_p99_us(combine.p99_us);
  const int64_t dispatch_bytes = times.tokens_sent * dispatch_per_token;
  const int64_t combine_bytes = times.tokens_sent * core::CombineBytesPerToken(hidden);
  response->set_dispatch_bytes(dispatch_bytes);
  response->set_combine_bytes(combine_bytes);
  const double d50 = dispatch.p50_us;
  const double c50 = combine.p50_us;
  response->set_dispatch_logical_gbps(d50 > 0 ? dispatch_bytes / (d50 * 1e3) : 0.0);
  response->set_combine_logical_gbps(c50 > 0 ? combine_bytes / (c50 * 1e3) : 0.0);
  return absl::OkStatus();
}

}  // namespace moe_ep::server
