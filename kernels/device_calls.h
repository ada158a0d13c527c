#pragma once

// The CUDA runtime calls the GPU transports make around their kernels —
// device selection, the host <-> device copies of Forward and the engine
// calls, stream waits, pinned host memory, peer reachability — each as one
// function with a Status naming what it moved (DESIGN §1 and §17: CUDA calls
// live in kernels/; issue 34 item 3). Only on a CUDA build. Thread-safe
// (the CUDA runtime is); the streams and memory are the caller's.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe_ep::kernels {

// The CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied); 0
// without a driver or device (the error that leaves is cleared).
int VisibleDeviceCount();

// A device's name and its memory in bytes (cudaGetDeviceProperties).
struct DeviceProperties {
  std::string name;
  int64_t total_memory_bytes = 0;
};
// Errors: kUnavailable "cudaGetDeviceProperties(device <d>): ..." (the
// device is gone or the driver failed; a caller's range check comes first).
absl::StatusOr<DeviceProperties> QueryDevice(int device);

// Makes `device` current on the calling thread.
// Errors: kInternal "cudaSetDevice(<device>): <CUDA's words>".
absl::Status SetDevice(int device);

// Enqueues a copy of `bytes` bytes on `stream` from host `src` to device
// `dst` (CopyToDeviceAsync) or from device `src` to host `dst`
// (CopyToHostAsync). Pageable host memory makes the call return only once
// the bytes are staged (CUDA's rule); pinned memory returns at once. No
// copy when bytes is 0. Errors: kInternal "cudaMemcpyAsync(<what>): ...".
absl::Status CopyToDeviceAsync(void* dst, const void* src, int64_t bytes, cudaStream_t stream,
                               absl::string_view what);
absl::Status CopyToHostAsync(void* dst, const void* src, int64_t bytes, cudaStream_t stream,
                             absl::string_view what);

// A device -> host copy that returns once done, ordered after all work on
// the device (cudaMemcpy). Errors: kInternal "cudaMemcpy(<what>): ...".
absl::Status CopyToHost(void* dst, const void* src, int64_t bytes, absl::string_view what);

// Waits on the host for the work enqueued on `stream`.
// Errors: kInternal "cudaStreamSynchronize(<what>): ..." (a kernel's
// failure surfaces here).
absl::Status SynchronizeStream(cudaStream_t stream, absl::string_view what);

// Whether a CUDA graph capture of `stream` is open (active or invalidated).
// Errors: kInternal (cudaStreamIsCapturing).
absl::StatusOr<bool> StreamIsCapturing(cudaStream_t stream);

// Pinned host memory (cudaMallocHost), freed by the deleter.
struct PinnedFree {
  void operator()(void* p) const;
};
using PinnedHostMemory = std::unique_ptr<void, PinnedFree>;
// Errors: kResourceExhausted "cudaMallocHost(<what>, <bytes> bytes): ...",
// kInternal.
absl::StatusOr<PinnedHostMemory> AllocatePinned(int64_t bytes, absl::string_view what);

// The PCI bus id of `device` ("0000:1b:00.0"), which names one GPU in every
// process of a host (CUDA IPC's peers compare them).
// Errors: kInternal "cudaDeviceGetPCIBusId(<device>): ...".
absl::StatusOr<std::string> PciBusId(int device);

// Whether `device` can reach the GPU on PCI bus `peer_bus` peer to peer
// (false too when no visible device has that bus id). Clears the error a
// failed lookup leaves, so a later launch check does not see it.
bool CanReachPeer(int device, const std::string& peer_bus);

// DevicePointerCache
//
// DeviceOrdinalOf (kernels/nccl_collective.h) with a memory of the
// addresses already found to be device memory and of their device, so that
// an engine's steady-state calls, which pass the same buffers every step,
// cost a hash lookup per pointer rather than a cudaPointerGetAttributes (8
// per dispatch call; issue 30 item 3 bounds the call's host time at 10 us).
// A remembered "device memory" stays true: under unified addressing a device
// allocation's range is reserved from the host's address space, so a freed
// device address can only become device memory again or nothing, and
// passing freed memory is a use-after-free that no check before the kernel
// could catch either. Its device may change (the range reused by another
// device's allocation): a remembered other device is looked up again before
// a refusal. Holds at most kMaxEntries addresses (then it starts again). Not
// thread-safe: one owner (a plane, whose calls hold its slot).
class DevicePointerCache {
 public:
  static constexpr size_t kMaxEntries = 4096;

  // True when `ptr` is device memory of CUDA device `device` (any device
  // when `device` < 0) or managed memory; false for nullptr, host memory,
  // addresses CUDA does not know and another device's memory (a kernel on
  // `device` would read it over the fabric or fault: the engine passed a
  // tensor of the wrong device, issue 30 item 3).
  bool IsDevicePointer(const void* ptr, int device = -1);

 private:
  // Address -> DeviceOrdinalOf(address): a device ordinal or kManagedMemory.
  absl::flat_hash_map<const void*, int> device_;
};

}  // namespace moe_ep::kernels
