#include "client/service/coordinator_cli.h"

#include <algorithm>
#include <chrono>
#include <memory>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/cli_validators.h"
#include "client/coordinator.h"
#include "client/desired_state.h"
#include "client/grpc_status.h"
#include "client/proto_json.h"
#include "client/text_table.h"
#include "core/status_macros.h"
#include "grpcpp/client_context.h"
#include "moe_ep/v1/coordinator.grpc.pb.h"

namespace moe_ep::client {
namespace {

constexpr size_t kErrorColumnWidth = 70;

// "READY" of RANK_STATE_READY, "MASKED" of GROUP_PHASE_MASKED.
std::string Short(const std::string& name, const std::string& prefix) {
  return name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
}

std::string Ago(int64_t since_unix_ms, absl::Time now) {
  if (since_unix_ms <= 0) return "-";
  const double s = std::max(0.0, absl::ToDoubleSeconds(now - absl::FromUnixMillis(since_unix_ms)));
  return s < 120 ? absl::StrFormat("%.1f s", s) : absl::StrFormat("%.0f min", s / 60);
}

std::string UtcTime(int64_t unix_ms) {
  return absl::FormatTime("%Y-%m-%d %H:%M:%E3S", absl::FromUnixMillis(unix_ms),
                          absl::UTCTimeZone());
}

// A stub of the coordinator at options.target, with its credentials.
absl::StatusOr<std::unique_ptr<v1::Coordinator::Stub>> Connect(
    const CoordinatorClientOptions& options) {
  if (options.target.empty()) {
    return absl::InvalidArgumentError("--target: expected the coordinator's host:port, got \"\"");
  }
  CoordinatorOptions channel;
  ASSIGN_OR_RETURN(channel.channel_credentials, MakeClientChannelCredentials(options.security));
  return v1::Coordinator::NewStub(MakeWorkerChannel(options.target, channel));
}

// A gRPC failure as a Status that names the call and the target; an
// UNIMPLEMENTED answer says the address serves no coordinator.
absl::Status CallError(const char* rpc, const std::string& target, const grpc::Status& status) {
  const absl::Status s = ToAbslStatus(status);
  if (s.code() == absl::StatusCode::kUnimplemented) {
    return absl::UnimplementedError(
        absl::StrCat(target,
                     " serves no moe_ep.v1.Coordinator (a worker? use `moe-ep status "
                     "--targets ",
                     target, "`)"));
  }
  return absl::Status(s.code(),
                      absl::StrCat("Coordinator.", rpc, " on ", target, ": ", s.message()));
}

std::chrono::system_clock::time_point Deadline(const CoordinatorClientOptions& options) {
  return std::chrono::system_clock::now() + absl::ToChronoMilliseconds(options.rpc_timeout);
}

}  // namespace

std::string RenderGroupStatus(const std::string& target, const v1::GetGroupResponse& g, int events,
                              absl::Time now) {
  std::string out = absl::StrCat("coordinator ", target, ": phase ",
                                 Short(v1::GroupPhase_Name(g.phase()), "GROUP_PHASE_"),
                                 ", generation ", g.generation(), ", desired state version ",
                                 g.desired_version(), ", ", g.ranks_size(), " ranks\n");
  absl::StrAppendFormat(&out,
                        "formations %d, failed attempts %d; last formation %.2f s (load %.2f s), "
                        "last recovery %.2f s\n",
                        g.formations(), g.failed_attempts(), g.last_form_seconds(),
                        g.last_load_seconds(), g.last_recovery_seconds());
  if (g.phase() == v1::GROUP_PHASE_BACKING_OFF && g.next_attempt_unix_ms() > 0) {
    absl::StrAppend(&out, "next attempt at ", UtcTime(g.next_attempt_unix_ms()), " UTC\n");
  }
  if (g.masked_ranks_size() > 0) {
    absl::StrAppend(&out, "masked ranks [", absl::StrJoin(g.masked_ranks(), ","), "] (mask round ",
                    g.mask_round(), ", policy ", v1::RankLossPolicy_Name(g.rank_loss_policy()), ")",
                    g.lost_experts_size() > 0
                        ? absl::StrCat("; experts with no live replica: [",
                                       absl::StrJoin(g.lost_experts(), ","), "]")
                        : std::string(),
                    "\n");
  }
  if (!g.last_error().empty()) absl::StrAppend(&out, "last error: ", g.last_error(), "\n");
  TextTable table({"rank", "target", "state", "worker", "since", "why not READY"});
  table.SetMaxWidth(5, kErrorColumnWidth);
  for (const v1::RankView& r : g.ranks()) {
    table.AddRow({absl::StrCat(r.rank()), r.target(),
                  Short(v1::RankState_Name(r.state()), "RANK_STATE_"),
                  r.worker_generation() > 0 || r.worker_state() != v1::WORKER_STATE_UNSPECIFIED
                      ? absl::StrCat("gen ", r.worker_generation(), " ",
                                     Short(v1::WorkerState_Name(r.worker_state()), "WORKER_STATE_"))
                      : std::string("-"),
                  Ago(r.since_unix_ms(), now), r.last_error().empty() ? "-" : r.last_error()});
  }
  if (g.ranks_size() > 0) out += table.Render();
  const int shown = std::min(events, g.history_size());
  if (shown > 0) {
    absl::StrAppend(&out, "events (newest last, UTC):\n");
    for (int i = g.history_size() - shown; i < g.history_size(); ++i) {
      const v1::GroupEvent& e = g.history(i);
      absl::StrAppend(&out, "  ", UtcTime(e.time_unix_ms()), "  gen ", e.generation(), "  ",
                      e.kind(), e.rank() >= 0 ? absl::StrCat(" rank ", e.rank()) : "", ": ",
                      e.message(), "\n");
    }
  }
  return out;
}

absl::Status RunCoordinatorStatus(const CoordinatorClientOptions& options, std::ostream& out) {
  ASSIGN_OR_RETURN(std::unique_ptr<v1::Coordinator::Stub> stub, Connect(options));
  grpc::ClientContext context;
  context.set_deadline(Deadline(options));
  v1::GetGroupResponse group;
  const grpc::Status status = stub->GetGroup(&context, v1::GetGroupRequest(), &group);
  if (!status.ok()) return CallError("GetGroup", options.target, status);
  if (options.json) {
    out << ProtoToJson(group).dump(2) << "\n";
  } else {
    out << RenderGroupStatus(options.target, group, options.events, absl::Now());
  }
  return absl::OkStatus();
}

absl::Status RunCoordinatorApply(const CoordinatorClientOptions& options, std::ostream& out) {
  if (options.state_file.empty()) {
    return absl::InvalidArgumentError(
        "--state: apply needs the desired state file (the JSON of moe_ep.v1.DesiredState)");
  }
  v1::ApplyRequest request;
  ASSIGN_OR_RETURN(*request.mutable_desired(), ReadDesiredStateFile(options.state_file));
  ASSIGN_OR_RETURN(std::unique_ptr<v1::Coordinator::Stub> stub, Connect(options));
  grpc::ClientContext context;
  context.set_deadline(Deadline(options));
  v1::ApplyResponse response;
  const grpc::Status status = stub->Apply(&context, request, &response);
  if (!status.ok()) return CallError("Apply", options.target, status);
  if (options.json) {
    out << ProtoToJson(response).dump(2) << "\n";
  } else if (response.changed()) {
    out << "applied " << options.state_file << ": desired state version "
        << response.desired_version()
        << "; the group is formed anew in the background (moe-ep coordinator status --target "
        << options.target << ")\n";
  } else {
    out << "unchanged: " << options.state_file << " is the desired state in force (version "
        << response.desired_version() << "); nothing is re-formed\n";
  }
  return absl::OkStatus();
}

absl::Status RunCoordinatorDrain(const CoordinatorClientOptions& options, std::ostream& out) {
  ASSIGN_OR_RETURN(std::unique_ptr<v1::Coordinator::Stub> stub, Connect(options));
  grpc::ClientContext context;
  context.set_deadline(Deadline(options));
  v1::DrainResponse response;
  const grpc::Status status = stub->Drain(&context, v1::DrainRequest(), &response);
  if (!status.ok()) return CallError("Drain", options.target, status);
  if (options.json) {
    out << ProtoToJson(response).dump(2) << "\n";
    return absl::OkStatus();
  }
  if (response.unreachable_size() == 0) {
    out << "drained: every rank left the group; the coordinator forms nothing until the next "
           "apply\n";
  } else {
    out << "drained, but " << response.unreachable_size()
        << " rank(s) could not be reached to leave:\n";
    for (const std::string& u : response.unreachable()) out << "  " << u << "\n";
  }
  return absl::OkStatus();
}

void AddCoordinatorClientCommands(CLI::App* coordinator, CoordinatorClientOptions* options,
                                  std::function<absl::Status()>* action, std::ostream* out) {
  const auto common = [options](CLI::App* cmd) {
    cmd->add_option("--target", options->target, "host:port of the coordinator's --listen")
        ->capture_default_str();
    AddSecurityFlags(cmd, &options->security);
    cmd->add_flag("--json", options->json, "print the answer as JSON");
  };
  CLI::App* status =
      coordinator->add_subcommand("status", "show a running coordinator's group (GetGroup)");
  common(status);
  status->add_option("--events", options->events, "show the newest N events")
      ->capture_default_str()
      ->check(NonNegative());
  status->callback([=] { *action = [=] { return RunCoordinatorStatus(*options, *out); }; });

  CLI::App* apply = coordinator->add_subcommand(
      "apply", "give a running coordinator a new desired state (Apply)");
  common(apply);
  apply->add_option("--state", options->state_file, "desired state: moe_ep.v1.DesiredState JSON")
      ->required();
  apply->callback([=] { *action = [=] { return RunCoordinatorApply(*options, *out); }; });

  CLI::App* drain = coordinator->add_subcommand(
      "drain", "make a running coordinator's workers leave the group, give the lease back (Drain)");
  common(drain);
  drain->callback([=] { *action = [=] { return RunCoordinatorDrain(*options, *out); }; });
}

}  // namespace moe_ep::client
