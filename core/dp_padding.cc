#include "core/dp_padding.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moe_ep::core {

std::string DpPaddingModeName(DpPaddingMode mode) {
  switch (mode) {
    case DpPaddingMode::kMaxLen:
      return "MAX_LEN";
    case DpPaddingMode::kSumLen:
      return "SUM_LEN";
  }
  return "UNKNOWN";
}

absl::StatusOr<DpGatherLayout> ComputeDpGatherLayout(absl::Span<const int64_t> dp_counts,
                                                     int attn_tp_size, bool capturing_cuda_graph,
                                                     int dp_rank) {
  if (dp_counts.empty()) {
    return absl::InvalidArgumentError("dp_counts is empty: need one token count per DP group");
  }
  if (attn_tp_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("attn_tp_size must be >= 1, got ", attn_tp_size));
  }
  const int64_t attn_dp_size = static_cast<int64_t>(dp_counts.size());
  if (dp_rank < 0 || dp_rank >= attn_dp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("dp_rank must be in [0, ", attn_dp_size, "), got ", dp_rank));
  }
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  DpGatherLayout layout;
  layout.attn_tp_size = attn_tp_size;
  layout.dp_rank = dp_rank;
  int64_t sum = 0;
  int64_t max = 0;
  for (int64_t g = 0; g < attn_dp_size; ++g) {
    const int64_t count = dp_counts[g];
    if (count < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token count of DP rank ", g, " must be >= 0, got ", count));
    }
    if (count > kMax - (attn_tp_size - 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("token count of DP rank ", g, " overflows: ", count));
    }
    const int64_t aligned = (count + attn_tp_size - 1) / attn_tp_size * attn_tp_size;
    if (aligned > kMax - sum) {
      return absl::InvalidArgumentError("sum of DP token counts overflows int64");
    }
    sum += aligned;
    max = std::max(max, aligned);
    layout.aligned_counts.push_back(aligned);
  }
  // 2*sum >= max*attn_dp_size, evaluated without overflow: max <= sum, so
  // compare in 128-bit.
  const __int128 lhs = static_cast<__int128>(sum) * 2;
  const __int128 rhs = static_cast<__int128>(max) * attn_dp_size;
  layout.mode =
      (capturing_cuda_graph || lhs >= rhs) ? DpPaddingMode::kMaxLen : DpPaddingMode::kSumLen;
  if (layout.mode == DpPaddingMode::kMaxLen) {
    if (rhs > kMax) return absl::InvalidArgumentError("MAX_LEN global row count overflows int64");
    layout.padded_counts.assign(attn_dp_size, max);
    layout.global_rows = max * attn_dp_size;
  } else {
    layout.padded_counts = layout.aligned_counts;
    layout.global_rows = sum;
  }
  int64_t offset = 0;
  for (int64_t rows : layout.padded_counts) {
    layout.offsets.push_back(offset);
    offset += rows;
  }
  layout.local_rows = layout.padded_counts[dp_rank];
  return layout;
}

int64_t DpScatteredRowsPerRank(const DpGatherLayout& layout) {
  return layout.local_rows / layout.attn_tp_size;
}

}  // namespace moe_ep::core
