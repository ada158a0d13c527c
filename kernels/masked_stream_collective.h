#pragma once

// The NCCL group with lost ranks masked out (DESIGN §15 rank masks; issue 17
// item 3), the stream-ordered twin of core::MaskedCollective: the original
// ranks and size over the survivors' communicator (ncclCommShrink or a
// fresh one; core::PlanShrink), in which the i-th live rank is rank i. The
// GPU dispatcher, its step header and the placement table keep every
// original rank number:
//   AllToAllV, GroupedAllToAllV  move nothing with a masked rank; what this
//       rank would have sent it comes back as what it "received" from it
//       (a device copy of the send part into the receive part, the rest of
//       a longer receive part zeroed). A masked rank gets no tokens (the
//       masked table routes none there), so its send part is padding:
//       invalid ids, zero weights, zero counts, and this rank's own step
//       header, which the header check then accepts;
//   AllGather    gives zero rows for masked ranks (through scratch sized
//                at Create: see there);
//   IsLive       is false for them (the dispatcher's (epoch, R) agreement
//                skips them);
//   AllReduceSum sums over the live ranks;
//   Split        takes live ranks only (kInvalidArgument naming a masked one).
// Stream-ordered like the inner collective (every copy is enqueued on its
// stream; capturable). Not thread-safe.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {

class MaskedStreamCollective final : public StreamCollective {
 public:
  // Create()
  //
  // `live` [world size]: which original ranks survive; `rank` (this rank's
  // original number) must be live, and `inner` must have one rank per live
  // rank with this rank's index among them.
  // `capture_gather_bytes`: the largest bytes_per_rank an AllGather inside a
  // CUDA graph capture may use. The inner all-gather lands in device scratch
  // before its rows move to their original ranks; Create allocates
  // capture_gather_bytes x (live ranks) bytes of it on inner's device, so a
  // captured step allocates nothing (the GPU data plane passes 256: its step
  // gathers one int64 per rank, its control records are smaller than 256
  // bytes). A larger AllGather outside a capture uses a second scratch, grown
  // as needed after a stream sync (the step boundary); one inside a capture
  // is kFailedPrecondition. The capture scratch lives as long as this
  // object, so graphs captured on it stay valid.
  // Errors: kInvalidArgument (inner null, rank out of range or masked,
  // inner's size or rank not matching, capture_gather_bytes < 0), CUDA
  // errors (the scratch: kResourceExhausted when the device is full).
  static absl::StatusOr<std::unique_ptr<MaskedStreamCollective>> Create(
      std::unique_ptr<StreamCollective> inner, int rank, std::vector<bool> live,
      int64_t capture_gather_bytes);
  ~MaskedStreamCollective() override;
  MaskedStreamCollective(const MaskedStreamCollective&) = delete;
  MaskedStreamCollective& operator=(const MaskedStreamCollective&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(live_.size()); }
  int device() const override { return inner_->device(); }
  cudaStream_t stream() const override { return inner_->stream(); }
  bool healthy() const override { return inner_->healthy(); }
  bool IsLive(int rank) const override { return rank >= 0 && rank < size() && live_[rank]; }
  const std::vector<bool>& live() const { return live_; }
  StreamCollective& inner() { return *inner_; }

  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes) override;
  absl::Status GroupedAllToAllV(absl::Span<const AllToAllVPart> parts) override;
  absl::Status AllGather(const void* send, int64_t bytes_per_rank, void* recv) override;
  absl::Status AllReduceSum(float* data, int64_t count) override {
    return inner_->AllReduceSum(data, count);
  }
  absl::Status Synchronize() override { return inner_->Synchronize(); }
  void Abort() override { inner_->Abort(); }
  void SetCallDeadline(absl::Time deadline) override { inner_->SetCallDeadline(deadline); }
  absl::StatusOr<std::unique_ptr<StreamCollective>> Split(absl::Span<const int> ranks,
                                                          const std::string& tag) override;

 private:
  MaskedStreamCollective(std::unique_ptr<StreamCollective> inner, int rank, std::vector<bool> live);
  // Checks one part's spans (size() entries, no negative count).
  absl::Status CheckPart(const char* call, absl::Span<const int64_t> send_bytes,
                         absl::Span<const int64_t> recv_bytes) const;
  // Enqueues the echo of the masked peers of one part (see the file comment).
  absl::Status EchoMasked(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                          absl::Span<const int64_t> recv_bytes);

  std::unique_ptr<StreamCollective> inner_;
  int rank_;
  std::vector<bool> live_;
  std::vector<int> live_ranks_;  // original ranks, ascending: inner rank i = live_ranks_[i]
  // The inner parts' counts of the last grouped call ([parts * live][live]).
  std::vector<std::vector<int64_t>> inner_send_, inner_recv_;
  // Device scratch of the inner all-gather's rows: fixed at Create (what a
  // capture may use), and grown for larger gathers outside a capture.
  void* capture_scratch_ = nullptr;
  int64_t capture_scratch_bytes_ = 0;
  void* grown_scratch_ = nullptr;
  int64_t grown_scratch_bytes_ = 0;
};

}  // namespace moe_ep::kernels
