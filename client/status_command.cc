#include "client/status_command.h"

#include <chrono>
#include <map>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "client/coordinator.h"
#include "client/proto_json.h"
#include "client/targets.h"
#include "client/text_table.h"
#include "core/status_macros.h"
#include "grpcpp/client_context.h"
#include "moe_ep/v1/coordinator.grpc.pb.h"

namespace moe_ep::client {
namespace {

constexpr size_t kErrorColumnWidth = 60;
constexpr size_t kLeaseColumnWidth = 40;
constexpr size_t kNoteWidth = 100;

// The lease column (issue 12): "-" when none, else "<owner> (<t> s left)".
std::string LeaseCell(const moe_ep::v1::GetStatusResponse& s) {
  if (s.lease_owner().empty()) return "-";
  return absl::StrFormat("%s (%.1f s left)", s.lease_owner(),
                         static_cast<double>(s.lease_remaining_ms()) / 1000.0);
}

// The error and hint of a failed row, its own address replaced by
// "<address>" so that workers repeating one error compare equal.
std::string ErrorText(const absl::Status& error, const WorkerErrorView& view,
                      const std::string& target) {
  std::string text = absl::StrReplaceAll(error.ToString(), {{target, "<address>"}});
  if (!view.hint.empty()) absl::StrAppend(&text, " (hint: ", view.hint, ")");
  return text;
}

}  // namespace

std::string GroupState(const moe_ep::v1::GetStatusResponse& s) {
  if (s.state() == moe_ep::v1::WORKER_STATE_STARTED ||
      s.state() == moe_ep::v1::WORKER_STATE_UNSPECIFIED) {
    return "none";
  }
  if (s.group_broken()) return "broken";
  if (s.state() != moe_ep::v1::WORKER_STATE_ALLOCATED) return "forming";
  return s.masked_ranks_size() > 0 ? "masked" : "ready";
}

std::string GroupCell(const moe_ep::v1::GetStatusResponse& s) {
  const std::string state = GroupState(s);
  if (state == "none") return "-";
  if (state == "broken") return absl::StrCat("gen ", s.generation(), " BROKEN");
  if (state == "masked") {
    return absl::StrCat("gen ", s.generation(), " masked [", absl::StrJoin(s.masked_ranks(), ","),
                        "]");
  }
  return absl::StrCat("gen ", s.generation(), " ", state);
}

std::string MemoryCell(const moe_ep::v1::GetStatusResponse& s) {
  const int64_t used = s.workspace_bytes() + s.expert_bytes();
  return absl::StrCat(FormatBytes(static_cast<double>(used)), " / ",
                      s.memory_cap_bytes() > 0
                          ? FormatBytes(static_cast<double>(s.memory_cap_bytes()))
                          : std::string("uncapped"));
}

absl::Status ExplainUnimplemented(const absl::Status& error, const std::string& target,
                                  const moe_ep::v1::GetGroupResponse* group) {
  if (group != nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "this is a coordinator (moe_ep.v1.Coordinator: phase ",
        moe_ep::v1::GroupPhase_Name(group->phase()), ", generation ", group->generation(), ", ",
        group->ranks_size(), " ranks), not a worker: use `moe-ep coordinator status --target ",
        target, "`"));
  }
  return absl::UnimplementedError(absl::StrCat(
      target, " serves no moe_ep.v1.Worker (not a moe-ep worker, or one of an older release)",
      error.message().empty() ? "" : ": ", error.message()));
}

std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>> StatusEachExplained(
    Coordinator& coordinator) {
  std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>> statuses = coordinator.StatusEach();
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i].ok() || statuses[i].status().code() != absl::StatusCode::kUnimplemented) {
      continue;
    }
    const std::string& target = coordinator.targets()[i];
    auto stub = moe_ep::v1::Coordinator::NewStub(MakeWorkerChannel(target, coordinator.options()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() +
                         absl::ToChronoMilliseconds(coordinator.options().rpc_timeout));
    moe_ep::v1::GetGroupResponse group;
    const bool is_coordinator =
        stub->GetGroup(&context, moe_ep::v1::GetGroupRequest(), &group).ok();
    statuses[i] =
        ExplainUnimplemented(statuses[i].status(), target, is_coordinator ? &group : nullptr);
  }
  return statuses;
}

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

WorkerErrorView DescribeWorkerError(const absl::Status& error,
                                    const ClientSecurityOptions& security) {
  WorkerErrorView view;
  const bool tls = !security.tls_ca.empty();
  const absl::string_view message = error.message();
  if (error.code() == absl::StatusCode::kUnauthenticated) {
    view.state = "UNAUTHENTICATED";
    view.hint = security.auth_token_file.empty()
                    ? "the worker requires a bearer token: pass --auth-token-file FILE (with "
                      "--tls-ca)"
                    : absl::StrCat("the worker rejected the token of --auth-token-file ",
                                   security.auth_token_file, ": it must hold the worker's token");
    return view;
  }
  if (error.code() == absl::StatusCode::kPermissionDenied) {
    view.state = "PERMISSION_DENIED";
    return view;
  }
  if (error.code() == absl::StatusCode::kUnimplemented) {
    // It answered, but serves no moe_ep.v1.Worker (ExplainUnimplemented).
    view.state = "NOT_A_WORKER";
    return view;
  }
  view.state = "UNREACHABLE";
  if (error.code() != absl::StatusCode::kUnavailable) return view;
  const bool closed = absl::StrContains(message, "Socket closed") ||
                      absl::StrContains(message, "Connection reset") ||
                      absl::StrContains(message, "connection reset") ||
                      absl::StrContains(message, "Broken pipe");
  const std::string lower = absl::AsciiStrToLower(message);
  const bool handshake = absl::StrContains(lower, "handshake") || absl::StrContains(lower, "ssl") ||
                         absl::StrContains(lower, "certificate");
  if (!tls && closed) {
    view.hint =
        "the worker closed a plaintext connection: if it serves TLS, pass --tls-ca CA.pem (and "
        "--tls-cert/--tls-key when it requires client certificates)";
  } else if (tls && (handshake || closed)) {
    view.hint =
        "the TLS handshake failed: a plaintext worker needs no --tls-ca; otherwise --tls-ca must "
        "be the CA that signed its certificate, and a worker that requires client certificates "
        "needs --tls-cert and --tls-key";
  }
  return view;
}

std::string RenderWorkerTable(
    const std::vector<std::string>& targets,
    const std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>>& statuses,
    const ClientSecurityOptions& security) {
  // Which ranks report each error text (first appearance order).
  std::vector<std::string> texts(statuses.size());
  std::map<std::string, std::vector<int>> ranks_of;
  std::vector<std::string> order;
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i].ok()) continue;
    const std::string target = i < targets.size() ? targets[i] : "?";
    texts[i] = ErrorText(statuses[i].status(), DescribeWorkerError(statuses[i].status(), security),
                         target);
    auto& ranks = ranks_of[texts[i]];
    if (ranks.empty()) order.push_back(texts[i]);
    ranks.push_back(static_cast<int>(i));
  }
  std::map<std::string, int> note_of;  // repeated error -> its number below
  std::string notes;
  for (const std::string& text : order) {
    const std::vector<int>& ranks = ranks_of[text];
    if (ranks.size() < 2) continue;
    const int n = static_cast<int>(note_of.size()) + 1;
    note_of[text] = n;
    const std::string head =
        absl::StrCat("error ", n, ", ranks ", FormatRankList(ranks),
                     ranks.size() == statuses.size() ? " (every worker)" : "", ": ");
    const std::vector<std::string> lines = WrapText(head + text, kNoteWidth);
    notes += absl::StrCat(lines[0], "\n");
    for (size_t l = 1; l < lines.size(); ++l) notes += absl::StrCat("    ", lines[l], "\n");
  }

  TextTable table({"rank", "address", "state", "group", "backend", "device", "memory", "workspace",
                   "experts", "epoch", "R", "forwards", "lease", "errors"});
  table.SetMaxWidth(12, kLeaseColumnWidth);
  table.SetMaxWidth(13, kErrorColumnWidth);
  std::string broken_notes;  // one per rank whose group is broken
  for (size_t i = 0; i < statuses.size(); ++i) {
    const std::string target = i < targets.size() ? targets[i] : "?";
    if (!statuses[i].ok()) {
      const auto note = note_of.find(texts[i]);
      const std::string cell = note != note_of.end()
                                   ? absl::StrCat("error ", note->second, " (below)")
                                   : absl::StrReplaceAll(texts[i], {{"<address>", target}});
      table.AddRow({"-", target, DescribeWorkerError(statuses[i].status(), security).state, "-",
                    "-", "-", "-", "-", "-", "-", "-", "-", "-", cell});
      continue;
    }
    const auto& s = *statuses[i];
    const bool joined = s.state() != moe_ep::v1::WORKER_STATE_STARTED &&
                        s.state() != moe_ep::v1::WORKER_STATE_UNSPECIFIED;
    std::string state(WorkerStateName(s.state()));
    if (s.group_broken()) {
      // The lifecycle state is kept; the group is not usable (GetStatus
      // broken_reason says why): a note under the table.
      state += " BROKEN";
      const std::vector<std::string> lines = WrapText(
          absl::StrCat("rank ", s.rank(), " (", target, "): group of generation ", s.generation(),
                       " is broken: ", s.broken_reason(), "; re-join with a new generation"),
          kNoteWidth);
      broken_notes += absl::StrCat(lines[0], "\n");
      for (size_t l = 1; l < lines.size(); ++l)
        broken_notes += absl::StrCat("    ", lines[l], "\n");
    }
    table.AddRow(
        {joined ? absl::StrCat(s.rank(), "/", s.world_size()) : "-", target, state, GroupCell(s),
         s.backend().empty() ? "-" : s.backend(), s.device_name().empty() ? "-" : s.device_name(),
         MemoryCell(s), FormatBytes(s.workspace_bytes()), FormatBytes(s.expert_bytes()),
         absl::StrCat(s.geometry_epoch()), absl::StrCat(s.runtime_max_tokens_per_rank()),
         absl::StrCat(s.counters().forwards()), LeaseCell(s), absl::StrCat(s.counters().errors())});
  }
  return table.Render() + notes + broken_notes;
}

nlohmann::json WorkerStatusJson(
    const std::vector<std::string>& targets,
    const std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>>& statuses,
    const ClientSecurityOptions& security) {
  nlohmann::json workers = nlohmann::json::array();
  for (size_t i = 0; i < statuses.size(); ++i) {
    nlohmann::json w;
    w["target"] = i < targets.size() ? targets[i] : "?";
    w["ok"] = statuses[i].ok();
    if (!statuses[i].ok()) {
      const absl::Status& error = statuses[i].status();
      const WorkerErrorView view = DescribeWorkerError(error, security);
      w["state"] = view.state;
      w["code"] = absl::StatusCodeToString(error.code());
      w["error"] = std::string(error.message());
      w["hint"] = view.hint;
    } else {
      // Every GetStatus field (issue 31 item 1), then the short names.
      const auto& s = *statuses[i];
      w.update(ProtoToJson(s));
      w["state"] = WorkerStateName(s.state());
      w["group"] = GroupState(s);
      w["memory_used_bytes"] = s.workspace_bytes() + s.expert_bytes();
      w["device"] = s.device_name();
      w["forwards"] = s.counters().forwards();
      w["errors"] = s.counters().errors();
    }
    workers.push_back(std::move(w));
  }
  return workers;
}

absl::Status RunStatusCommand(const std::string& targets_text, std::ostream& out) {
  StatusCommandOptions options;
  options.targets = targets_text;
  return RunStatusCommand(options, out);
}

absl::Status RunStatusCommand(const StatusCommandOptions& options, std::ostream& out) {
  ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(options.targets));
  CoordinatorOptions coordinator_options;
  ASSIGN_OR_RETURN(coordinator_options.channel_credentials,
                   MakeClientChannelCredentials(options.security));
  coordinator_options.rpc_timeout = options.rpc_timeout;
  ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
                   Coordinator::Connect(targets, coordinator_options));
  const auto statuses = StatusEachExplained(*coordinator);
  if (options.json) {
    out << nlohmann::json{{"workers", WorkerStatusJson(targets, statuses, options.security)}}.dump(
               2)
        << "\n";
  } else {
    out << RenderWorkerTable(targets, statuses, options.security);
  }
  int unreachable = 0;
  int not_workers = 0;
  for (const auto& s : statuses) {
    unreachable += s.ok() ? 0 : 1;
    not_workers += !s.ok() && s.status().code() == absl::StatusCode::kUnimplemented ? 1 : 0;
  }
  if (not_workers > 0 && not_workers == unreachable) {
    // One message, the table's: "this is a coordinator ...: use ...".
    for (const auto& s : statuses) {
      if (!s.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat(not_workers, " of ", targets.size(),
                         " targets serve no worker: ", s.status().message()));
      }
    }
  }
  if (unreachable > 0) {
    return absl::UnavailableError(
        absl::StrCat(unreachable, " of ", targets.size(), " workers did not answer"));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::client
