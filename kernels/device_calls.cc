#include "kernels/device_calls.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda_status.h"
#include "kernels/nccl_collective.h"

namespace moe_ep::kernels {

int VisibleDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return count;
}

absl::StatusOr<DeviceProperties> QueryDevice(int device) {
  cudaDeviceProp props;
  const cudaError_t error = cudaGetDeviceProperties(&props, device);
  if (error != cudaSuccess) {
    cudaGetLastError();
    return absl::UnavailableError(
        absl::StrCat("cudaGetDeviceProperties(device ", device, "): ", cudaGetErrorString(error)));
  }
  return DeviceProperties{props.name, static_cast<int64_t>(props.totalGlobalMem)};
}

absl::Status SetDevice(int device) {
  return CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")"));
}

absl::Status CopyToDeviceAsync(void* dst, const void* src, int64_t bytes, cudaStream_t stream,
                               absl::string_view what) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream),
                    absl::StrCat("cudaMemcpyAsync(", what, ")"));
}

absl::Status CopyToHostAsync(void* dst, const void* src, int64_t bytes, cudaStream_t stream,
                             absl::string_view what) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream),
                    absl::StrCat("cudaMemcpyAsync(", what, ")"));
}

absl::Status CopyToHost(void* dst, const void* src, int64_t bytes, absl::string_view what) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost),
                    absl::StrCat("cudaMemcpy(", what, ")"));
}

absl::Status SynchronizeStream(cudaStream_t stream, absl::string_view what) {
  return CudaStatus(cudaStreamSynchronize(stream),
                    absl::StrCat("cudaStreamSynchronize(", what, ")"));
}

absl::StatusOr<bool> StreamIsCapturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamIsCapturing(stream, &capturing), "cudaStreamIsCapturing(stream)"));
  return capturing != cudaStreamCaptureStatusNone;
}

void PinnedFree::operator()(void* p) const {
  if (p != nullptr) cudaFreeHost(p);
}

absl::StatusOr<PinnedHostMemory> AllocatePinned(int64_t bytes, absl::string_view what) {
  void* p = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&p, bytes),
                             absl::StrCat("cudaMallocHost(", what, ", ", bytes, " bytes)")));
  return PinnedHostMemory(p);
}

absl::StatusOr<std::string> PciBusId(int device) {
  char bus[64] = {0};
  RETURN_IF_ERROR(CudaStatus(cudaDeviceGetPCIBusId(bus, sizeof(bus) - 1, device),
                             absl::StrCat("cudaDeviceGetPCIBusId(", device, ")")));
  return std::string(bus);
}

bool CanReachPeer(int device, const std::string& peer_bus) {
  int peer = -1;
  int can = 0;
  if (cudaDeviceGetByPCIBusId(&peer, peer_bus.c_str()) != cudaSuccess ||
      cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return can != 0;
}

bool DevicePointerCache::IsDevicePointer(const void* ptr, int device) {
  if (ptr == nullptr) return false;
  auto it = device_.find(ptr);
  const auto ok = [&] {
    return device < 0 || it->second == kManagedMemory || it->second == device;
  };
  if (it != device_.end()) {
    if (ok()) return true;
    // A remembered address of another device is looked up again before it
    // is refused: freed, its range may have gone to another device's memory.
    device_.erase(it);
  }
  const int ordinal = kernels::DeviceOrdinalOf(ptr);
  if (ordinal == kNotDeviceMemory) return false;
  if (device_.size() >= kMaxEntries) device_.clear();
  it = device_.emplace(ptr, ordinal).first;
  return ok();
}

}  // namespace moe_ep::kernels
