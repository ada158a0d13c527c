#include "server/memory_budget.h"

#include "absl/strings/str_cat.h"

namespace moe_ep::server {

absl::Status CheckWorkspaceFits(const MemoryBudget& budget, int64_t workspace_bytes,
                                int64_t kept_expert_bytes) {
  if (budget.cap_bytes <= 0 || workspace_bytes + kept_expert_bytes <= budget.cap_bytes) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "AllocateWorkspace: the workspace needs ", workspace_bytes, " bytes",
      kept_expert_bytes > 0 ? absl::StrCat(" (plus ", kept_expert_bytes, " of experts)") : "",
      ", more than the worker's memory cap of ", budget.cap_bytes, " bytes (--memory-cap-bytes)"));
}

absl::StatusOr<int64_t> CheckExpertsFit(const MemoryBudget& budget, int layer, int64_t new_bytes,
                                        int64_t old_bytes) {
  const int64_t others = budget.expert_bytes - old_bytes;
  const int64_t total = budget.workspace_bytes + others + new_bytes;
  if (budget.cap_bytes > 0 && total > budget.cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "LoadExperts: layer ", layer, " needs ", new_bytes, " bytes of experts; with ",
        budget.workspace_bytes, " of workspace and ", others, " of other layers' experts that is ",
        total, " bytes, more than the memory cap of ", budget.cap_bytes,
        " bytes (--memory-cap-bytes)"));
  }
  return total;
}

int64_t BenchmarkInputBytes(int64_t tokens, int64_t hidden, int top_k) {
  return tokens * (hidden * 2 * 2 + int64_t{top_k} * 8);
}

absl::Status CheckBenchmarkFits(const MemoryBudget& budget, int64_t workspace_bytes,
                                int64_t input_bytes) {
  const int64_t needed = workspace_bytes + input_bytes;
  if (budget.cap_bytes <= 0 || budget.held() + needed <= budget.cap_bytes) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "Benchmark: needs ", needed, " bytes (workspace and inputs) on top of ", budget.held(),
      " held, more than the memory cap of ", budget.cap_bytes, " bytes (--memory-cap-bytes)"));
}

absl::StatusOr<int64_t> DeviceScratchCap(int64_t device_bytes, int64_t memory_cap_bytes) {
  if (memory_cap_bytes <= 0) return 0;
  const int64_t cap = memory_cap_bytes - device_bytes;
  if (cap <= 0) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Benchmark: inputs and output need ", device_bytes, " device bytes, more than the ",
        memory_cap_bytes, " bytes the memory cap leaves (--memory-cap-bytes)"));
  }
  return cap;
}

}  // namespace moe_ep::server
