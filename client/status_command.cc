#include "client/status_command.h"

#include "absl/strings/str_cat.h"
#include "client/coordinator.h"
#include "client/targets.h"
#include "client/text_table.h"
#include "core/status_macros.h"

namespace moe_ep::client {

std::string WorkerStateName(moe_ep::v1::WorkerState state) {
  switch (state) {
    case moe_ep::v1::WORKER_STATE_STARTED:
      return "STARTED";
    case moe_ep::v1::WORKER_STATE_JOINED:
      return "JOINED";
    case moe_ep::v1::WORKER_STATE_CONFIGURED:
      return "CONFIGURED";
    case moe_ep::v1::WORKER_STATE_ALLOCATED:
      return "ALLOCATED";
    default:
      return "UNSPECIFIED";
  }
}

std::string RenderWorkerTable(
    const std::vector<std::string>& targets,
    const std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>>& statuses) {
  TextTable table({"rank", "address", "state", "backend", "device", "memory", "workspace",
                   "experts", "epoch", "R", "forwards", "errors"});
  for (size_t i = 0; i < statuses.size(); ++i) {
    const std::string target = i < targets.size() ? targets[i] : "?";
    if (!statuses[i].ok()) {
      table.AddRow({"-", target, "UNREACHABLE", "-", "-", "-", "-", "-", "-", "-", "-",
                    statuses[i].status().ToString()});
      continue;
    }
    const auto& s = *statuses[i];
    const bool joined = s.state() != moe_ep::v1::WORKER_STATE_STARTED &&
                        s.state() != moe_ep::v1::WORKER_STATE_UNSPECIFIED;
    table.AddRow({joined ? absl::StrCat(s.rank(), "/", s.world_size()) : "-", target,
                  WorkerStateName(s.state()), s.backend().empty() ? "-" : s.backend(),
                  s.device_name().empty() ? "-" : s.device_name(),
                  s.device_memory_bytes() > 0 ? FormatBytes(s.device_memory_bytes()) : "-",
                  FormatBytes(s.workspace_bytes()), FormatBytes(s.expert_bytes()),
                  absl::StrCat(s.geometry_epoch()), absl::StrCat(s.runtime_max_tokens_per_rank()),
                  absl::StrCat(s.counters().forwards()), absl::StrCat(s.counters().errors())});
  }
  return table.Render();
}

absl::Status RunStatusCommand(const std::string& targets_text, std::ostream& out) {
  return RunStatusCommand(targets_text, CoordinatorOptions(), out);
}

absl::Status RunStatusCommand(const std::string& targets_text, const CoordinatorOptions& options,
                              std::ostream& out) {
  ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(targets_text));
  ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
                   Coordinator::Connect(targets, options));
  const auto statuses = coordinator->StatusEach();
  out << RenderWorkerTable(targets, statuses);
  int unreachable = 0;
  for (const auto& s : statuses) unreachable += s.ok() ? 0 : 1;
  if (unreachable > 0) {
    return absl::UnavailableError(
        absl::StrCat(unreachable, " of ", targets.size(), " workers did not answer"));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::client
