#pragma once

// Peer windows of the one-sided data plane (DESIGN §13, issue 15 item 1):
// every rank owns one device buffer (its receive window) and holds a device
// pointer to every peer's window that its kernels may store into and load
// from. The kernels see only that pointer table (PeerWindows::window), so
// they cannot tell the providers apart:
//   ThreadWindowGroup   ranks as threads of one process (one CUDA context,
//                       plain cudaMalloc'd buffers in one address space;
//                       peer access is enabled when ranks use distinct GPUs);
//   CreateIpcPeerWindows several processes, one window each, shared through
//                       CUDA IPC: cudaIpcGetMemHandle handles are plain bytes
//                       and travel through the group's control collective
//                       (an all-gather), so processes may share one GPU.
//   CreateNcclPeerWindows (kernels/onesided/nccl_peer_window.h) ranks on
//                       distinct GPUs: NCCL 2.28 symmetric windows, LSA
//                       peer pointers.
//
// Every window is zeroed before any rank can see it, and it lives until
// every rank that maps it has dropped its PeerWindows (threads: the group
// owns the buffers; IPC: see CreateIpcPeerWindows).
// No CUDA driver-API call is made here (runtime API only), so nothing links
// libcuda. Source: DESIGN §13; issue 15.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/collective.h"

namespace moe_ep::kernels::onesided {

// One rank's view of its group's windows. Thread-compatible (const after
// creation).
class PeerWindows {
 public:
  virtual ~PeerWindows() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Bytes of every window (all ranks' windows have the same size).
  virtual int64_t bytes() const = 0;
  // CUDA device this rank's window lives on (current for its kernels).
  virtual int device() const = 0;
  // Device pointer to rank `r`'s window, valid in this process's kernels on
  // device(); r in [0, size()). window(rank()) is this rank's own.
  virtual void* window(int r) const = 0;
  // True when every rank's window is on device() (ranks share one GPU):
  // the kernels then order their stores at GPU scope instead of system
  // scope.
  virtual bool same_device() const = 0;
  // "threads", "cuda-ipc" or "nccl-lsa", for logs and benchmark rows.
  virtual const char* provider() const = 0;
};

// Provider (a): the ranks of one group are threads of this process. Make one
// group per group of ranks, share it among the threads, and let each rank's
// thread Join it. Thread-safe.
class ThreadWindowGroup : public std::enable_shared_from_this<ThreadWindowGroup> {
 public:
  // Errors: kInvalidArgument (size < 1).
  static absl::StatusOr<std::shared_ptr<ThreadWindowGroup>> Create(int size);
  ~ThreadWindowGroup();
  ThreadWindowGroup(const ThreadWindowGroup&) = delete;
  ThreadWindowGroup& operator=(const ThreadWindowGroup&) = delete;

  // Collective among the group's threads: allocates and zeroes this rank's
  // window of `bytes` on `device` (made current on the calling thread), then
  // waits until all size() ranks have joined. Ranks on distinct devices get
  // peer access to each other (cudaDeviceEnablePeerAccess).
  // Errors: kInvalidArgument (rank outside [0, size), rank joined twice,
  // bytes < 1 or differing from an earlier rank's: both numbers named),
  // kDeadlineExceeded (not every rank joined within `timeout`: names the
  // first missing rank), kResourceExhausted / kInternal (CUDA).
  absl::StatusOr<std::unique_ptr<PeerWindows>> Join(int rank, int device, int64_t bytes,
                                                    absl::Duration timeout);

  int size() const { return size_; }

 private:
  explicit ThreadWindowGroup(int size) : size_(size), windows_(size, nullptr), devices_(size, -1) {}
  friend class ThreadPeerWindows;

  const int size_;
  absl::Mutex mu_;
  int64_t bytes_ = 0;
  std::vector<void*> windows_;  // owned; freed when the group goes
  std::vector<int> devices_;
  int joined_ = 0;
};

// Provider (b): one window per process, mapped into every peer through CUDA
// IPC. Collective over `control` (its rank and size are the group's): each
// rank cudaMallocs and zeroes `bytes` on `device`, all-gathers its
// cudaIpcMemHandle_t (64 bytes) with the window size, and opens every peer's
// handle (cudaIpcMemLazyEnablePeerAccess). Processes may share one GPU
// (processes without MPS time-slice it: correct, not fast).
// The returned object closes the peers' handles and frees its window when
// destroyed; destroy it only after a group barrier (no peer still stores
// into this window). Errors: kInvalidArgument (control null, bytes < 1, a
// rank's size differs: naming it), collective errors of the all-gather,
// kInternal (cudaIpcGetMemHandle / cudaIpcOpenMemHandle, naming the peer),
// kResourceExhausted (cudaMalloc).
absl::StatusOr<std::unique_ptr<PeerWindows>> CreateIpcPeerWindows(core::ControlCollective* control,
                                                                  int device, int64_t bytes);

}  // namespace moe_ep::kernels::onesided
