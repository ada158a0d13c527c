#include "kernels/gpu_workspace_layout.h"

#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/step_header.cuh"

namespace moe_ep::kernels {

absl::StatusOr<GpuWorkspaceLayout> GpuWorkspaceLayout::For(const core::WorkspaceSpec& spec) {
  const int64_t e = spec.ep_size;
  const int64_t n = spec.capacity_tokens;
  if (e < 1 || n < 1 || spec.hidden < 1 || spec.top_k < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("GPU workspace: ep_size, capacity_tokens, hidden and top_k must be >= 1, got ",
                     e, ", ", n, ", ", spec.hidden, ", ", spec.top_k));
  }
  ASSIGN_OR_RETURN(const int64_t row,
                   core::DispatchBytesPerToken(spec.dtype, spec.hidden, spec.top_k));
  const int64_t bf16_row = 2 * spec.hidden + 8 * int64_t{spec.top_k};
  const bool fp8 = spec.dtype == core::DispatchDType::kFP8E4M3;
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max() / 16;
  if (bf16_row > kMax / n / e) {
    return absl::OutOfRangeError(absl::StrCat("GPU workspace: E * N * row overflows int64 (E ", e,
                                              ", N ", n, ", row ", row, " bytes)"));
  }
  static_assert(sizeof(StepHeaderError) <= 128, "error record fits its region");
  GpuWorkspaceLayout layout;
  const std::pair<core::LayoutRegion*, int64_t> parts[] = {
      {&layout.dispatch_send, e * n * row},
      {&layout.dispatch_recv, e * n * row},
      {&layout.combine_send, e * n * spec.hidden * 2},
      {&layout.combine_recv, e * n * spec.hidden * 2},
      {&layout.token_slot, n * e * 4},
      {&layout.send_counts, 2 * e * 4},
      {&layout.header, 3 * 8},
      {&layout.gathered_headers, e * 3 * 8},
      {&layout.error, static_cast<int64_t>(sizeof(StepHeaderError))},
      {&layout.header_replicas, e * 3 * 8},
      {&layout.dispatch_dequant, fp8 ? e * n * bf16_row : 0},
  };
  int64_t end = 0;
  for (const auto& [region, bytes] : parts) {
    *region = core::LayoutRegion{end, core::AlignTo128(bytes)};
    end += region->size_bytes;
  }
  layout.wire_row_bytes = row;
  layout.total_bytes = end;
  return layout;
}

std::vector<core::WorkspaceRegion> GpuWorkspaceLayout::Regions() const {
  const std::pair<const char*, const core::LayoutRegion*> named[] = {
      {"dispatch_send", &dispatch_send},
      {"dispatch_recv", &dispatch_recv},
      {"combine_send", &combine_send},
      {"combine_recv", &combine_recv},
      {"token_slot", &token_slot},
      {"send_counts", &send_counts},
      {"step_header", &header},
      {"gathered_headers", &gathered_headers},
      {"step_error", &error},
      {"header_replicas", &header_replicas},
  };
  std::vector<core::WorkspaceRegion> regions;
  regions.reserve(std::size(named));
  for (const auto& [name, region] : named) {
    regions.push_back({name, region->offset_bytes, region->size_bytes});
  }
  if (dispatch_dequant.size_bytes > 0) {
    regions.push_back(
        {"dispatch_dequant", dispatch_dequant.offset_bytes, dispatch_dequant.size_bytes});
  }
  return regions;
}

}  // namespace moe_ep::kernels
