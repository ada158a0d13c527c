#pragma once

// The control collective: host memory, blocking, deadline-bounded. One object
// per (group, rank). Every call has completed when it returns. Backends: Gloo
// over TCP (core/gloo_collective.h, also the CPU data plane's payload path)
// and, for GPU groups, kernels::StagedControlCollective over an NCCL stream
// collective. The GPU payload path is the other type,
// kernels::StreamCollective (device memory, returns when enqueued): one
// meaning per call (STYLE §7, issue 10 item 3).
//
// Every call is a collective: all ranks of the group must make the same calls
// in the same order. A call that does not complete within the group's timeout
// returns kDeadlineExceeded; a peer that disappears gives kUnavailable. After
// either, the group is broken: every later call returns kFailedPrecondition and
// the caller must form a new group (a new generation, DESIGN §8).
//
// Not thread-safe: one caller thread per object.
// Source: DESIGN §1 (collective interface), §6 (all-gather of token counts),
// §7 (all-to-all of dispatch and combine payloads).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace moe_ep::core {

class ControlCollective {
 public:
  virtual ~ControlCollective() = default;

  // This rank's index in the group, in [0, size()).
  virtual int rank() const = 0;
  // Number of ranks in the group.
  virtual int size() const = 0;
  // "gloo" or "nccl".
  virtual std::string backend() const = 0;

  // All-to-all with per-peer byte counts. `send` holds the bytes for peer 0,
  // then peer 1, ... packed back to back; `send_bytes[p]` is the count for peer
  // p. `recv` receives peer 0's bytes, then peer 1's, ...; `recv_bytes[p]` must
  // equal what peer p sends to this rank (exchange counts first, e.g. with
  // AllGather). Both spans have size() entries. Counts may be zero.
  // Errors: kInvalidArgument (span sizes, negative counts), plus the group
  // errors above.
  virtual absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                                 absl::Span<const int64_t> recv_bytes) = 0;

  // All-gather of `bytes_per_rank` bytes from every rank: `recv` receives
  // size() * bytes_per_rank bytes, rank-major. bytes_per_rank may be zero.
  virtual absl::Status AllGather(const void* send, int64_t bytes_per_rank, void* recv) = 0;

  // In-place element-wise sum of `count` floats across the group.
  virtual absl::Status AllReduceSum(float* data, int64_t count) = 0;

  // Returns when every rank has entered the barrier.
  virtual absl::Status Barrier() = 0;

  // Bounds the waits of every later call on this object: each ends by
  // min(its start + the group's timeout, `deadline`), so a call made for a
  // gRPC request gives up when its caller does (issue 13 item 6).
  // absl::InfiniteFuture() (the initial value) leaves the group's timeout
  // alone. A call that runs out of time returns kDeadlineExceeded and breaks
  // the group, as a timeout does. Sub-groups made by Split keep their own.
  virtual void SetCallDeadline(absl::Time deadline) = 0;

  // Whether `rank` takes part in this group's calls: false only for a rank
  // masked out after it was lost (core/masked_collective.h), whose AllGather
  // rows are zeros and with which AllToAllV moves nothing. REQUIRES:
  // 0 <= rank < size().
  virtual bool IsLive(int /*rank*/) const { return true; }

  // Forms a sub-group of the ranks in `ranks` (ascending, each in [0, size()),
  // containing this rank). Collective over the whole group: every rank calls
  // Split with its own sub-group's member list, in the same order of calls.
  // `tag` names the sub-group uniquely within this group (e.g. "attn_tp.1"); the
  // backend derives a fresh rendezvous prefix from it.
  // Errors: kInvalidArgument (rank not in `ranks`, unsorted, out of range).
  virtual absl::StatusOr<std::unique_ptr<ControlCollective>> Split(absl::Span<const int> ranks,
                                                                   const std::string& tag) = 0;
};

// Convenience wrapper: all-gathers one int64 per rank. Returns size() values.
absl::StatusOr<std::vector<int64_t>> AllGatherInt64(ControlCollective& collective, int64_t value);

}  // namespace moe_ep::core
