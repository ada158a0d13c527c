// The in-process data calls of the CPU data plane (server/data_plane.h,
// DataPlane::Engine*; DESIGN §14): core::EpDispatcher on the caller's host
// buffers. Dispatch copies the received rows out of the workspace into the
// caller's [E, rows, ...] buffers (the workspace stays the dispatcher's, so a
// later step cannot overwrite what the caller still reads); combine packs the
// caller's expert outputs as the combine payload (EpDispatcher::
// SetExpertOutputs) and runs Combine.
//
// Every call opens with the engine call round (core/engine_call_round.h,
// issue 30): all of a call's own checks (arguments, call order, geometry,
// loaded experts) run first and their verdict goes into the round, so the
// ranks either all move the call's payload or all return with nothing moved
// and the same Gloo operation count; no rank can fail between the round and
// the payload.

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/status_macros.h"
#include "server/cpu_data_plane.h"
#include "server/engine_call_checks.h"

namespace moe_ep::server {
namespace {

// The call-independent checks: a workspace (never missing once the worker
// is ready for steps) and a null stream.
absl::Status CheckHostCall(const char* call, void* stream) {
  if (stream != nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": stream must be null on the CPU data plane (host memory over Gloo)"));
  }
  return absl::OkStatus();
}

absl::Status RequireWorkspace(const core::EpDispatcher* dispatcher, const char* call) {
  if (dispatcher == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": no workspace; AllocateWorkspace first"));
  }
  return absl::OkStatus();
}

// The call order (DESIGN §7: idle -> dispatched -> idle) and a committed
// geometry that holds `num_tokens` (< 0: not a step's tokens).
absl::Status CheckStepStart(const core::EpDispatcher& d, const char* call, int rank,
                            int64_t num_tokens) {
  if (d.step_in_flight()) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": a dispatch is in flight on rank ", rank,
                     ": call combine first (one step at a time: dispatch, then combine)"));
  }
  if (d.epoch() < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": no committed geometry on rank ", rank,
                     "; call moe_ep_sync_token_counts and moe_ep_commit_geometry first"));
  }
  if (num_tokens < 0 || num_tokens > d.runtime_max_tokens_per_rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, ": num_tokens: expected in [0, R = ", d.runtime_max_tokens_per_rank(),
        "] (the committed runtime_max_tokens_per_rank) on rank ", rank, ", got ", num_tokens));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CpuDataPlane::EngineSyncTokenCounts(const int64_t* local_tokens, int64_t* counts,
                                                 void* stream) {
  const char* call = core::EngineCallName(core::EngineCall::kSyncTokenCounts);
  absl::Status local = CheckHostCall(call, stream);
  if (local.ok() && local_tokens == nullptr) {
    local = absl::InvalidArgumentError(absl::StrCat(call, ": local_tokens must not be null"));
  }
  if (local.ok() && *local_tokens < 0) {
    local =
        absl::InvalidArgumentError(absl::StrCat(call, ": local_tokens: expected >= 0, got ",
                                                *local_tokens, " (rank ", control_->rank(), ")"));
  }
  core::EngineCallTicket ticket;
  ticket.call = core::EngineCall::kSyncTokenCounts;
  ticket.value = local.ok() ? *local_tokens : 0;
  std::vector<int64_t> values;
  RETURN_IF_ERROR(engine_round_.Open(*control_, ticket, local, &values));
  if (counts != nullptr) std::copy(values.begin(), values.end(), counts);
  return absl::OkStatus();
}

absl::StatusOr<core::StepStats> CpuDataPlane::EngineDispatch(
    const void* hidden, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
    const EngineRecvBuffers& out, void* stream) {
  const core::EngineCall kind =
      out.end_step ? core::EngineCall::kDispatchOnly : core::EngineCall::kDispatch;
  const char* call = core::EngineCallName(kind);
  RETURN_IF_ERROR(RequireWorkspace(dispatcher_.get(), call));
  const int64_t h = options_.workspace.hidden;
  const int k = options_.workspace.top_k;
  const int me = control_->rank();
  absl::Status local = CheckHostCall(call, stream);
  if (local.ok()) local = CheckStepStart(*dispatcher_, call, me, num_tokens);
  if (local.ok()) {
    local = CheckEngineRecvBuffers(call, me, out, dispatcher_->runtime_max_tokens_per_rank(),
                                   book_.contiguous()->NumSlots(me));
  }
  if (local.ok()) local = CheckEngineInputs(call, me, num_tokens, hidden, topk_ids, topk_weights);
  // Engine-run experts are the contiguous placement's (EngineRecvBuffers).
  if (local.ok()) local = dispatcher_->SetPlacement(book_.contiguous());
  core::EngineCallTicket ticket;
  ticket.call = kind;
  ticket.epoch = dispatcher_->epoch();
  ticket.runtime_max_tokens_per_rank = dispatcher_->runtime_max_tokens_per_rank();
  RETURN_IF_ERROR(engine_round_.Open(*control_, ticket, local, nullptr));
  // Every rank is in this dispatch: the expert ids are checked in the
  // dispatcher's own agreement round (core::ValidateExpertIds).
  const int64_t t = num_tokens;
  RETURN_IF_ERROR(dispatcher_->Dispatch(
      absl::MakeConstSpan(static_cast<const core::bf16_t*>(hidden), t * h),
      absl::MakeConstSpan(topk_ids, t * k), absl::MakeConstSpan(topk_weights, t * k), t));
  engine_tokens_ = num_tokens;
  // No layer to count for (DataPlane::ReadExpertLoad).
  dispatcher_->ReadExpertLoad(/*reset=*/true);

  const int e = options_.workspace.ep_size;
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(options_.num_experts, e));
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
  // An exchange: every rank ends this step here (the ticket's call said so).
  if (out.end_step) RETURN_IF_ERROR(dispatcher_->ReleaseStep());
  return dispatcher_->last_step();
}

absl::StatusOr<core::StepStats> CpuDataPlane::EngineCombine(const void* expert_out, int64_t rows,
                                                            void* output, void* stream) {
  const char* call = core::EngineCallName(core::EngineCall::kCombine);
  RETURN_IF_ERROR(RequireWorkspace(dispatcher_.get(), call));
  const int64_t h = options_.workspace.hidden;
  const int64_t e = options_.workspace.ep_size;
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  absl::Status local = CheckHostCall(call, stream);
  if (local.ok() && !dispatcher_->step_in_flight()) {
    local = absl::FailedPreconditionError(
        absl::StrCat(call, ": combine needs a dispatch first: no dispatched step on rank ",
                     control_->rank(), " (call moe_ep_dispatch, then combine its step once)"));
  }
  if (local.ok()) {
    local =
        CheckEngineCombineArgs(call, control_->rank(), rows, r, expert_out, output, engine_tokens_);
    if (!local.ok()) {
      local = absl::Status(local.code(), absl::StrCat(local.message(),
                                                      "; the step stays dispatched on every "
                                                      "rank: call again"));
    }
  }
  core::EngineCallTicket ticket;
  ticket.call = core::EngineCall::kCombine;
  ticket.epoch = dispatcher_->epoch();
  ticket.runtime_max_tokens_per_rank = r;
  RETURN_IF_ERROR(engine_round_.Open(*control_, ticket, local, nullptr));
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
  const char* call = core::EngineCallName(core::EngineCall::kForward);
  RETURN_IF_ERROR(RequireWorkspace(dispatcher_.get(), call));
  const int64_t h = options_.workspace.hidden;
  const int k = options_.workspace.top_k;
  const int me = control_->rank();
  absl::Status local = CheckHostCall(call, stream);
  if (local.ok()) local = CheckStepStart(*dispatcher_, call, me, num_tokens);
  if (local.ok()) local = CheckEngineInputs(call, me, num_tokens, hidden, topk_ids, topk_weights);
  if (local.ok()) local = CheckEngineOutput(call, me, num_tokens, output);
  if (local.ok() && !experts_.Has(layer)) {
    local = ExpertsNotLoaded(call, layer);
  }
  core::EngineCallTicket ticket;
  ticket.call = core::EngineCall::kForward;
  ticket.epoch = dispatcher_->epoch();
  ticket.runtime_max_tokens_per_rank = dispatcher_->runtime_max_tokens_per_rank();
  ticket.layer = layer;
  RETURN_IF_ERROR(engine_round_.Open(*control_, ticket, local, nullptr));
  const int64_t t = num_tokens;
  return StepOnHost(layer, absl::MakeConstSpan(static_cast<const core::bf16_t*>(hidden), t * h),
                    absl::MakeConstSpan(topk_ids, t * k), absl::MakeConstSpan(topk_weights, t * k),
                    num_tokens, absl::MakeSpan(static_cast<core::bf16_t*>(output), t * h));
}

}  // namespace moe_ep::server
