// Step 7 of `moe-ep run` (client/run_job_steps.h): the steps, with the
// kill, the restart and the rebalance at their steps.

#include "client/run_job_steps.h"

#include <algorithm>
#include <csignal>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/coordinator.h"
#include "client/expert_rebalance.h"
#include "client/local_cluster.h"
#include "client/placement_request.h"
#include "client/run_masks.h"
#include "client/tensor_message.h"
#include "core/status_macros.h"

namespace moe_ep::client::run_job_internal {
namespace {

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// After step --rebalance-after: every run layer's counts so far (read and
// reset), an EPLB table for the slot budget, installed, the layer's experts
// loaded again for the new slots.
absl::StatusOr<std::vector<LayerRebalance>> RebalanceRunLayers(
    Coordinator& coordinator, const std::vector<int>& layers, int num_experts, int world,
    int redundant, const std::function<v1::LoadExpertsRequest(int)>& load_request,
    std::ostream& out) {
  ASSIGN_OR_RETURN(core::PlacementTable contiguous,
                   core::PlacementTable::Contiguous(num_experts, world));
  std::vector<LayerRebalance> done;
  for (int layer : layers) {
    v1::GetExpertLoadRequest read;
    read.set_layer(layer);
    read.set_reset(true);
    ASSIGN_OR_RETURN(std::vector<v1::GetExpertLoadResponse> load, coordinator.GetExpertLoad(read));
    ASSIGN_OR_RETURN(std::vector<double> tokens, SumExpertLoad(load, num_experts));
    ASSIGN_OR_RETURN(core::PlacementTable table, RebalanceForBudget(tokens, world, redundant));
    LayerRebalance l;
    l.layer = layer;
    ASSIGN_OR_RETURN(l.before, BalanceOf(contiguous, tokens));
    ASSIGN_OR_RETURN(l.predicted, BalanceOf(table, tokens));
    l.slots_per_rank = table.NumSlots(0);
    l.redundant_slots_per_rank = redundant;
    l.fingerprint = table.Fingerprint();
    for (int r = 0; r < world; ++r) l.slot_experts.push_back(table.SlotExperts(r));
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(
        coordinator.InstallPlacement(MakeInstallPlacementRequest(layer, table)).status());
    RETURN_IF_ERROR(coordinator.LoadExperts(load_request(layer)).status());
    out << absl::StrFormat(
        "rebalance: layer %d, EPLB table %016x (%d slots on %d ranks) installed and experts "
        "reloaded in %.2f s; max/mean tokens per rank %.4f -> %.4f predicted\n",
        layer, l.fingerprint, table.num_slots(), world, Seconds(absl::Now() - start),
        l.before.ratio(), l.predicted.ratio());
    done.push_back(l);
  }
  out.flush();
  return done;
}

// The counts of the steps after the rebalance, under each layer's new table.
absl::Status ReadLoadAfterRebalance(Coordinator& coordinator, int num_experts,
                                    std::vector<LayerRebalance>* layers) {
  for (LayerRebalance& l : *layers) {
    v1::GetExpertLoadRequest read;
    read.set_layer(l.layer);
    read.set_reset(true);
    ASSIGN_OR_RETURN(std::vector<v1::GetExpertLoadResponse> load, coordinator.GetExpertLoad(read));
    ASSIGN_OR_RETURN(std::vector<double> tokens, SumExpertLoad(load, num_experts));
    ASSIGN_OR_RETURN(core::PlacementTable table,
                     core::PlacementTable::FromSlotExperts(num_experts, l.slot_experts));
    ASSIGN_OR_RETURN(l.after, BalanceOf(table, tokens));
  }
  return absl::OkStatus();
}

// Before step s (--restart-at-step): the killed worker again, on its
// address; re-admitted at this step boundary with the group's set-up
// (client/coordinator.h RejoinRank). Returns when the restart began.
absl::StatusOr<absl::Time> RestartKilledRank(const RunJobOptions& options, RunJobState& job, int s,
                                             std::vector<bool>& live, std::ostream& out) {
  const absl::Time restarted = absl::Now();
  RETURN_IF_ERROR(job.workers.cluster->Restart(options.kill_rank));
  ASSIGN_OR_RETURN(v1::RejoinResponse rejoined,
                   job.coordinator().RejoinRank(options.kill_rank, job.setup));
  live[options.kill_rank] = true;
  job.coordinator().SetStepRanks(live);
  job.result.masks.rejoin_ms = absl::ToDoubleMilliseconds(absl::Now() - restarted);
  out << absl::StrFormat(
      "rank %d: restarted and re-admitted before step %d in %.0f ms (mask round %d, masked "
      "now [%s])\n",
      options.kill_rank, s + 1, job.result.masks.rejoin_ms, rejoined.mask_round(),
      absl::StrJoin(rejoined.masked_ranks(), ","));
  return restarted;
}

// Before step s (--kill-at-step): SIGKILL to worker --kill-rank; the steps
// from here on are sent to the others. Returns when the kill was sent.
absl::StatusOr<absl::Time> KillRank(const RunJobOptions& options, RunJobState& job, int s,
                                    std::vector<bool>& live, std::ostream& out) {
  const absl::Time killed = absl::Now();
  RETURN_IF_ERROR(job.workers.cluster->Kill(options.kill_rank, SIGKILL));
  live[options.kill_rank] = false;
  job.coordinator().SetStepRanks(live);
  MaskRunSummary& masks = job.result.masks;
  masks.kill_rank = options.kill_rank;
  masks.kill_at_step = options.kill_at_step;
  masks.restart_at_step = options.restart_at_step;
  masks.lost_experts = LostExperts(*job.mask_table, live);
  out << "rank " << options.kill_rank << ": killed (SIGKILL) before step " << s + 1
      << "; experts with no live replica: [" << absl::StrJoin(masks.lost_experts, ",") << "]\n";
  return killed;
}

// One Forward of run layer li in step s (epoch s + 1, geometry R): each
// rank's input x[r] and routing go out, recorded; the outputs come back
// into the record and x becomes the residual stream x + moe(x) of the live
// ranks. Returns the call's wall time in seconds.
absl::StatusOr<double> ForwardLayer(RunJobState& job, int s, int li, int64_t R,
                                    const std::vector<bool>& live,
                                    std::vector<std::vector<core::bf16_t>>& x,
                                    std::set<int>& reported_lost) {
  const int world = job.world;
  const int64_t H = job.model.hidden_size;
  const int K = job.model.top_k;
  const int layer = job.run_layers[li];
  const int64_t epoch = s + 1;
  std::vector<v1::ForwardRequest> requests(world);
  for (int r = 0; r < world; ++r) {
    RankStep& rs = job.record[li][s][r];
    rs.num_tokens = job.counts[s][r];
    rs.input = x[r];
    rs.ids.resize(rs.num_tokens * K);
    rs.weights.resize(rs.num_tokens * K);
    RETURN_IF_ERROR(job.routing.Generate(layer, s, r, world, rs.num_tokens, absl::MakeSpan(rs.ids),
                                         absl::MakeSpan(rs.weights)));
    // The caller folds the routed scaling into the weights (DESIGN §7).
    if (job.model.routed_scaling_factor != 1.0) {
      for (float& w : rs.weights) w *= static_cast<float>(job.model.routed_scaling_factor);
    }
    requests[r].set_layer(layer);
    requests[r].set_epoch(epoch);
    *requests[r].mutable_hidden_states() = MakeBf16Tensor(rs.input, rs.num_tokens, H);
    *requests[r].mutable_topk_ids() = MakeInt32Tensor(rs.ids, rs.num_tokens, K);
    *requests[r].mutable_topk_weights() = MakeFp32Tensor(rs.weights, rs.num_tokens, K);
  }
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(std::vector<v1::ForwardResponse> responses, job.coordinator().Forward(requests));
  const double elapsed = Seconds(absl::Now() - start);
  LayerRunSummary& summary = job.result.layers[li];
  summary.forward_s += elapsed;
  summary.max_r = std::max(summary.max_r, R);
  int64_t step_dispatch = 0, step_shared = 0, step_overlap = 0;
  for (const v1::ForwardResponse& response : responses) {
    step_dispatch = std::max(step_dispatch, response.timings().dispatch_us());
    step_shared = std::max(step_shared, response.timings().shared_expert_us());
    step_overlap = std::max(step_overlap, response.timings().shared_overlap_us());
  }
  summary.dispatch_us += step_dispatch;
  summary.shared_us += step_shared;
  summary.shared_overlap_us += step_overlap;
  for (int r = 0; r < world; ++r) {
    RankStep& rs = job.record[li][s][r];
    if (!live[r]) continue;  // masked: no tokens, no reply
    for (int32_t e : responses[r].lost_experts()) reported_lost.insert(e);
    ASSIGN_OR_RETURN(
        rs.output,
        ReadBf16Tensor(responses[r].output(), absl::StrCat("rank ", r, " layer ", layer, " output"),
                       rs.num_tokens, H));
    summary.tokens += rs.num_tokens;
    summary.bytes_sent += responses[r].bytes_sent();
    // The residual stream: the next layer sees x + moe(x).
    for (size_t i = 0; i < x[r].size(); ++i) {
      x[r][i] = core::FloatToBf16(core::Bf16ToFloat(x[r][i]) + core::Bf16ToFloat(rs.output[i]));
    }
  }
  return elapsed;
}

// Step s (epoch s + 1) once: SyncTokenCounts -> R, CommitGeometry, then
// every run layer on seeded hidden states. Sets *R and the layers' times.
absl::Status ForwardStep(const RunJobOptions& options, RunJobState& job, int s,
                         const std::vector<bool>& live, std::set<int>& reported_lost, int64_t* R,
                         std::vector<std::string>* layer_times) {
  const int world = job.world;
  const std::vector<int64_t>& counts = job.counts[s];
  const int64_t epoch = s + 1;
  ASSIGN_OR_RETURN(TokenCountSync sync, job.coordinator().SyncTokenCounts(epoch, counts));
  if (sync.token_counts != counts) {
    return absl::InternalError(
        absl::StrCat("SyncTokenCounts epoch ", epoch, ": workers report counts [",
                     absl::StrJoin(sync.token_counts, ","), "], the coordinator sent [",
                     absl::StrJoin(counts, ","), "]"));
  }
  *R = sync.runtime_max_tokens_per_rank;
  RETURN_IF_ERROR(job.coordinator().CommitGeometry(epoch, *R, counts));
  std::vector<std::vector<core::bf16_t>> x(world);
  for (int r = 0; r < world; ++r) {
    x[r] = GenerateHidden(options.seed, s, r, counts[r], job.model.hidden_size);
  }
  layer_times->clear();
  for (int li = 0; li < options.num_layers; ++li) {
    ASSIGN_OR_RETURN(double elapsed, ForwardLayer(job, s, li, *R, live, x, reported_lost));
    layer_times->push_back(absl::StrFormat("layer %d %.2f s", job.run_layers[li], elapsed));
  }
  return absl::OkStatus();
}

// Step s: the restart and the kill due before it, the step (sent again to
// the survivors after the kill), the masked reference's dropped choices
// and the step's line.
absl::Status RunStep(const RunJobOptions& options, RunJobState& job, int s, std::vector<bool>& live,
                     std::set<int>& reported_lost, std::ostream& out) {
  const bool kills = job.kills;
  MaskRunSummary& masks = job.result.masks;
  absl::Time restarted;
  if (kills && s + 1 == options.restart_at_step) {
    ASSIGN_OR_RETURN(restarted, RestartKilledRank(options, job, s, live, out));
  }
  absl::Time killed;
  if (kills && s + 1 == options.kill_at_step) {
    ASSIGN_OR_RETURN(killed, KillRank(options, job, s, live, out));
  }
  int64_t R = 0;
  std::vector<std::string> layer_times;
  absl::Status stepped = ForwardStep(options, job, s, live, reported_lost, &R, &layer_times);
  if (kills && s + 1 == options.kill_at_step) {
    // The survivors' first calls fail while they mask the killed rank;
    // the step is sent again to them (bounded).
    int attempts = 1;
    while (!stepped.ok() && attempts < 8) {
      ++attempts;
      stepped = ForwardStep(options, job, s, live, reported_lost, &R, &layer_times);
    }
    masks.attempts = attempts;
    masks.kill_to_first_step_ms = absl::ToDoubleMilliseconds(absl::Now() - killed);
    if (stepped.ok()) {
      out << absl::StrFormat(
          "rank %d: masked by the survivors; step %d completed on them %.0f ms after the kill "
          "(%d attempt(s))\n",
          options.kill_rank, s + 1, masks.kill_to_first_step_ms, attempts);
    }
  }
  RETURN_IF_ERROR(stepped);
  if (kills && s + 1 == options.restart_at_step) {
    masks.restart_to_first_step_ms = absl::ToDoubleMilliseconds(absl::Now() - restarted);
  }
  if (MaskedStep(options, s)) {
    // The reference drops the lost experts' choices as the workers did.
    for (int li = 0; li < options.num_layers; ++li) {
      for (int r = 0; r < job.world; ++r) {
        DropLostChoices(masks.lost_experts, absl::MakeSpan(job.record[li][s][r].ids));
      }
    }
  }
  out << "step " << s + 1 << "/" << options.steps << ": tokens per rank ["
      << absl::StrJoin(job.counts[s], ", ") << "], R " << R << "; "
      << absl::StrJoin(layer_times, ", ") << "\n";
  out.flush();
  return absl::OkStatus();
}

}  // namespace

absl::Status RunSteps(const RunJobOptions& options, RunJobState& job, std::ostream& out) {
  const int world = job.world;
  job.record.assign(options.num_layers, std::vector<std::vector<RankStep>>(
                                            options.steps, std::vector<RankStep>(world)));
  std::vector<bool> live(world, true);
  std::set<int> reported_lost;
  const auto load_request = [&](int layer) { return RunLoadRequest(options, job, layer); };
  for (int s = 0; s < options.steps; ++s) {
    RETURN_IF_ERROR(RunStep(options, job, s, live, reported_lost, out));
    if (s + 1 == options.rebalance_after_steps) {
      ASSIGN_OR_RETURN(
          job.result.rebalance,
          RebalanceRunLayers(job.coordinator(), job.run_layers, job.model.num_experts, world,
                             options.redundant_slots_per_rank, load_request, out));
    }
  }
  RunJobResult& result = job.result;
  result.masks.reported_lost.assign(reported_lost.begin(), reported_lost.end());
  if (!result.rebalance.empty()) {
    RETURN_IF_ERROR(
        ReadLoadAfterRebalance(job.coordinator(), job.model.num_experts, &result.rebalance));
    out << RenderLoadTable(result.rebalance);
    out.flush();
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::client::run_job_internal
