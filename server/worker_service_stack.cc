// WorkerService::Benchmark and ForwardLayers (worker.proto; DESIGN §10,
// §3): the two RPCs that run more than one step per call, a synthetic load
// of one layer (server/benchmark_inputs.h) and a stack of decoder layers
// (server/layer_stack_runner.h). Both need every rank (no rank mask) and
// vote before anything moves.

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "server/benchmark_inputs.h"
#include "server/collective_slot.h"
#include "server/request_limits.h"
#include "server/worker_replies.h"
#include "server/worker_service.h"

namespace moe_ep::server {

// ---------------------------------------------------------------- Benchmark

grpc::Status WorkerService::Benchmark(grpc::ServerContext* context,
                                      const v1::BenchmarkRequest* request,
                                      v1::BenchmarkResponse* response) {
  return FinishCollective(
      RunGuarded("Benchmark", [&] { return DoBenchmark(context, *request, response); }));
}

absl::StatusOr<BenchmarkSpec> WorkerService::PrepareBenchmark(const v1::BenchmarkRequest& request) {
  ASSIGN_OR_RETURN(BenchmarkSpec spec,
                   BenchmarkFromRequest(options_.limits, request, session_.args().world_size));
  ASSIGN_OR_RETURN(core::AllocatedWorkspace needed,
                   core::ComputeAllocatedWorkspace(spec.options.workspace));
  RETURN_IF_ERROR(CheckBenchmarkFits(
      Budget(), needed.total_bytes,
      BenchmarkInputBytes(request.tokens_per_rank(), request.hidden_size(), request.top_k())));
  return spec;
}

absl::Status WorkerService::DoBenchmark(grpc::ServerContext* context,
                                        const v1::BenchmarkRequest& request,
                                        v1::BenchmarkResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "Benchmark", WorkerPhase::kJoined));
  absl::StatusOr<BenchmarkSpec> spec = PrepareBenchmark(request);
  // Naming the group's own plane is leaving data_plane empty: the ranks
  // vote alike ("" and "gloo" on a Gloo group were refused as different).
  if (spec.ok() && spec->data_plane == session_.plane()->data_plane()) spec->data_plane.clear();
  if (spec.ok()) {
    const absl::Status unmasked = session_.RequireNoMask("Benchmark");
    if (!unmasked.ok()) spec = unmasked;
  }
  RETURN_IF_ERROR(
      session_.Vote("Benchmark", spec.status(),
                    spec.ok() ? BenchmarkFields(*spec) : std::vector<core::BallotField>{}));
  const core::WorkspaceSpec& ws = spec->options.workspace;
  const BenchmarkInputs inputs =
      GenerateBenchmarkInputs(spec->seed, session_.args().rank, ws.capacity_tokens, ws.hidden,
                              ws.top_k, spec->options.num_experts, spec->routing);
  // Identity experts on a scratch dispatcher of the data plane (GPU: timed
  // with CUDA events on the stream; CPU: wall clock).
  absl::StatusOr<BenchmarkTimes> times =
      session_.plane()->Benchmark(spec->options, inputs, spec->warmup, spec->iterations,
                                  Budget().ScratchCap(), spec->data_plane);
  RETURN_IF_ERROR(session_.GroupResult("Benchmark", times.status()));
  return FillBenchmarkReply(spec->options, std::move(*times), response);
}

// ------------------------------------------------------------ ForwardLayers

grpc::Status WorkerService::ForwardLayers(grpc::ServerContext* context,
                                          const v1::ForwardLayersRequest* request,
                                          v1::ForwardLayersResponse* response) {
  return FinishCollective(
      RunGuarded("ForwardLayers", [&] { return DoForwardLayers(context, *request, response); }));
}

absl::Status WorkerService::DoForwardLayers(grpc::ServerContext* context,
                                            const v1::ForwardLayersRequest& request,
                                            v1::ForwardLayersResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "ForwardLayers", WorkerPhase::kConfigured));
  // The request is checked inside the runner, which votes through `vote`
  // before anything moves (server/layer_stack_runner.h).
  absl::Status local = RequirePhase(WorkerPhase::kConfigured, "ForwardLayers");
  if (local.ok()) local = CheckForwardLayers(options_.limits, request);
  if (local.ok()) local = session_.RequireNoMask("ForwardLayers");
  // Vote handles its own group errors (a mask round, or a broken group):
  // a failed vote's status must not reach GroupResult, which would start
  // another round for it.
  bool vote_failed = false;
  const LayerStackRunner::VoteFn vote = [&](absl::Status runner_local,
                                            std::vector<core::BallotField> fields) {
    absl::Status voted = session_.Vote(
        "ForwardLayers", local.ok() ? std::move(runner_local) : local, std::move(fields));
    vote_failed = !voted.ok();
    return voted;
  };
  if (!local.ok()) return vote(local, {});
  const MemoryBudget budget = Budget();
  absl::Status ran = session_.layer_stack().Run(session_.plane()->collective(),
                                                session_.args().generation, session_.call(), vote,
                                                request, budget.cap_bytes, budget.held(), response);
  if (vote_failed) return ran;
  return session_.GroupResult("ForwardLayers", std::move(ran));
}

}  // namespace moe_ep::server
