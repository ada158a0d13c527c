#include "kernels/peer_refusal.h"

#include "absl/strings/str_format.h"

namespace moe_ep::kernels {

absl::Status PeerRefusalError(int rank, int64_t epoch, RefusedPhase phase, absl::string_view here) {
  return absl::AbortedError(absl::StrFormat(
      "rank %d refused its %s of the step at epoch %d (its arguments failed that rank's checks; "
      "its call returned the error); %s; the group is still usable",
      rank, phase == RefusedPhase::kCombine ? "combine" : "dispatch", epoch, here));
}

}  // namespace moe_ep::kernels
