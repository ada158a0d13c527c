#pragma once

// core::ControlCollective (host memory, blocking, deadline-bounded) over a
// kernels::StreamCollective: each call copies its host bytes into device
// staging on the stream collective's stream, enqueues the stream call,
// copies the result back through pinned memory and waits with
// StreamCollective::Synchronize (the group's deadline: a dead peer is an
// error, never a hang). This is the control plane's view of a GPU group
// (token-count agreement, votes, barriers); the payload path uses the
// StreamCollective directly. Source: STYLE §7; issue 10 item 3.
//
// Staging grows on demand (cudaMalloc + cudaMallocHost of the largest call's
// bytes) and is freed with the object. Not thread-safe.

#include <memory>
#include <string>

#include "core/collective.h"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {

class StagedControlCollective final : public core::ControlCollective {
 public:
  // A view of `stream`, which must outlive it.
  explicit StagedControlCollective(StreamCollective* stream);
  // A view that owns its stream collective (what Split returns).
  explicit StagedControlCollective(std::unique_ptr<StreamCollective> owned);
  ~StagedControlCollective() override;
  StagedControlCollective(const StagedControlCollective&) = delete;
  StagedControlCollective& operator=(const StagedControlCollective&) = delete;

  int rank() const override { return stream_->rank(); }
  int size() const override { return stream_->size(); }
  std::string backend() const override { return "nccl"; }
  bool IsLive(int rank) const override { return stream_->IsLive(rank); }
  StreamCollective& stream_collective() const { return *stream_; }

  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes) override;
  absl::Status AllGather(const void* send, int64_t bytes_per_rank, void* recv) override;
  absl::Status AllReduceSum(float* data, int64_t count) override;
  absl::Status Barrier() override;
  void SetCallDeadline(absl::Time deadline) override { stream_->SetCallDeadline(deadline); }
  absl::StatusOr<std::unique_ptr<core::ControlCollective>> Split(absl::Span<const int> ranks,
                                                                 const std::string& tag) override;

 private:
  absl::Status EnsureStaging(int64_t bytes);
  absl::Status CopyIn(const void* host_src, int64_t bytes);
  // Copies `bytes` at staging offset `offset` to `host_dst` through pinned
  // memory, waiting with the deadline.
  absl::Status CopyOutAndWait(void* host_dst, int64_t offset, int64_t bytes);

  std::unique_ptr<StreamCollective> owned_;
  StreamCollective* stream_;
  char* staging_ = nullptr;       // device
  void* host_staging_ = nullptr;  // pinned host, same size
  int64_t staging_bytes_ = 0;
};

}  // namespace moe_ep::kernels
