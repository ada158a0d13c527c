#include "kernels/expert_id_error.h"

#include "absl/strings/str_format.h"
#include "core/routing.h"

namespace moe_ep::kernels {

absl::Status ExpertIdErrorStatus(const ExpertIdError& e, int top_k, int num_experts,
                                 int32_t invalid_expert_id, int rank) {
  if (e.count == 0) return absl::OkStatus();
  const unsigned long long packed = ~e.first_inverted;
  const auto id = static_cast<int32_t>(static_cast<uint32_t>(packed & 0xFFFFFFFFULL));
  return core::ExpertIdError(
      static_cast<int64_t>(packed >> 32), top_k, id, num_experts, invalid_expert_id,
      absl::StrFormat("%d id%s out of range; found on the device by rank %d's step: those "
                      "choices selected no expert, only the configured invalid id marks padding",
                      e.count, e.count == 1 ? "" : "s", rank));
}

}  // namespace moe_ep::kernels
