#include <nccl.h>
#include <nccl_device.h>

#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/onesided/nccl_peer_window.h"

namespace moe_ep::kernels::onesided {
namespace {

using internal::CudaStatus;

// Thread r: the address of world rank r's window in this rank's mapping.
__global__ void PeerPointersKernel(ncclWindow_t window, int size, void** out) {
  const int r = threadIdx.x;
  if (r < size) out[r] = ncclGetPeerPointer(window, 0, r);
}

// Fills host `out` [size] with the peers' addresses through device `table`.
absl::Status ReadPeerTable(ncclWindow_t window, int size, void** table, cudaStream_t s,
                           void** out) {
  PeerPointersKernel<<<1, size, 0, s>>>(window, size, table);
  RETURN_IF_ERROR(internal::LaunchStatus("PeerPointersKernel"));
  RETURN_IF_ERROR(
      CudaStatus(cudaMemcpyAsync(static_cast<void*>(out), static_cast<const void*>(table),
                                 size * sizeof(void*), cudaMemcpyDeviceToHost, s),
                 "cudaMemcpyAsync(peer table)"));
  return CudaStatus(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

class NcclPeerWindows final : public PeerWindows {
 public:
  NcclPeerWindows(NcclCollective* collective, int64_t bytes)
      : collective_(collective), bytes_(bytes) {}
  ~NcclPeerWindows() override {
    if (dev_comm_created_) {
      collective_
          ->CallComm("ncclDevCommDestroy",
                     [&](ncclComm_t c) { return ncclDevCommDestroy(c, &dev_comm_); })
          .IgnoreError();
    }
    if (window_ != nullptr) {
      collective_
          ->CallComm("ncclCommWindowDeregister",
                     [&](ncclComm_t c) { return ncclCommWindowDeregister(c, window_); })
          .IgnoreError();
    }
    if (base_ != nullptr) {
      cudaSetDevice(collective_->device());
      ncclMemFree(base_);
    }
  }
  int rank() const override { return collective_->rank(); }
  int size() const override { return collective_->size(); }
  int64_t bytes() const override { return bytes_; }
  int device() const override { return collective_->device(); }
  void* window(int r) const override { return peers_[r]; }
  // NCCL refuses two ranks on one GPU: only a group of one shares a device.
  bool same_device() const override { return collective_->size() == 1; }
  const char* provider() const override { return "nccl-lsa"; }

  absl::Status Init() {
    const int size = collective_->size();
    // Symmetric registration wants 4096-aligned sizes; round to the 2 MiB
    // cuMem granularity NCCL's allocator uses.
    const size_t alloc = (static_cast<size_t>(bytes_) + (size_t{2} << 20) - 1) / (size_t{2} << 20) *
                         (size_t{2} << 20);
    RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
    const ncclResult_t m = ncclMemAlloc(&base_, alloc);
    if (m != ncclSuccess) {
      base_ = nullptr;
      return absl::ResourceExhaustedError(absl::StrFormat("ncclMemAlloc(%d bytes) on rank %d: %s",
                                                          alloc, rank(), ncclGetErrorString(m)));
    }
    cudaStream_t s = collective_->stream();
    RETURN_IF_ERROR(CudaStatus(cudaMemsetAsync(base_, 0, alloc, s), "cudaMemsetAsync(window)"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(s), "cudaStreamSynchronize"));
    RETURN_IF_ERROR(collective_->CallComm("ncclCommWindowRegister", [&](ncclComm_t c) {
      return ncclCommWindowRegister(c, base_, alloc, &window_, NCCL_WIN_COLL_SYMMETRIC);
    }));
    ncclDevCommRequirements reqs;
    std::memset(&reqs, 0, sizeof(reqs));  // 2.28.9: no initializer macro
    RETURN_IF_ERROR(collective_->CallComm("ncclDevCommCreate", [&](ncclComm_t c) {
      return ncclDevCommCreate(c, &reqs, &dev_comm_);
    }));
    dev_comm_created_ = true;
    if (dev_comm_.lsaSize != size) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "NCCL peer windows: rank %d's load/store team has %d of the group's %d ranks (ranks on "
          "other nodes); use the NCCL network path",
          rank(), dev_comm_.lsaSize, size));
    }
    void** table = nullptr;
    RETURN_IF_ERROR(
        CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&table), size * sizeof(void*), s),
                   "cudaMallocAsync(peer table)"));
    peers_.assign(size, nullptr);
    const absl::Status read = ReadPeerTable(window_, size, table, s, peers_.data());
    cudaFreeAsync(static_cast<void*>(table), s);
    cudaStreamSynchronize(s);
    return read;
  }

 private:
  NcclCollective* collective_;
  int64_t bytes_;
  void* base_ = nullptr;
  ncclWindow_t window_ = nullptr;
  ncclDevComm dev_comm_{};
  bool dev_comm_created_ = false;
  std::vector<void*> peers_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PeerWindows>> CreateNcclPeerWindows(NcclCollective* collective,
                                                                   int64_t bytes) {
  if (collective == nullptr) return absl::InvalidArgumentError("collective: must not be null");
  if (bytes < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("bytes: expected >= 1, got %d", bytes));
  }
  auto windows = std::make_unique<NcclPeerWindows>(collective, bytes);
  RETURN_IF_ERROR(windows->Init());
  return std::unique_ptr<PeerWindows>(std::move(windows));
}

}  // namespace moe_ep::kernels::onesided

namespace moe_ep::kernels::internal {

const void* NcclPeerWindowModule() {
  return reinterpret_cast<const void*>(&onesided::PeerPointersKernel);
}

}  // namespace moe_ep::kernels::internal
