#include "server/gpu_step_buffers.h"

#ifdef MOE_EP_HAVE_CUDA

#include <vector>

#include "core/workspace.h"

namespace moe_ep::server {
absl::StatusOr<core::StepStats> StepCountStats(const int32_t* counts, int members, int self,
                                               const core::WorkspaceSpec& ws, int64_t runtime_max) {
  ASSIGN_OR_RETURN(const int64_t dispatch_bytes,
                   core::DispatchBytesPerToken(ws.dtype, ws.hidden, ws.top_k));
  const int64_t combine_bytes = core::CombineBytesPerToken(ws.hidden);
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = runtime_max;
  for (int p = 0; p < members; ++p) {
    const int64_t sent = counts[p];
    const int64_t received = counts[members + p];
    stats.tokens_sent += sent;
    stats.tokens_received += received;
    if (p == self) continue;
    stats.bytes_sent_remote += sent * dispatch_bytes + received * combine_bytes;
  }
  return stats;
}

absl::Status AddStepTimes(const kernels::GpuPlaneEvents& events,
                          const kernels::GpuSharedExperts* shared, core::StepStats* stats) {
  float ms[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    ASSIGN_OR_RETURN(ms[i], events.ElapsedMs(i, i + 1));
  }
  stats->dispatch_us = static_cast<int64_t>(ms[0] * 1000.0f);
  stats->expert_us = static_cast<int64_t>(ms[1] * 1000.0f);
  stats->combine_us = static_cast<int64_t>(ms[2] * 1000.0f);
  if (shared != nullptr) {
    ASSIGN_OR_RETURN(auto shared_times, shared->Times(events.step()[0], events.step()[1]));
    stats->shared_us = shared_times.first;
    stats->shared_overlap_us = shared_times.second;
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
