// The in-process data calls of the CPU data plane (server/data_plane.h,
// DataPlane::Engine*; DESIGN §14): core::EpDispatcher on the caller's host
// buffers. Dispatch copies the received rows out of the workspace into the
// caller's [E, rows, ...] buffers (the workspace stays the dispatcher's, so a
// later step cannot overwrite what the caller still reads); combine packs the
// caller's expert outputs as the combine payload (EpDispatcher::
// SetExpertOutputs) and runs Combine.

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/status_macros.h"
#include "server/cpu_data_plane.h"

namespace moe_ep::server {
namespace {

absl::Status RequireHostCall(const core::EpDispatcher* dispatcher, const char* call, void* stream) {
  if (dispatcher == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": no workspace; AllocateWorkspace first"));
  }
  if (stream != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": stream must be null on the CPU data plane (host memory over Gloo)"));
  }
  return absl::OkStatus();
}

// The caller's receive buffers for a step of R rows per source.
absl::Status CheckRecvBuffers(const EngineRecvBuffers& out, int64_t runtime_max) {
  if (out.rows < runtime_max) {
    return absl::InvalidArgumentError(absl::StrCat(
        "received rows: ", out.rows, " rows per source, the committed R is ", runtime_max));
  }
  if (out.source_counts == nullptr || out.expert_counts == nullptr) {
    return absl::InvalidArgumentError(
        "received buffers: source_counts and expert_counts must not be null");
  }
  if (out.rows > 0 &&
      (out.hidden == nullptr || out.topk_ids == nullptr || out.topk_weights == nullptr)) {
    return absl::InvalidArgumentError(
        "received buffers: hidden, topk_ids and topk_weights must not be null when rows > 0");
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<core::StepStats> CpuDataPlane::EngineDispatch(
    const void* hidden, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
    const EngineRecvBuffers& out, void* stream) {
  RETURN_IF_ERROR(RequireHostCall(dispatcher_.get(), "dispatch", stream));
  const int64_t h = options_.workspace.hidden;
  const int k = options_.workspace.top_k;
  const int64_t t = std::max<int64_t>(num_tokens, 0);
  absl::Status local = CheckRecvBuffers(out, dispatcher_->runtime_max_tokens_per_rank());
  if (local.ok() && t > 0 &&
      (hidden == nullptr || topk_ids == nullptr || topk_weights == nullptr)) {
    local = absl::InvalidArgumentError(
        "hidden, topk_ids, topk_weights: must not be null when num_tokens > 0");
  }
  const bool inputs = local.ok() && t > 0;
  // Engine-run experts are the contiguous placement's (EngineRecvBuffers).
  RETURN_IF_ERROR(dispatcher_->SetPlacement(book_.contiguous()));
  RETURN_IF_ERROR(dispatcher_->Dispatch(
      absl::MakeConstSpan(static_cast<const core::bf16_t*>(hidden), inputs ? t * h : 0),
      absl::MakeConstSpan(topk_ids, inputs ? t * k : 0),
      absl::MakeConstSpan(topk_weights, inputs ? t * k : 0), local.ok() ? num_tokens : 0, local));
  engine_tokens_ = num_tokens;
  // No layer to count for (DataPlane::ReadExpertLoad).
  dispatcher_->ReadExpertLoad(/*reset=*/true);

  const int e = options_.workspace.ep_size;
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(options_.num_experts, e));
  const int me = collective_->rank();
  const int first = placement.FirstExpert(me);
  const int local_experts = placement.NumLocalExperts(me);
  std::fill_n(out.expert_counts, local_experts, 0);
  for (int s = 0; s < e; ++s) {
    const int64_t count = dispatcher_->received_counts()[s];
    out.source_counts[s] = count;
    core::bf16_t* row_hidden = out.hidden + s * out.rows * h;
    int32_t* row_ids = out.topk_ids + s * out.rows * k;
    float* row_weights = out.topk_weights + s * out.rows * k;
    // Rows [0, R) are the workspace's, padding already sanitized there.
    std::copy_n(dispatcher_->ReceivedHidden(s).data(), r * h, row_hidden);
    std::copy_n(dispatcher_->ReceivedIds(s).data(), r * k, row_ids);
    std::copy_n(dispatcher_->ReceivedWeights(s).data(), r * k, row_weights);
    std::memset(row_hidden + r * h, 0, (out.rows - r) * h * sizeof(core::bf16_t));
    std::fill(row_ids + r * k, row_ids + out.rows * k, options_.invalid_expert_id);
    std::fill(row_weights + r * k, row_weights + out.rows * k, 0.0f);
    for (int64_t i = 0; i < count * k; ++i) {
      const int32_t id = row_ids[i];
      if (id >= first && id < first + local_experts) ++out.expert_counts[id - first];
    }
  }
  return dispatcher_->last_step();
}

absl::StatusOr<core::StepStats> CpuDataPlane::EngineCombine(const void* expert_out, int64_t rows,
                                                            void* output, void* stream) {
  RETURN_IF_ERROR(RequireHostCall(dispatcher_.get(), "combine", stream));
  const int64_t h = options_.workspace.hidden;
  if ((expert_out == nullptr && rows > 0) || (output == nullptr && engine_tokens_ > 0)) {
    return absl::InvalidArgumentError(
        "combine: expert_out must not be null when rows > 0, output not when the step has "
        "tokens");
  }
  const int64_t e = options_.workspace.ep_size;
  RETURN_IF_ERROR(dispatcher_->SetExpertOutputs(
      absl::MakeConstSpan(static_cast<const core::bf16_t*>(expert_out),
                          rows > 0 ? e * rows * h : 0),
      rows));
  RETURN_IF_ERROR(
      dispatcher_->Combine(absl::MakeSpan(static_cast<core::bf16_t*>(output), engine_tokens_ * h)));
  return dispatcher_->last_step();
}

absl::StatusOr<core::StepStats> CpuDataPlane::EngineForward(int layer, const void* hidden,
                                                            const int32_t* topk_ids,
                                                            const float* topk_weights,
                                                            int64_t num_tokens, void* output,
                                                            void* stream) {
  RETURN_IF_ERROR(RequireHostCall(dispatcher_.get(), "forward", stream));
  const int64_t h = options_.workspace.hidden;
  const int k = options_.workspace.top_k;
  // A null buffer becomes an empty span: the dispatcher rejects its size in
  // the agreement round, so the peers abort instead of waiting for this rank.
  const bool given =
      hidden != nullptr && topk_ids != nullptr && topk_weights != nullptr && output != nullptr;
  const int64_t t = given ? std::max<int64_t>(num_tokens, 0) : 0;
  return Forward(layer, absl::MakeConstSpan(static_cast<const core::bf16_t*>(hidden), t * h),
                 absl::MakeConstSpan(topk_ids, t * k), absl::MakeConstSpan(topk_weights, t * k),
                 num_tokens, absl::MakeSpan(static_cast<core::bf16_t*>(output), t * h));
}

}  // namespace moe_ep::server
