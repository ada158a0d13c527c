#include "core/layer_stack_memory.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/status_macros.h"
#include "core/workspace.h"

namespace moe_ep::core {
namespace {

// Attention stand-in [H, H] fp32 and the two RMSNorm weights [H] fp32.
int64_t LayerWeightBytes(int64_t h) { return h * h * 4 + 2 * h * 4; }

// One SwiGLU MLP of intermediate size `i`: gate, up [I, H], down [H, I].
int64_t SwiGluBytes(int64_t i, int64_t h, int64_t bytes_per_value) {
  return 3 * i * h * bytes_per_value;
}

bool AnyOf(const std::vector<bool>& layers, bool sparse) {
  return std::find(layers.begin(), layers.end(), sparse) != layers.end();
}

}  // namespace

absl::StatusOr<int64_t> EstimateLayerStackBytes(const LayerStackConfig& c, int rank) {
  RETURN_IF_ERROR(ValidateLayerStackConfig(c));
  ASSIGN_OR_RETURN(ExpertPlacement placement,
                   ExpertPlacement::Contiguous(c.num_experts, c.layout.tp_size));
  const int64_t h = c.hidden;
  const int64_t dense = SwiGluBytes(c.dense_intermediate, h, 2);
  const int64_t experts =
      int64_t{placement.NumLocalExperts(rank)} * SwiGluBytes(c.moe_intermediate, h, 2);
  int64_t total = 0;
  bool scattered_moe = false;
  for (bool sparse : c.sparse_layers) {
    total += LayerWeightBytes(h) + (sparse ? experts : dense);
    scattered_moe |= sparse && c.a2a_enabled;
  }
  if (scattered_moe) {
    WorkspaceSpec spec;
    spec.ep_size = c.layout.tp_size;
    spec.capacity_tokens = c.capacity_tokens;
    spec.hidden = c.hidden;
    spec.top_k = c.top_k;
    spec.dtype = DispatchDType::kBF16;
    ASSIGN_OR_RETURN(AllocatedWorkspace workspace, ComputeAllocatedWorkspace(spec));
    total += workspace.total_bytes;
  }
  return total;
}

absl::StatusOr<int64_t> EstimateLayerStackScratchBytes(const LayerStackConfig& c, int64_t rows,
                                                       int dense_shards) {
  RETURN_IF_ERROR(ValidateLayerStackConfig(c));
  if (rows < 0) return absl::InvalidArgumentError(absl::StrCat("rows: expected >= 0, got ", rows));
  if (dense_shards < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("dense_shards: expected >= 1, got ", dense_shards));
  }
  const int64_t h = c.hidden;
  int64_t widest = 0;  // the largest intermediate an MLP of the stack computes with
  if (AnyOf(c.sparse_layers, true)) widest = std::max(widest, c.moe_intermediate);
  if (AnyOf(c.sparse_layers, false)) widest = std::max(widest, c.dense_intermediate / dense_shards);
  return SwiGluBytes(widest, h, 4) + rows * (8 * 4 * h + 2 * 4 * widest + 8 * int64_t{c.top_k});
}

absl::StatusOr<int64_t> EstimateReferenceLayerStackBytes(const LayerStackConfig& c, int64_t rows) {
  ASSIGN_OR_RETURN(int64_t scratch, EstimateLayerStackScratchBytes(c, rows, 1));
  const int64_t h = c.hidden;
  int64_t largest = 0;
  for (bool sparse : c.sparse_layers) {
    const int64_t mlp = sparse ? int64_t{c.num_experts} * SwiGluBytes(c.moe_intermediate, h, 2)
                               : SwiGluBytes(c.dense_intermediate, h, 2);
    largest = std::max(largest, LayerWeightBytes(h) + mlp);
  }
  return largest + scratch;
}

}  // namespace moe_ep::core
