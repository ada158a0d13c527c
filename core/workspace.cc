#include "core/workspace.h"

// Payload and workspace sizing (DESIGN §5).
//
// Every product and sum goes through checked int64 arithmetic: a size that
// does not fit in int64 is kInvalidArgument naming the quantity, never a
// wrapped value.
//
// moe-ep's own allocation (ComputeAllocatedWorkspace), E = ep_size,
// N = capacity_tokens, each region starting on a 128-byte boundary:
//   dispatch_send  [E, N, dispatch_bytes]  per-destination token payloads
//   dispatch_recv  [E, N, dispatch_bytes]  per-source received payloads
//   combine_send   [E, N, combine_bytes]   expert outputs going back
//   combine_recv   [E, N, combine_bytes]   results from each destination
//   metadata       the step's bookkeeping, four 128-byte-aligned parts:
//                    send_counts  int64 [E]         tokens this rank sends to each peer
//                    recv_counts  int64 [E]         tokens each peer sends to this rank
//                    agreement    int64 [E, 3 + E]  every rank's (epoch, R, status,
//                                                   send_counts[E]) as all-gathered
//                    dest_slots   int64 [N, E]      slot of source token t at
//                                                   destination d, -1 when not sent
// total_bytes = end of the metadata region.

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

// Header fields of one rank's agreement record: epoch, R, status.
constexpr int64_t kAgreementHeader = 3;
// Top-k slots the FlashInfer aux region reserves per token (target ranks and
// send indices).
constexpr int64_t kFlashInferTopKSlots = 22;

absl::StatusOr<int64_t> Mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " overflows int64 (", a, " * ", b, ")"));
  }
  return out;
}

absl::StatusOr<int64_t> Add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " overflows int64 (", a, " + ", b, ")"));
  }
  return out;
}

absl::StatusOr<int64_t> Align(int64_t bytes, const char* what) {
  if (bytes > std::numeric_limits<int64_t>::max() - 127) {
    return absl::InvalidArgumentError(absl::StrCat(what, " overflows int64 when aligned to 128"));
  }
  return AlignTo128(bytes);
}

absl::Status ValidateSizes(int ep_size, int64_t capacity_tokens) {
  if (ep_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("ep_size must be >= 1, got ", ep_size));
  }
  if (capacity_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity_tokens must be >= 1, got ", capacity_tokens));
  }
  return absl::OkStatus();
}

// Appends a part of `bytes` at the next 128-byte boundary after `*end`;
// returns its offset.
absl::StatusOr<int64_t> Place(int64_t* end, int64_t bytes, const char* what) {
  ASSIGN_OR_RETURN(int64_t offset, Align(*end, what));
  ASSIGN_OR_RETURN(*end, Add(offset, bytes, what));
  return offset;
}

absl::StatusOr<int64_t> CheckedFlashInferAux(int ep_size, int64_t capacity_tokens) {
  RETURN_IF_ERROR(ValidateSizes(ep_size, capacity_tokens));
  const int64_t e = ep_size;
  // flag (4) + local counter (4) + send counters (4E) + recv counters (4E).
  int64_t end = 4 + 4 + 4 * e + 4 * e;
  ASSIGN_OR_RETURN(int64_t topk_bytes,
                   Mul(capacity_tokens, kFlashInferTopKSlots * 4, "aux top-k region"));
  RETURN_IF_ERROR(Place(&end, 4 * e, "aux dispatch flags").status());
  RETURN_IF_ERROR(Place(&end, 4 * e, "aux combine flags").status());
  RETURN_IF_ERROR(Place(&end, topk_bytes, "aux top-k target ranks").status());
  RETURN_IF_ERROR(Place(&end, topk_bytes, "aux top-k send indices").status());
  return Align(end, "aux");
}

// E * N * bytes_per_token.
absl::StatusOr<int64_t> SlabBytes(const WorkspaceSpec& spec, int64_t bytes_per_token,
                                  const char* what) {
  ASSIGN_OR_RETURN(int64_t tokens, Mul(spec.ep_size, spec.capacity_tokens, what));
  return Mul(tokens, bytes_per_token, what);
}

}  // namespace

std::string DispatchDTypeName(DispatchDType dtype) {
  switch (dtype) {
    case DispatchDType::kBF16:
      return "bf16";
    case DispatchDType::kNVFP4:
      return "nvfp4";
    case DispatchDType::kMXFP8:
      return "mxfp8";
    case DispatchDType::kFP8E4M3:
      return "fp8_e4m3";
  }
  return "unknown";
}

absl::StatusOr<DispatchDType> ParseDispatchDType(const std::string& name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (DispatchDType dtype : {DispatchDType::kBF16, DispatchDType::kNVFP4, DispatchDType::kMXFP8,
                              DispatchDType::kFP8E4M3}) {
    if (lower == DispatchDTypeName(dtype)) return dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dispatch dtype must be one of bf16, nvfp4, mxfp8, fp8_e4m3; got '", name, "'"));
}

absl::StatusOr<int64_t> DispatchBytesPerToken(DispatchDType dtype, int64_t hidden, int top_k) {
  if (hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("hidden must be >= 1, got ", hidden));
  }
  if (top_k < 1) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 1, got ", top_k));
  }
  // int32 expert ids + fp32 weights: 8 bytes per routed expert.
  const int64_t routing = 8 * static_cast<int64_t>(top_k);
  switch (dtype) {
    case DispatchDType::kBF16: {
      ASSIGN_OR_RETURN(int64_t h, Mul(hidden, 2, "bf16 hidden bytes"));
      return Add(h, routing, "dispatch bytes per token");
    }
    case DispatchDType::kNVFP4:
      if (hidden % 16 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("hidden must be a multiple of 16 (the nvfp4 scale block), got ", hidden));
      }
      // Packed e2m1 (2 values a byte) + one e4m3 scale per 16 values.
      return Add(hidden / 2 + hidden / 16, routing, "dispatch bytes per token");
    case DispatchDType::kMXFP8:
      if (hidden % 32 != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("hidden must be a multiple of 32 (the mxfp8 scale block), got ", hidden));
      }
      // e4m3 values + one ue8m0 scale per 32 values.
      return Add(hidden + hidden / 32, routing, "dispatch bytes per token");
    case DispatchDType::kFP8E4M3:
      if (hidden % 128 != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "hidden must be a multiple of 128 (the fp8_e4m3 scale block), got ", hidden));
      }
      // e4m3 values + one fp32 scale per 128 values (core/fp8_e4m3.h).
      return Add(hidden + 4 * (hidden / 128), routing, "dispatch bytes per token");
  }
  return absl::InvalidArgumentError("unknown dispatch dtype");
}

int64_t CombineBytesPerToken(int64_t hidden) { return 2 * hidden; }

int64_t DefaultCapacityTokens(int64_t chunked_prefill_size) {
  return std::max<int64_t>(chunked_prefill_size, 4096);
}

// Returns -1 when E < 1, N < 1 or the size overflows int64 (the Status-returning
// ComputeFlashInferWorkspace reports those).
int64_t FlashInferAuxBytes(int ep_size, int64_t capacity_tokens) {
  absl::StatusOr<int64_t> aux = CheckedFlashInferAux(ep_size, capacity_tokens);
  return aux.ok() ? *aux : -1;
}

absl::StatusOr<FlashInferWorkspace> ComputeFlashInferWorkspace(const WorkspaceSpec& spec) {
  RETURN_IF_ERROR(ValidateSizes(spec.ep_size, spec.capacity_tokens));
  ASSIGN_OR_RETURN(int64_t dispatch_bytes,
                   DispatchBytesPerToken(spec.dtype, spec.hidden, spec.top_k));
  ASSIGN_OR_RETURN(int64_t combine_bytes, Mul(spec.hidden, 2, "combine bytes per token"));
  FlashInferWorkspace ws;
  ASSIGN_OR_RETURN(ws.aux_bytes, CheckedFlashInferAux(spec.ep_size, spec.capacity_tokens));
  ASSIGN_OR_RETURN(int64_t dispatch_slab, SlabBytes(spec, dispatch_bytes, "dispatch region"));
  ASSIGN_OR_RETURN(ws.dispatch_region_bytes, Align(dispatch_slab, "dispatch region"));
  ASSIGN_OR_RETURN(int64_t combine_slab, SlabBytes(spec, combine_bytes, "combine region"));
  ASSIGN_OR_RETURN(ws.combine_region_bytes, Align(combine_slab, "combine region"));
  ASSIGN_OR_RETURN(int64_t total, Add(ws.aux_bytes, ws.dispatch_region_bytes, "workspace"));
  ASSIGN_OR_RETURN(ws.total_bytes, Add(total, ws.combine_region_bytes, "workspace"));
  return ws;
}

absl::StatusOr<CpuWorkspaceLayout> CpuWorkspaceLayout::For(const WorkspaceSpec& spec) {
  RETURN_IF_ERROR(ValidateSizes(spec.ep_size, spec.capacity_tokens));
  ASSIGN_OR_RETURN(int64_t dispatch_bytes,
                   DispatchBytesPerToken(spec.dtype, spec.hidden, spec.top_k));
  ASSIGN_OR_RETURN(int64_t combine_bytes, Mul(spec.hidden, 2, "combine bytes per token"));
  ASSIGN_OR_RETURN(int64_t dispatch_slab, SlabBytes(spec, dispatch_bytes, "dispatch region"));
  ASSIGN_OR_RETURN(int64_t combine_slab, SlabBytes(spec, combine_bytes, "combine region"));

  // Metadata parts (see the file comment).
  const int64_t e = spec.ep_size;
  int64_t metadata = 0;
  RETURN_IF_ERROR(Place(&metadata, 8 * e, "metadata send_counts").status());
  RETURN_IF_ERROR(Place(&metadata, 8 * e, "metadata recv_counts").status());
  RETURN_IF_ERROR(Place(&metadata, 8 * e * (kAgreementHeader + e), "metadata agreement").status());
  ASSIGN_OR_RETURN(int64_t slot_entries, Mul(spec.capacity_tokens, e, "metadata dest_slots"));
  ASSIGN_OR_RETURN(int64_t slot_bytes, Mul(slot_entries, 8, "metadata dest_slots"));
  RETURN_IF_ERROR(Place(&metadata, slot_bytes, "metadata dest_slots").status());

  // fp8_e4m3: the dequantized bf16 rows [E, N, H] the experts read.
  const int64_t dequant_slab = spec.dtype == DispatchDType::kFP8E4M3 ? combine_slab : 0;
  CpuWorkspaceLayout layout;
  int64_t end = 0;
  const std::pair<LayoutRegion*, int64_t> parts[] = {
      {&layout.dispatch_send, dispatch_slab},   {&layout.dispatch_recv, dispatch_slab},
      {&layout.combine_send, combine_slab},     {&layout.combine_recv, combine_slab},
      {&layout.dispatch_dequant, dequant_slab}, {&layout.metadata, metadata},
  };
  for (const auto& [region, bytes] : parts) {
    ASSIGN_OR_RETURN(int64_t offset, Place(&end, bytes, "allocated workspace"));
    *region = LayoutRegion{offset, bytes};
  }
  layout.total_bytes = end;
  return layout;
}

std::vector<WorkspaceRegion> CpuWorkspaceLayout::Regions() const {
  std::vector<WorkspaceRegion> out = {
      {"dispatch_send", dispatch_send.offset_bytes, dispatch_send.size_bytes},
      {"dispatch_recv", dispatch_recv.offset_bytes, dispatch_recv.size_bytes},
      {"combine_send", combine_send.offset_bytes, combine_send.size_bytes},
      {"combine_recv", combine_recv.offset_bytes, combine_recv.size_bytes}};
  if (dispatch_dequant.size_bytes > 0) {
    out.push_back({"dispatch_dequant", dispatch_dequant.offset_bytes, dispatch_dequant.size_bytes});
  }
  out.push_back({"metadata", metadata.offset_bytes, metadata.size_bytes});
  return out;
}

absl::StatusOr<AllocatedWorkspace> ComputeAllocatedWorkspace(const WorkspaceSpec& spec) {
  ASSIGN_OR_RETURN(CpuWorkspaceLayout layout, CpuWorkspaceLayout::For(spec));
  return AllocatedWorkspace{layout.Regions(), layout.total_bytes};
}

}  // namespace moe_ep::core
