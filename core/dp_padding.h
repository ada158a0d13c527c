#pragma once

// The buffer layout of a DP gather / scatter with DP attention (DESIGN §4):
// how many rows each DP group contributes to the global (FULL) buffer, where
// they sit, and the padding mode that decides it.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::core {

enum class DpPaddingMode {
  kMaxLen,  // every DP group padded to the max; global = max * attn_dp_size rows
  kSumLen,  // groups packed DP-major; global = sum rows
};

// "MAX_LEN", "SUM_LEN".
std::string DpPaddingModeName(DpPaddingMode mode);

struct DpGatherLayout {
  DpPaddingMode mode = DpPaddingMode::kMaxLen;
  int attn_tp_size = 1;
  int dp_rank = 0;                      // the DP group `local_rows` is for
  std::vector<int64_t> aligned_counts;  // [attn_dp] counts rounded up to attn_tp_size
  std::vector<int64_t> padded_counts;   // [attn_dp] rows each group occupies globally
  std::vector<int64_t> offsets;         // [attn_dp] first global row of each group
  int64_t global_rows = 0;              // rows of the FULL buffer
  int64_t local_rows = 0;               // padded_counts[dp_rank]: the TP_ATTN_FULL buffer
};

// ComputeDpGatherLayout()
//
// `dp_counts` [attn_dp_size] holds each DP group's token count (identical on
// every rank: it comes from an all-gather). Each count is rounded up to a
// multiple of `attn_tp_size`; with sum S and max M of the aligned counts the
// mode is MAX_LEN when `capturing_cuda_graph` or 2*S >= M*attn_dp_size, else
// SUM_LEN. MAX_LEN pads every group to M (global M*attn_dp_size rows), SUM_LEN
// packs the aligned counts (global S rows). Offsets are the exclusive prefix
// sums of padded_counts. `dp_rank` selects the group whose rows are local.
//
// Errors (kInvalidArgument): dp_counts empty or any count < 0 (naming the DP
// rank); attn_tp_size < 1; dp_rank outside [0, attn_dp_size); row counts
// overflowing int64.
//
// Pure and thread-safe. Source: DESIGN §4.
// Example: attn_tp 2, counts [5, 2] -> aligned [6, 2]; 8*2 >= 6*2 -> MAX_LEN,
// padded [6, 6], offsets [0, 6], global 12, local 6, 3 SCATTERED rows a rank.
absl::StatusOr<DpGatherLayout> ComputeDpGatherLayout(absl::Span<const int64_t> dp_counts,
                                                     int attn_tp_size, bool capturing_cuda_graph,
                                                     int dp_rank);

// Rows each attention-TP rank of this DP group holds in SCATTERED mode:
// local_rows / attn_tp_size (local_rows is a multiple of attn_tp_size).
// Example: the layout above -> 3.
int64_t DpScatteredRowsPerRank(const DpGatherLayout& layout);

}  // namespace moe_ep::core
