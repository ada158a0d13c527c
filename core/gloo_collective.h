#pragma once

// The Gloo (TCP) backend of the collective interface (core/collective.h): the
// data plane on CPU-only machines (CI, laptops, the embedded local cluster).
//
// Group formation: every rank creates a TCP device bound to `host`, then a
// gloo::rendezvous::Context connects the full mesh through the caller's
// rendezvous Store under `prefix`. Store keys are write-once, so each group
// generation must use a fresh prefix (the worker passes "gen<N>"). Gloo reads
// no environment variables: the bind address comes from the caller.
//
// Errors at this boundary: Gloo throws (gloo::IoException, EnforceNotMet,
// std::exception) on timeouts and dead peers; every throw is caught here and
// becomes kDeadlineExceeded (a timeout: store wait, read/write or an operation
// exceeding `timeout`) or kUnavailable (peer closed the connection, reset).
// After either, the group is broken: every later call returns
// kFailedPrecondition "group broken by earlier error: ...; re-join", and
// this rank closes its connections at once, so that peers waiting on it
// fail within milliseconds rather than the timeout (a dead peer cascades).
//
// Not thread-safe: one caller thread per object. Distinct objects (ranks of
// one process, sub-groups) may be used from different threads.
// Source: DESIGN §1 (Gloo backend), §8 (Join with a per-generation prefix);
// Gloo 2022 API (/usr/include/gloo).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "core/collective.h"

namespace gloo {
class Context;
namespace rendezvous {
class Store;
class PrefixStore;
}  // namespace rendezvous
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace moe_ep::core {

class GlooCollective : public ControlCollective {
 public:
  // Forms rank `rank` of a `size`-rank group: binds a TCP device to `host`
  // (an address or hostname of this machine, e.g. "127.0.0.1"), publishes its
  // address under `prefix` in `store`, and connects to every peer. Blocks
  // until all `size` ranks have connected (Create ends with a barrier), or
  // `timeout` passes. `timeout` also bounds every later collective call.
  // Errors:
  //   kInvalidArgument    store null, prefix empty, size < 1, rank outside
  //                       [0, size), timeout <= 0, or `host` cannot be bound.
  //   kDeadlineExceeded   a peer did not publish its address within timeout.
  //   kUnavailable        connecting to a peer failed.
  // Process-wide effect: when SIGPIPE is at its default action, Create sets it
  // to ignored. Gloo writes to peer sockets with writev, so a peer that has
  // closed its end would otherwise kill this process instead of surfacing as
  // kUnavailable (seen as a flaky SIGPIPE death in the missing-peer test).
  static absl::StatusOr<std::unique_ptr<GlooCollective>> Create(
      std::shared_ptr<gloo::rendezvous::Store> store, const std::string& prefix, int rank, int size,
      const std::string& host, absl::Duration timeout);

  ~GlooCollective() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }
  // The rendezvous prefix this group formed under.
  const std::string& prefix() const { return prefix_; }
  // OK while usable; otherwise the error that broke the group.
  const absl::Status& broken_status() const { return broken_; }

  // Errors (all calls): kFailedPrecondition once broken, kDeadlineExceeded,
  // kUnavailable as above, plus the argument checks of core/collective.h.
  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes) override;
  absl::Status AllGather(const void* send, int64_t bytes_per_rank, void* recv) override;
  absl::Status AllReduceSum(float* data, int64_t count) override;
  absl::Status Barrier() override;
  void SetCallDeadline(absl::Time deadline) override { call_deadline_ = deadline; }

  // A new GlooCollective over `ranks` (this rank's index in `ranks` becomes
  // its rank), formed under the rendezvous prefix `prefix() + "/" + tag` with
  // its own device and context. Only the members of `ranks` rendezvous; the
  // same timeout and host apply. Errors: kInvalidArgument (ranks empty,
  // unsorted or duplicated, out of range, missing this rank; tag empty),
  // kFailedPrecondition once broken, and the Create errors.
  absl::StatusOr<std::unique_ptr<ControlCollective>> Split(absl::Span<const int> ranks,
                                                           const std::string& tag) override;

 private:
  GlooCollective(std::shared_ptr<gloo::rendezvous::Store> store, std::string prefix, int rank,
                 int size, std::string host, absl::Duration timeout);

  // The timeout of an operation starting now: min(timeout_, the time left
  // to call_deadline_), at least 1 ms.
  absl::Duration OpTimeout() const;

  // Runs `op` (which may throw) unless the group is broken; converts a throw
  // into a Status and marks the group broken.
  template <typename Op>
  absl::Status Guarded(const char* op_name, Op&& op);

  std::shared_ptr<gloo::rendezvous::Store> store_;
  std::unique_ptr<gloo::rendezvous::PrefixStore> prefix_store_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  std::string prefix_;
  int rank_;
  int size_;
  std::string host_;
  absl::Duration timeout_;
  absl::Time call_deadline_ = absl::InfiniteFuture();
  absl::Status broken_;
  uint32_t next_tag_ = 0;
  // Stands in for null or zero-length user buffers: Gloo wants a pointer.
  alignas(16) char dummy_[16] = {};
};

}  // namespace moe_ep::core
