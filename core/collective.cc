#include "core/collective.h"

namespace moe_ep::core {

absl::StatusOr<std::vector<int64_t>> AllGatherInt64(ControlCollective& collective, int64_t value) {
  std::vector<int64_t> values(collective.size());
  absl::Status status = collective.AllGather(&value, sizeof(value), values.data());
  if (!status.ok()) return status;
  return values;
}

}  // namespace moe_ep::core
