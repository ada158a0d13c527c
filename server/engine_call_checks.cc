#include "server/engine_call_checks.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe_ep::server {

absl::Status CheckEngineInputs(const char* call, int rank, int64_t num_tokens, const void* hidden,
                               const int32_t* topk_ids, const float* topk_weights) {
  if (num_tokens <= 0) return absl::OkStatus();
  std::vector<std::string> null;
  if (hidden == nullptr) null.emplace_back("hidden");
  if (topk_ids == nullptr) null.emplace_back("topk_ids");
  if (topk_weights == nullptr) null.emplace_back("topk_weights");
  if (null.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(call, " on rank ", rank, ": ", absl::StrJoin(null, ", "), " null with ",
                   num_tokens, " tokens (they must not be null when num_tokens > 0)"));
}

absl::Status CheckEngineOutput(const char* call, int rank, int64_t num_tokens, const void* output) {
  if (num_tokens > 0 && output == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(call, " on rank ", rank,
                                                   ": output must not be null when num_tokens > 0 "
                                                   "(got ",
                                                   num_tokens, " tokens)"));
  }
  return absl::OkStatus();
}

absl::Status CheckEngineRecvBuffers(const char* call, int rank, const EngineRecvBuffers& out,
                                    int64_t runtime_max, int num_local_experts) {
  if (out.rows < runtime_max) {
    return absl::InvalidArgumentError(absl::StrCat(call, " on rank ", rank, ": recv_rows ",
                                                   out.rows, " < the committed R ", runtime_max,
                                                   " (rows per source)"));
  }
  if (out.source_counts == nullptr || (out.expert_counts == nullptr && num_local_experts > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, " on rank ", rank, ": source_counts [E] and expert_counts [",
                     num_local_experts, " local experts] must not be null"));
  }
  if (out.rows > 0 &&
      (out.hidden == nullptr || out.topk_ids == nullptr || out.topk_weights == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, " on rank ", rank,
        ": recv_hidden, recv_topk_ids and recv_topk_weights must not be null when recv_rows > 0 "
        "(got ",
        out.rows, ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckEngineCombineArgs(const char* call, int rank, int64_t rows, int64_t runtime_max,
                                    const void* expert_out, const void* output,
                                    int64_t step_tokens) {
  if (rows < runtime_max) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, " on rank ", rank, ": expert_out: rows per source ", rows,
                     " is below the dispatched step's R = ", runtime_max));
  }
  if (expert_out == nullptr && rows > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, " on rank ", rank, ": expert_out is null with ", rows,
                     " rows per source (it must not be null when rows > 0)"));
  }
  if (output == nullptr && step_tokens > 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, " on rank ", rank, ": output is null and the dispatched step has ",
                     step_tokens, " tokens (it must not be null when the step has tokens)"));
  }
  return absl::OkStatus();
}

absl::Status RefusedDispatchError(const absl::Status& args, const absl::Status& refused) {
  if (refused.ok()) return args;
  return absl::Status(
      args.code(),
      absl::StrCat(args.message(), "; no refusal could be enqueued in place of the step (",
                   refused.ToString(),
                   "), so the peers' dispatch waits for this rank until the group's timeout"));
}

absl::Status RefusedCombineError(const absl::Status& args, const absl::Status& refused) {
  if (refused.ok()) {
    return absl::Status(args.code(),
                        absl::StrCat(args.message(),
                                     " (refused: the step is over on every rank; the peers' "
                                     "check_step names this rank)"));
  }
  return absl::Status(
      args.code(),
      absl::StrCat(args.message(), "; no refusal could be enqueued in place of the combine (",
                   refused.ToString(),
                   "), so the peers' combine waits for this rank until the group's timeout"));
}

}  // namespace moe_ep::server
