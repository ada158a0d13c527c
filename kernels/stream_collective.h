#pragma once

// The stream-ordered device collective of the GPU data plane (DESIGN §1, §7;
// STYLE §7 "one meaning per call"; issue 10 item 3). Every call takes device
// memory, is enqueued on stream() and returns once the backend has accepted
// it (NCCL's contract): completion is stream-ordered, and Synchronize() is
// the one call that waits (with the group's deadline). Every call is
// capturable in a CUDA graph except Synchronize and Split.
//
// Host-memory, blocking calls are the other type, core::ControlCollective;
// kernels::StagedControlCollective gives that view of a StreamCollective.
//
// Errors of every call: kInvalidArgument (span sizes, negative counts),
// kFailedPrecondition (the communicator was aborted by an earlier error: form
// a new group), kUnavailable (backend error; the communicator is aborted),
// kDeadlineExceeded (not accepted or not complete within the group's
// timeout; aborted too). Not thread-safe: one caller thread per object; the
// device given at creation is made current by every call.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::kernels {

// One all-to-all-v of a grouped exchange (StreamCollective::GroupedAllToAllV):
// `send` holds the bytes for peer p at offset sum(send_bytes[0..p)), `recv`
// receives peer p's bytes at offset sum(recv_bytes[0..p)). Device memory.
struct AllToAllVPart {
  const void* send = nullptr;
  absl::Span<const int64_t> send_bytes;  // [size()]
  void* recv = nullptr;
  absl::Span<const int64_t> recv_bytes;  // [size()]
};

class StreamCollective {
 public:
  virtual ~StreamCollective() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // The CUDA device and the stream every call is enqueued on.
  virtual int device() const = 0;
  virtual cudaStream_t stream() const = 0;
  // False after an error or timeout aborted the communicator.
  virtual bool healthy() const = 0;
  // False for a rank masked out of the group (kernels/masked_stream_collective.h;
  // DESIGN §15): it moves nothing and its agreement rows are skipped.
  virtual bool IsLive(int /*rank*/) const { return true; }

  // As core::ControlCollective::AllToAllV, on device memory, enqueued.
  virtual absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                                 absl::Span<const int64_t> recv_bytes) = 0;
  // Several all-to-all-v's in one group (one launch; parts matched per peer
  // in the order given, so every rank passes the same parts in the same
  // order). Errors: kInvalidArgument (no parts, span sizes, negative counts).
  virtual absl::Status GroupedAllToAllV(absl::Span<const AllToAllVPart> parts) = 0;
  // `recv` receives size() * bytes_per_rank bytes, rank-major.
  virtual absl::Status AllGather(const void* send, int64_t bytes_per_rank, void* recv) = 0;
  // In-place sum of `count` floats.
  virtual absl::Status AllReduceSum(float* data, int64_t count) = 0;

  // Waits until all work enqueued on stream() has finished, with the group's
  // deadline (kDeadlineExceeded, then the communicator is aborted).
  virtual absl::Status Synchronize() = 0;
  // Aborts the communicator; later calls return kFailedPrecondition.
  virtual void Abort() = 0;
  // As core::ControlCollective::SetCallDeadline: Synchronize and the waits
  // for NCCL end by min(start + the group's timeout, `deadline`).
  virtual void SetCallDeadline(absl::Time deadline) = 0;

  // A sub-group of `ranks` (ascending, containing this rank), on the same
  // device with its own stream. Blocking and collective over this group.
  virtual absl::StatusOr<std::unique_ptr<StreamCollective>> Split(absl::Span<const int> ranks,
                                                                  const std::string& tag) = 0;
};

}  // namespace moe_ep::kernels
