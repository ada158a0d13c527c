#pragma once

// The order between a transport's own stream and the streams an engine's
// in-process calls name (DESIGN §14; issue 30 item 3: a call's host time).
// An engine call enqueues its kernels on the engine's stream itself rather
// than forking onto the transport's stream and joining back (an event
// record and a stream wait each way: four CUDA calls). In the steady state
// (the same engine stream, nothing else enqueued in between) a call costs
// one event record plus two host-side queries; a change of stream, or own
// work in between, adds one event record and one wait. A default stream
// (NULL, cudaStreamLegacy, cudaStreamPerThread) is forked from and joined
// back as before: launches into the legacy stream measured slower on the
// host than the fork and join. Only on a CUDA build. Thread-compatible:
// the transport serialises its calls.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe_ep::kernels {

class EngineStreamOrder {
 public:
  // `own` is the transport's stream (not owned; must outlive this). Create
  // on the transport's device. Errors: kInternal (cudaEventCreate).
  static absl::StatusOr<std::unique_ptr<EngineStreamOrder>> Create(cudaStream_t own);
  ~EngineStreamOrder();
  EngineStreamOrder(const EngineStreamOrder&) = delete;
  EngineStreamOrder& operator=(const EngineStreamOrder&) = delete;

  // Opens an engine call on `caller` and returns the stream its work goes
  // on: `caller`, ordered after every earlier piece of work (on the own
  // stream, or an earlier engine stream); for a default stream the own
  // stream, forked from `caller` (End joins it back). While a graph capture of `caller`
  // is open nothing is recorded or waited for (the graph's order is the
  // capture's; a replay is ordered by the engine). `caller` == own runs on
  // own. Every Begin must be followed by End, on error too.
  // Errors: kFailedPrecondition (a call already open), kInternal (CUDA).
  absl::StatusOr<cudaStream_t> Begin(cudaStream_t caller);
  // Closes the call: later work (the own stream after Settle, the next
  // engine call on another stream) is ordered after it. Errors: kInternal.
  absl::Status End();
  // Before work on the own stream outside an engine call: the own stream
  // then waits for the last engine call's work. Idempotent; no CUDA call
  // when the own stream already follows everything. Errors: kInternal.
  absl::Status Settle();

  // The stream work goes on now: the open call's, else own.
  cudaStream_t launch() const {
    return mode_ == Mode::kDirect || mode_ == Mode::kCaptured ? open_ : own_;
  }

 private:
  EngineStreamOrder() = default;
  cudaStream_t own_ = nullptr;
  cudaEvent_t fork_ = nullptr;  // own's work so far, for a caller to wait on
  cudaEvent_t join_ = nullptr;  // the last eager engine call's work
  // The open call: none; on the caller's stream (direct, or inside a
  // capture of it); or forked onto the own stream from a default stream.
  enum class Mode { kNone, kDirect, kCaptured, kForked };
  Mode mode_ = Mode::kNone;
  cudaStream_t open_ = nullptr;  // the open call's caller stream
  // The stream holding the latest work when it is an engine stream (join_
  // recorded at its end), by handle and by CUDA's stream id (a handle of a
  // destroyed stream can come back for a new one; ids are never reused).
  cudaStream_t tail_ = nullptr;
  unsigned long long tail_id_ = 0;  // NOLINT(google-runtime-int): cudaStreamGetId's type
};

}  // namespace moe_ep::kernels
