#include "kernels/expert_id_error.h"

#include "absl/strings/str_format.h"

namespace moe_ep::kernels {

absl::Status ExpertIdErrorStatus(const ExpertIdError& e, int top_k, int num_experts,
                                 int32_t invalid_expert_id, int rank) {
  if (e.count == 0) return absl::OkStatus();
  const unsigned long long packed = ~e.first_inverted;
  const int64_t index = static_cast<int64_t>(packed >> 32);
  const auto id = static_cast<int32_t>(static_cast<uint32_t>(packed & 0xFFFFFFFFULL));
  const int k = top_k > 0 ? top_k : 1;
  return absl::InvalidArgumentError(absl::StrFormat(
      "topk_ids[row %d, choice %d] = %d: outside [0, %d) and not the invalid expert id %d (%d "
      "id%s out of range; found on the device by rank %d's step: those choices selected no "
      "expert, only the configured invalid id marks padding)",
      index / k, index % k, id, num_experts, invalid_expert_id, e.count, e.count == 1 ? "" : "s",
      rank));
}

}  // namespace moe_ep::kernels
