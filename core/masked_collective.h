#pragma once

// A group with lost ranks masked out (DESIGN §15 rank masks; issue 17 item
// 3): the original ranks and size over a survivors-only group. The
// survivors formed `inner` (one Gloo context on a fresh store prefix,
// server/rank_mask.h), in which the i-th live rank is rank i; this view keeps
// every original rank number, so the dispatcher, the votes and the placement
// table need no renumbering:
//   AllToAllV  moves nothing with a masked rank: its send and receive counts
//              must be 0 (kInternal naming it otherwise: a route to a lost
//              rank is a bug, never silent garbage);
//   AllGather  gives zero rows for masked ranks;
//   IsLive     is false for them (RunVote skips them, the dispatcher's
//              agreement too);
//   Split      takes live ranks only (kInvalidArgument naming a masked one).
// Not thread-safe, like every collective.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/collective.h"

namespace moe_ep::core {

class MaskedCollective final : public ControlCollective {
 public:
  // Create()
  //
  // `live` [world size]: which original ranks survive; `rank` (this rank's
  // original number) must be live, and `inner` must have one rank per live
  // rank with this rank's index among them. Errors: kInvalidArgument (inner
  // null, rank out of range or masked, inner's size or rank not matching).
  static absl::StatusOr<std::unique_ptr<MaskedCollective>> Create(
      std::unique_ptr<ControlCollective> inner, int rank, std::vector<bool> live);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(live_.size()); }
  std::string backend() const override { return inner_->backend(); }
  bool IsLive(int rank) const override { return live_[rank]; }
  const std::vector<bool>& live() const { return live_; }

  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes) override;
  absl::Status AllGather(const void* send, int64_t bytes_per_rank, void* recv) override;
  absl::Status AllReduceSum(float* data, int64_t count) override;
  absl::Status Barrier() override;
  void SetCallDeadline(absl::Time deadline) override { inner_->SetCallDeadline(deadline); }
  absl::StatusOr<std::unique_ptr<ControlCollective>> Split(absl::Span<const int> ranks,
                                                           const std::string& tag) override;

 private:
  MaskedCollective(std::unique_ptr<ControlCollective> inner, int rank, std::vector<bool> live);

  std::unique_ptr<ControlCollective> inner_;
  int rank_;
  std::vector<bool> live_;
  std::vector<int> inner_index_;  // [world]: index in inner_, -1 when masked
  std::vector<int64_t> send_scratch_, recv_scratch_;
  std::vector<char> gather_scratch_;
};

}  // namespace moe_ep::core
