#include "kernels/onesided/peer_window.h"

#include <cuda_runtime.h>

#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels::onesided {

using internal::CudaStatus;

namespace {

// cudaMalloc + zero + wait, so no peer can see the window before it is zero.
absl::StatusOr<void*> AllocateZeroedWindow(int device, int64_t bytes) {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  void* p = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, bytes),
                             absl::StrFormat("cudaMalloc(peer window, %d bytes)", bytes)));
  // A private stream: never a device-wide sync (ranks sharing the GPU may be
  // mid-step on their own streams).
  cudaStream_t stream = nullptr;
  absl::Status s = CudaStatus(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                              "cudaStreamCreateWithFlags");
  if (s.ok()) s = CudaStatus(cudaMemsetAsync(p, 0, bytes, stream), "cudaMemsetAsync(peer window)");
  if (s.ok()) s = CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize(peer window)");
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (!s.ok()) {
    cudaFree(p);
    return s;
  }
  return p;
}

}  // namespace

// ---------------------------------------------------------------- threads --

class ThreadPeerWindows final : public PeerWindows {
 public:
  ThreadPeerWindows(std::shared_ptr<ThreadWindowGroup> group, int rank, int device)
      : group_(std::move(group)), rank_(rank), device_(device) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  int64_t bytes() const override { return group_->bytes_; }
  int device() const override { return device_; }
  void* window(int r) const override { return group_->windows_[r]; }
  bool same_device() const override {
    for (int d : group_->devices_) {
      if (d != device_) return false;
    }
    return true;
  }
  const char* provider() const override { return "threads"; }

 private:
  std::shared_ptr<ThreadWindowGroup> group_;  // keeps every window alive
  int rank_;
  int device_;
};

absl::StatusOr<std::shared_ptr<ThreadWindowGroup>> ThreadWindowGroup::Create(int size) {
  if (size < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("size: expected >= 1, got %d", size));
  }
  return std::shared_ptr<ThreadWindowGroup>(new ThreadWindowGroup(size));
}

ThreadWindowGroup::~ThreadWindowGroup() {
  for (size_t r = 0; r < windows_.size(); ++r) {
    if (windows_[r] == nullptr) continue;
    cudaSetDevice(devices_[r]);
    cudaFree(windows_[r]);
  }
}

absl::StatusOr<std::unique_ptr<PeerWindows>> ThreadWindowGroup::Join(int rank, int device,
                                                                     int64_t bytes,
                                                                     absl::Duration timeout) {
  if (rank < 0 || rank >= size_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("rank: expected in [0, %d), got %d", size_, rank));
  }
  if (bytes < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("bytes: expected >= 1, got %d", bytes));
  }
  {
    absl::MutexLock lock(&mu_);
    if (windows_[rank] != nullptr || devices_[rank] >= 0) {
      return absl::InvalidArgumentError(absl::StrFormat("rank %d joined twice", rank));
    }
    if (bytes_ != 0 && bytes_ != bytes) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "window bytes: rank %d asks for %d, an earlier rank for %d", rank, bytes, bytes_));
    }
    bytes_ = bytes;
    devices_[rank] = device;  // claims the rank before the (unlocked) allocation
  }
  absl::StatusOr<void*> window = AllocateZeroedWindow(device, bytes);
  absl::MutexLock lock(&mu_);
  if (!window.ok()) {
    devices_[rank] = -1;
    return window.status();
  }
  windows_[rank] = *window;
  ++joined_;
  auto all_joined = [this]() { return joined_ == size_; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&all_joined), timeout)) {
    int missing = 0;
    while (missing < size_ && windows_[missing] != nullptr) ++missing;
    return absl::DeadlineExceededError(
        absl::StrFormat("peer windows: rank %d did not join within %s (rank %d waited)", missing,
                        absl::FormatDuration(timeout), rank));
  }
  for (int r = 0; r < size_; ++r) {
    if (devices_[r] == device) continue;
    int can = 0;
    RETURN_IF_ERROR(
        CudaStatus(cudaDeviceCanAccessPeer(&can, device, devices_[r]), "cudaDeviceCanAccessPeer"));
    if (!can) {
      return absl::FailedPreconditionError(
          absl::StrFormat("peer windows: device %d (rank %d) cannot access device %d (rank %d)",
                          device, rank, devices_[r], r));
    }
    const cudaError_t e = cudaDeviceEnablePeerAccess(devices_[r], 0);
    if (e == cudaErrorPeerAccessAlreadyEnabled) {
      cudaGetLastError();
    } else {
      RETURN_IF_ERROR(CudaStatus(e, "cudaDeviceEnablePeerAccess"));
    }
  }
  return std::unique_ptr<PeerWindows>(new ThreadPeerWindows(shared_from_this(), rank, device));
}

// --------------------------------------------------------------- CUDA IPC --

namespace {

// What each rank all-gathers: its window's IPC handle and size.
struct IpcRecord {
  cudaIpcMemHandle_t handle;
  int64_t bytes;
  char uuid[16];  // the window's GPU (cudaDeviceProp::uuid)
};

class IpcPeerWindows final : public PeerWindows {
 public:
  IpcPeerWindows(int rank, int device, int64_t bytes, std::vector<void*> windows)
      : rank_(rank), device_(device), bytes_(bytes), windows_(std::move(windows)) {}
  void set_same_device(bool same) { same_device_ = same; }
  ~IpcPeerWindows() override {
    cudaSetDevice(device_);
    for (int r = 0; r < static_cast<int>(windows_.size()); ++r) {
      if (windows_[r] == nullptr) continue;
      if (r == rank_) {
        cudaFree(windows_[r]);
      } else {
        cudaIpcCloseMemHandle(windows_[r]);
      }
    }
  }
  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(windows_.size()); }
  int64_t bytes() const override { return bytes_; }
  int device() const override { return device_; }
  void* window(int r) const override { return windows_[r]; }
  bool same_device() const override { return same_device_; }
  const char* provider() const override { return "cuda-ipc"; }
  // Records an opened peer handle (closed by the destructor).
  void set_window(int r, void* p) { windows_[r] = p; }

 private:
  int rank_;
  int device_;
  int64_t bytes_;
  std::vector<void*> windows_;  // own (cudaMalloc) at rank_, opened handles elsewhere
  bool same_device_ = false;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerWindows>> CreateIpcPeerWindows(core::ControlCollective* control,
                                                                  int device, int64_t bytes) {
  if (control == nullptr) return absl::InvalidArgumentError("control: must not be null");
  if (bytes < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("bytes: expected >= 1, got %d", bytes));
  }
  const int rank = control->rank();
  const int size = control->size();
  ASSIGN_OR_RETURN(void* own, AllocateZeroedWindow(device, bytes));
  std::vector<void*> windows(size, nullptr);
  windows[rank] = own;
  // From here the object owns what is opened, so every error path cleans up.
  auto result = std::make_unique<IpcPeerWindows>(rank, device, bytes, std::move(windows));
  IpcRecord mine;
  std::memset(&mine, 0, sizeof(mine));
  mine.bytes = bytes;
  RETURN_IF_ERROR(CudaStatus(cudaIpcGetMemHandle(&mine.handle, own), "cudaIpcGetMemHandle"));
  cudaDeviceProp prop;
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties"));
  std::memcpy(mine.uuid, prop.uuid.bytes, sizeof(mine.uuid));
  std::vector<IpcRecord> all(size);
  RETURN_IF_ERROR(control->AllGather(&mine, sizeof(mine), all.data()));
  bool same = true;
  for (int r = 0; r < size; ++r) {
    same = same && std::memcmp(all[r].uuid, mine.uuid, sizeof(mine.uuid)) == 0;
    if (all[r].bytes != bytes) {
      return absl::InvalidArgumentError(
          absl::StrFormat("peer windows: rank %d has a %d-byte window, rank %d %d bytes; every "
                          "rank sizes its window from the same workspace and flags (e.g. "
                          "moe-ep-worker --onesided-receive-buffers on every worker or none)",
                          r, all[r].bytes, rank, bytes));
    }
  }
  result->set_same_device(same);
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    void* p = nullptr;
    RETURN_IF_ERROR(CudaStatus(
        cudaIpcOpenMemHandle(&p, all[r].handle, cudaIpcMemLazyEnablePeerAccess),
        absl::StrFormat("cudaIpcOpenMemHandle(window of rank %d, on rank %d)", r, rank)));
    result->set_window(r, p);
  }
  return std::unique_ptr<PeerWindows>(std::move(result));
}

}  // namespace moe_ep::kernels::onesided
