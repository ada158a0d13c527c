// The placement and load-statistics RPCs of the Worker service (DESIGN §15;
// issue 17 items 1-2): InstallPlacement and GetExpertLoad. The service is
// glue: check the request (server/request_options.h), vote on the table's
// fingerprint across ranks, install it in the data plane.

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/expert_source.h"
#include "core/status_macros.h"
#include "server/request_options.h"
#include "server/worker_service.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {

// ---------------------------------------------------------- InstallPlacement

grpc::Status WorkerService::InstallPlacement(grpc::ServerContext* context,
                                             const v1::InstallPlacementRequest* request,
                                             v1::InstallPlacementResponse* response) {
  return FinishCollective(RunGuarded("InstallPlacement", [&] {
    return Leased("InstallPlacement", request->lease(), [&](const absl::Status& refused) {
      return DoInstallPlacement(context, *request, refused, response);
    });
  }));
}

absl::StatusOr<core::PlacementTable> WorkerService::PreparePlacement(
    const v1::InstallPlacementRequest& request) {
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "InstallPlacement"));
  return PlacementFromRequest(options_.limits, request, plan_, allocation_->options,
                              session_.args().world_size);
}

absl::Status WorkerService::DoInstallPlacement(grpc::ServerContext* context,
                                               const v1::InstallPlacementRequest& request,
                                               const absl::Status& refused,
                                               v1::InstallPlacementResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(
      EnterLeasedGroup(slot, context, "InstallPlacement", WorkerPhase::kAllocated, refused));
  // A lease refusal (issue 12) is this rank's own error in the vote.
  absl::StatusOr<core::PlacementTable> table =
      refused.ok() ? PreparePlacement(request) : absl::StatusOr<core::PlacementTable>(refused);
  // Every rank votes on (layer, fingerprint) before any rank installs: a
  // rank whose table is invalid answers with its error and its peers with
  // kAborted naming it; differing tables abort every rank, naming each
  // rank's fingerprint (core/agreement.h).
  RETURN_IF_ERROR(session_.Vote(
      "InstallPlacement", table.status(),
      table.ok() ? PlacementFields(request.layer(), *table) : std::vector<core::BallotField>{}));
  const int layer = request.layer();
  const bool had_experts = session_.plane()->HasExperts(layer);
  const int64_t old_bytes = session_.plane()->ExpertBytes(layer);
  auto installed = std::make_shared<const core::PlacementTable>(*std::move(table));
  RETURN_IF_ERROR(session_.plane()->InstallPlacement(layer, installed));
  const bool dropped = had_experts && !session_.plane()->HasExperts(layer);
  if (dropped) expert_bytes_ -= old_bytes;
  response->set_fingerprint(installed->Fingerprint());
  response->set_num_slots(installed->num_slots());
  const std::vector<int>& mine = installed->SlotExperts(session_.args().rank);
  response->mutable_slot_experts()->Assign(mine.begin(), mine.end());
  response->set_experts_dropped(dropped);
  spdlog::debug("InstallPlacement: layer {}, {} slots, this rank holds {} slots{}", layer,
                installed->num_slots(), mine.size(),
                dropped ? "; the layer's experts were dropped (load them again)" : "");
  absl::MutexLock lock(&state_mu_);
  status_.set_expert_bytes(expert_bytes_);
  return absl::OkStatus();
}

// ------------------------------------------------------------- GetExpertLoad

grpc::Status WorkerService::GetExpertLoad(grpc::ServerContext* context,
                                          const v1::GetExpertLoadRequest* request,
                                          v1::GetExpertLoadResponse* response) {
  return Finish(
      RunGuarded("GetExpertLoad", [&] { return DoGetExpertLoad(context, *request, response); }));
}

absl::Status WorkerService::DoGetExpertLoad(grpc::ServerContext* context,
                                            const v1::GetExpertLoadRequest& request,
                                            v1::GetExpertLoadResponse* response) {
  if (request.layer() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("layer: expected >= 0, got ", request.layer()));
  }
  // Local, but the counters belong to the holder of the slot.
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(slot.Acquire(context, "GetExpertLoad"));
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "GetExpertLoad"));
  ASSIGN_OR_RETURN(core::ExpertLoadCounts counts,
                   session_.plane()->ReadExpertLoad(request.layer(), request.reset()));
  response->mutable_tokens_per_expert()->Assign(counts.tokens_per_expert.begin(),
                                                counts.tokens_per_expert.end());
  response->set_steps(counts.steps);
  response->set_placement_fingerprint(session_.plane()->Placement(request.layer())->Fingerprint());
  return absl::OkStatus();
}

void WorkerService::SetExpertTokensLocked(int layer, const std::vector<int64_t>& totals) {
  auto* all = status_.mutable_expert_tokens();
  int at = 0;
  while (at < all->size() && all->Get(at).layer() < layer) ++at;
  if (at == all->size() || all->Get(at).layer() != layer) {
    all->Add();
    // Move the new entry from the back to position `at`.
    for (int i = all->size() - 1; i > at; --i) all->SwapElements(i, i - 1);
    all->Mutable(at)->set_layer(layer);
  }
  all->Mutable(at)->mutable_tokens_per_expert()->Assign(totals.begin(), totals.end());
}

}  // namespace moe_ep::server
