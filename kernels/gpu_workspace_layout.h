#pragma once

// The GPU data plane's workspace (kernels::GpuEpDispatcher), one typed field
// per region of its one cudaMalloc, computed once (STYLE §7: DeepEP's
// LowLatencyLayout habit). With E = ep_size, N = capacity_tokens, H = hidden,
// K = top_k and row = 2H + 8K bytes, in allocation order, each region
// starting on a 128-byte boundary:
//   dispatch_send, dispatch_recv  [E, N, row]      hidden bf16 | K ids int32 | K weights fp32
//   combine_send, combine_recv    [E, N, H] bf16
//   token_slot                    [N, E] int32     slot of token t at destination d, or -1
//   send_counts                   [2, E] int32     tokens sent to each rank (the route), then
//                                                  tokens each rank sent here (the exchange)
//   header                        {epoch, R, T} int64
//   gathered_headers              [E, 3] int64     every rank's header, after the exchange
//   error                         StepHeaderError  first disagreement of the device check
//   header_replicas               [E, 3] int64     the header exchange's send side
//   dispatch_dequant              [E, N, 2H + 8K]  fp8_e4m3 only (size 0 otherwise, not in
//                                                  Regions()): the dequantized bf16 rows the
//                                                  expert compute reads
// With fp8_e4m3 dispatch, dispatch_send / dispatch_recv hold fp8 wire rows
// of H + H/32 + 8K bytes (kernels/fp8_dispatch.cuh; DESIGN §5).
// Expert scratch is the expert compute's own allocation
// (kernels/expert_compute.h), not part of this layout.
//
// Source: DESIGN §5, §6; issue 10 item 2.
// Example: E=2, N=3, H=64, K=2: dispatch_send {0, 896}, total 4096.

#include <vector>

#include "absl/status/statusor.h"
#include "core/workspace.h"

namespace moe_ep::kernels {

struct GpuWorkspaceLayout {
  core::LayoutRegion dispatch_send;
  core::LayoutRegion dispatch_recv;
  core::LayoutRegion combine_send;
  core::LayoutRegion combine_recv;
  core::LayoutRegion token_slot;
  core::LayoutRegion send_counts;
  core::LayoutRegion header;
  core::LayoutRegion gathered_headers;
  core::LayoutRegion error;
  core::LayoutRegion header_replicas;
  core::LayoutRegion dispatch_dequant;
  int64_t wire_row_bytes = 0;  // bytes of one dispatch_send / dispatch_recv row
  int64_t total_bytes = 0;     // the one allocation

  // Errors: kInvalidArgument (E, N, H or K < 1; core::DispatchBytesPerToken's
  // dtype errors), kOutOfRange (int64 overflow). Pure and thread-safe.
  static absl::StatusOr<GpuWorkspaceLayout> For(const core::WorkspaceSpec& spec);
  // The regions with their names, in allocation order (AllocateWorkspace's
  // breakdown on GPUs).
  std::vector<core::WorkspaceRegion> Regions() const;
};

}  // namespace moe_ep::kernels
