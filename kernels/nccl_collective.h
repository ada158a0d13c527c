#pragma once

// The NCCL backend of kernels::StreamCollective (DESIGN §1, §8; issues 3, 10).
//
// Memory: device memory only. Every call is enqueued on stream() and returns
// once NCCL has accepted it; completion is stream-ordered; Synchronize()
// waits with the group's deadline. Capturable in a CUDA graph. Host-memory
// control calls go through kernels::StagedControlCollective, a
// core::ControlCollective over this object.
// The communicator is non-blocking (ncclConfig_t.blocking = 0): init, split
// and every enqueue are polled with ncclCommGetAsyncError against the
// deadline. On an NCCL error or timeout the communicator is revoked
// (ncclCommRevoke: its in-flight work stops; ncclCommAbort when revoking
// fails too) and the call returns kUnavailable (error) or kDeadlineExceeded
// (timeout); every later call returns kFailedPrecondition. A dead peer
// therefore becomes an error within `timeout`, never a hang (the destructor
// aborts, never waits: not on a peer, nor on CUDA graphs that captured this
// communicator's work and still exist, kernels/nccl_graph_refs.h). A
// revoked communicator can still be shrunk: the survivors of a lost rank
// call Shrink on it (DESIGN §15 rank masks). Every data call first asks
// CUDA whether stream() is capturing (NcclGraphRefs::NoteEnqueue): a
// failing query is returned as its CUDA status.
//
// Not thread-safe: one caller thread per object. The CUDA device given at
// creation is made current on the calling thread by every call.

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kernels/nccl_graph_refs.h"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {

class NcclCollective final : public StreamCollective {
 public:
  // A fresh ncclUniqueId as bytes (NCCL_UNIQUE_ID_BYTES = 128), made by rank
  // 0 and moved to the others through the rendezvous store (DESIGN §8).
  // Errors: kUnavailable (ncclGetUniqueId failed, e.g. no network interface).
  static absl::StatusOr<std::string> NewUniqueId();

  // Joins the group named by `unique_id` as `rank` of `size` on CUDA device
  // `device`. Collective: all `size` ranks must call it with the same id.
  // Errors: kInvalidArgument (id length != 128, rank outside [0, size),
  // size < 1, device out of range), kDeadlineExceeded (not all ranks joined
  // within `timeout`; the pending communicator is aborted), kUnavailable
  // (NCCL init error, with ncclGetErrorString and ncclGetLastError).
  static absl::StatusOr<std::unique_ptr<NcclCollective>> Create(const std::string& unique_id,
                                                                int rank, int size, int device,
                                                                std::chrono::milliseconds timeout);

  ~NcclCollective() override;
  NcclCollective(const NcclCollective&) = delete;
  NcclCollective& operator=(const NcclCollective&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int device() const override { return device_; }
  // The stream every call is enqueued on (owned, non-blocking).
  cudaStream_t stream() const override { return stream_; }
  bool healthy() const override { return comm_ != nullptr && !revoked_; }

  absl::Status AllToAllV(const void* send, absl::Span<const int64_t> send_bytes, void* recv,
                         absl::Span<const int64_t> recv_bytes) override;
  absl::Status AllGather(const void* send, int64_t bytes_per_rank, void* recv) override;
  // Several all-to-all-v's in one NCCL group (one kernel launch for all of
  // them; per peer, parts are matched in the order given, so every rank must
  // pass the same number of parts in the same order). The data plane uses it
  // to move the step header with the payload. REQUIRES: device memory (not
  // checked per call: this is the step path). Enqueued on stream(),
  // capturable. Errors: kInvalidArgument (no parts, span sizes != size(),
  // negative counts), then as AllToAllV.
  absl::Status GroupedAllToAllV(absl::Span<const AllToAllVPart> parts) override;
  absl::Status AllReduceSum(float* data, int64_t count) override;
  // ncclCommSplit with color = the lowest rank of `ranks`, key = this rank.
  // The new collective uses the same device, a new stream and this timeout.
  absl::StatusOr<std::unique_ptr<StreamCollective>> Split(absl::Span<const int> ranks,
                                                          const std::string& tag) override;

  // Waits until all work enqueued on stream() has finished, polling NCCL's
  // async error; kDeadlineExceeded / kUnavailable (and abort) as above.
  absl::Status Synchronize() override;

  // Aborts the communicator (e.g. when the control plane learns a peer is
  // gone). Later calls return kFailedPrecondition. Where CUDA graphs that
  // captured its work still exist, returns before NCCL has freed it (the
  // abort finishes once they are destroyed: kernels/nccl_graph_refs.h).
  void Abort() override;

  // Rank masks (DESIGN §15; issue 17 item 3).
  //
  // Revoke(): stops the communicator's in-flight work (ncclCommRevoke) and
  // waits, with the group's timeout, until it is quiescent; the
  // communicator stays for Shrink, every other call returns
  // kFailedPrecondition. A survivor calls it when a mask round starts (a
  // peer is gone; an NCCL error revokes by itself). No-op when revoked
  // already. Errors: kFailedPrecondition (aborted earlier), kUnavailable /
  // kDeadlineExceeded (the communicator is then aborted).
  absl::Status Revoke();
  // Shrink(): ncclCommShrink without the `exclude` ranks (this
  // communicator's numbering, ascending; core::PlanShrink computes them):
  // the new communicator has size() - exclude.size() ranks, the others
  // closing the gaps in order, on this device with a new stream and this
  // timeout. Collective over the ranks not excluded (an excluded rank must
  // not call it). Abort mode (NCCL_SHRINK_ABORT: the parent's operations
  // are terminated first) when this communicator is revoked, the default
  // mode when it is healthy. An empty list is refused: ncclCommShrink
  // refuses a count of 0 and a revoked communicator allows no split (the
  // caller keeps a healthy communicator, or re-initialises a revoked one).
  // This object is left as it was (revoked, or healthy after a default-mode
  // shrink); the caller destroys it (ncclCommAbort) once the new one serves.
  // Errors: kInvalidArgument (an empty list, entries not ascending, outside
  // [0, size()), or this rank among them), kFailedPrecondition (aborted
  // earlier),
  // kDeadlineExceeded (not complete within the timeout), kUnavailable.
  absl::StatusOr<std::unique_ptr<NcclCollective>> Shrink(absl::Span<const int> exclude);
  // Whether Revoke() ran (by a call or after an NCCL error or timeout): only
  // Shrink with a non-empty list and destruction remain.
  bool revoked() const { return revoked_; }

  // Runs `call` on the communicator with this object's device current and
  // waits for it as every call here does (ncclInProgress polled against the
  // group's deadline; on error or timeout the communicator is aborted). For
  // NCCL set-up calls the data planes need beyond this interface: the
  // one-sided plane's window registration (ncclCommWindowRegister,
  // ncclDevCommCreate; kernels/onesided/nccl_peer_window.h). Never inside a
  // graph capture. Errors: kFailedPrecondition (aborted earlier),
  // kDeadlineExceeded, kUnavailable (naming `what`).
  absl::Status CallComm(const char* what, absl::FunctionRef<ncclResult_t(ncclComm_t)> call);
  void SetCallDeadline(absl::Time deadline) override { call_deadline_ = deadline; }

 private:
  NcclCollective() = default;
  absl::Status CheckUsable() const;
  // When a wait starting now must end: min(now + timeout_, call_deadline_).
  std::chrono::steady_clock::time_point WaitDeadline() const;
  // Polls ncclCommGetAsyncError until the last NCCL call is no longer
  // in progress; aborts on error or deadline.
  absl::Status WaitForNccl(ncclResult_t started, const char* what);
  absl::Status Fail(absl::Status status);
  // The child communicator of Shrink and Split: a new object on this device
  // with a new stream and this timeout, whose communicator `derive` makes
  // (ncclCommShrink or ncclCommSplit of comm_, with the non-blocking config
  // it is given), polled to completion within the timeout. `split`: the
  // parent takes part (ncclCommSplit), so it is polled too, and revoked
  // (Fail) when the split fails; a failed shrink leaves the parent as it
  // was. Errors: kDeadlineExceeded "<what>: not complete within N ms",
  // kUnavailable "<what>: <NCCL's error>", CUDA errors (device, stream).
  absl::StatusOr<std::unique_ptr<NcclCollective>> Derive(
      const std::string& what, bool split,
      absl::FunctionRef<ncclResult_t(ncclConfig_t*, ncclComm_t*)> derive);
  // Enqueues the grouped send/recv of AllToAllV on stream_.
  absl::Status EnqueueAllToAllV(const char* send, absl::Span<const int64_t> send_bytes, char* recv,
                                absl::Span<const int64_t> recv_bytes);
  // Posts the sends/recvs of one part (between ncclGroupStart and End).
  ncclResult_t PostAllToAllV(const char* send, absl::Span<const int64_t> send_bytes, char* recv,
                             absl::Span<const int64_t> recv_bytes);

  int rank_ = 0;
  int size_ = 0;
  int device_ = 0;
  std::chrono::milliseconds timeout_{0};
  absl::Time call_deadline_ = absl::InfiniteFuture();
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::string last_error_;
  bool revoked_ = false;      // ncclCommRevoke done: only Shrink and the destructor use comm_
  NcclGraphRefs graph_refs_;  // graphs that captured work on comm_
};

// True when `ptr` is device memory (or managed/registered memory usable by a
// kernel) of any device.
bool IsDevicePointer(const void* ptr);

// DeviceOrdinalOf() results that are not a device ordinal.
inline constexpr int kNotDeviceMemory = -1;  // nullptr, host memory, unknown to CUDA
inline constexpr int kManagedMemory = -2;    // managed memory: any device reads it

// The CUDA device ordinal whose memory `ptr` points into (device memory), or
// kManagedMemory or kNotDeviceMemory. Clears the error a failed lookup leaves.
int DeviceOrdinalOf(const void* ptr);

}  // namespace moe_ep::kernels
