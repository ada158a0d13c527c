#pragma once

// Payload and workspace sizing (DESIGN §5). All sizes in bytes; capacity in
// tokens per rank (never scaled by ep_size: sglang issue 25907).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe_ep::core {

// kFP8E4M3: e4m3 values with one fp32 scale per 128 (core/fp8_e4m3.h; issue
// 15 item 4). Appended last: the numeric values are part of fingerprints.
enum class DispatchDType { kBF16, kNVFP4, kMXFP8, kFP8E4M3 };

// "bf16", "nvfp4", "mxfp8", "fp8_e4m3".
std::string DispatchDTypeName(DispatchDType dtype);
// Inverse of DispatchDTypeName. Errors: kInvalidArgument naming the value.
absl::StatusOr<DispatchDType> ParseDispatchDType(const std::string& name);

struct WorkspaceSpec {
  int ep_size = 0;              // E
  int64_t capacity_tokens = 0;  // N, per rank
  int64_t hidden = 0;           // H, elements
  int top_k = 0;                // K
  DispatchDType dtype = DispatchDType::kBF16;
};

// Rounds up to a multiple of 128 bytes.
constexpr int64_t AlignTo128(int64_t bytes) { return (bytes + 127) / 128 * 128; }

// Bytes per dispatched token (DESIGN §5 table).
// bf16: 2H + 8K; nvfp4: H/2 + H/16 + 8K; mxfp8: H + H/32 + 8K;
// fp8_e4m3: H (e4m3) + 4 * H/128 (fp32 scales) + 8K = H + H/32 + 8K.
// Errors: kInvalidArgument for H < 1, K < 1, or H not a multiple of the
// dtype's block (nvfp4 16, mxfp8 32, fp8_e4m3 128).
absl::StatusOr<int64_t> DispatchBytesPerToken(DispatchDType dtype, int64_t hidden, int top_k);
// Bytes per combined token: 2H (bf16).
int64_t CombineBytesPerToken(int64_t hidden);

// Default capacity N: max(chunked_prefill_size, 4096).
int64_t DefaultCapacityTokens(int64_t chunked_prefill_size);

// The FlashInfer-compatible (one-sided NVLink) workspace per rank.
struct FlashInferWorkspace {
  int64_t aux_bytes = 0;
  int64_t dispatch_region_bytes = 0;  // A(E * N * dispatch_bytes)
  int64_t combine_region_bytes = 0;   // A(E * N * combine_bytes)
  int64_t total_bytes = 0;            // ws_per_rank
};

// Check values: E=2, N=3, H=64, K=2, bf16 -> aux 1152, total 2816;
// E=8, N=4096 -> aux 721280; E=16, N=4096 -> aux 721408;
// E=8, N=16384, H=7168, K=8, bf16 -> total 3,769,368,960.
// Errors: kInvalidArgument for E < 1, N < 1 and the DispatchBytesPerToken errors.
absl::StatusOr<FlashInferWorkspace> ComputeFlashInferWorkspace(const WorkspaceSpec& spec);
// Only the aux (metadata) part, which depends on E and N alone.
int64_t FlashInferAuxBytes(int ep_size, int64_t capacity_tokens);

// One 128-byte-aligned region of moe-ep's own allocation.
struct WorkspaceRegion {
  std::string name;
  int64_t offset_bytes = 0;
  int64_t size_bytes = 0;
};

// Where one region of a typed layout sits in its allocation. A layout object
// (CpuWorkspaceLayout here, kernels::GpuWorkspaceLayout for the GPU) is the
// only place that computes offsets; its users take pointers from it with At()
// and never re-derive a size (STYLE §7).
struct LayoutRegion {
  int64_t offset_bytes = 0;
  int64_t size_bytes = 0;
  // The region's first byte inside the allocation starting at `base`, as T*.
  template <typename T>
  T* At(void* base) const {
    return reinterpret_cast<T*>(static_cast<char*>(base) + offset_bytes);
  }
};

// What moe-ep's own two-sided data plane allocates per rank: dispatch send and
// receive [E, N, dispatch_bytes], combine send and receive [E, N, combine_bytes],
// and metadata (per-peer counts, per-token routing), each region starting on a
// 128-byte boundary.
struct AllocatedWorkspace {
  std::vector<WorkspaceRegion> regions;
  int64_t total_bytes = 0;
};

// The CPU data plane's workspace (core::EpDispatcher), one field per region,
// in allocation order: dispatch_send, dispatch_recv [E, N, dispatch_bytes],
// combine_send, combine_recv [E, N, 2H], dispatch_dequant [E, N, H] bf16
// (the dequantized rows the expert compute reads: fp8_e4m3 only, size 0
// otherwise and not listed by Regions()), metadata. total_bytes = end of the
// last region. Errors: as ComputeAllocatedWorkspace. Pure and thread-safe.
// Source: DESIGN §5; issue 10 item 2; issue 15 item 4.
// Example: E=2, N=3, H=64, K=2, bf16 -> dispatch_send {0, 896}.
struct CpuWorkspaceLayout {
  LayoutRegion dispatch_send;
  LayoutRegion dispatch_recv;
  LayoutRegion combine_send;
  LayoutRegion combine_recv;
  LayoutRegion dispatch_dequant;
  LayoutRegion metadata;
  int64_t total_bytes = 0;

  static absl::StatusOr<CpuWorkspaceLayout> For(const WorkspaceSpec& spec);
  // The regions with their names, for AllocateWorkspace's breakdown.
  std::vector<WorkspaceRegion> Regions() const;
};

// CpuWorkspaceLayout::For(spec) as a named list (what `moe-ep workspace` and
// the memory budget read). Errors: kInvalidArgument (sizes), kOutOfRange
// (int64 overflow).
absl::StatusOr<AllocatedWorkspace> ComputeAllocatedWorkspace(const WorkspaceSpec& spec);

}  // namespace moe_ep::core
