#include "server/benchmark_gate.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe_ep::server {

absl::Status BenchmarkIterationGate(core::ControlCollective& collective, absl::Time deadline,
                                    int done, int total) {
  const int64_t late = absl::Now() >= deadline ? 1 : 0;
  absl::StatusOr<std::vector<int64_t>> votes = core::AllGatherInt64(collective, late);
  if (!votes.ok()) return votes.status();
  if (std::find(votes->begin(), votes->end(), int64_t{1}) == votes->end()) {
    return absl::OkStatus();
  }
  return absl::DeadlineExceededError(
      absl::StrCat("Benchmark: the call's deadline passed after ", done, " of ", total,
                   " iterations (warmup included); ask for fewer iterations or a longer deadline"));
}

}  // namespace moe_ep::server
