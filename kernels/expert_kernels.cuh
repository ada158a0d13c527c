#pragma once

// Host launchers of the kernels around the expert GEMMs (DESIGN §7): group
// the received (row, k) entries by local expert, gather their hidden rows,
// SwiGLU's silu(gate) * up, and the weighted per-row sum that fills the
// combine send buffer. kernels/expert_compute.h strings them together with
// the cuBLAS GEMMs.
//
// Entries: a received row r (of M = E * R rows of the dispatch receive buffer,
// each 2H + 8K bytes: hidden bf16 | ids int32 | weights fp32) has K entries
// e = r * K + k. Entry e belongs to local slot l = core::LocalSlot(slot_ids,
// L, ids[r, k]) (core/expert_slots.h: the slot answering to that id, any set
// of ids) when l >= 0, else to the "no local expert" key L. A stable radix
// sort of the keys groups entries by slot in increasing entry order
// (deterministic).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe_ep::kernels {

struct ExpertEntryBuffers {
  int32_t* keys = nullptr;           // device [M * K]
  int32_t* values = nullptr;         // device [M * K]
  int32_t* sorted_keys = nullptr;    // device [M * K]
  int32_t* sorted_values = nullptr;  // device [M * K]: entry index e, grouped by expert
  int32_t* offsets = nullptr;        // device [L + 1]: expert l's entries are
                                     // sorted positions [offsets[l], offsets[l+1])
  int32_t* position = nullptr;       // device [M * K]: sorted position of entry e, or -1
  void* sort_temp = nullptr;         // device, SortTempBytes(M * K, L) bytes
  size_t sort_temp_bytes = 0;
};

// Scratch bytes cub's radix sort needs for `num_entries` entries and keys in
// [0, num_local_experts]. Errors: kInvalidArgument for negative sizes,
// kInternal from cub.
absl::StatusOr<size_t> SortTempBytes(int64_t num_entries, int num_local_experts);

// LaunchGroupEntriesByExpert()
//
// Enqueues keys -> stable sort -> offsets and positions for the M * K entries
// of `recv`, slot l of the L local experts answering to id slot_ids[l]
// (device [L] int32, ascending distinct: DeviceExpertSet::device_slot_ids).
// Errors: kInvalidArgument (null pointers, M < 0, H % 4, K or L out of range,
// temp too small, M * K beyond int32), kInternal (launch or cub). Never
// allocates or synchronises.
absl::Status LaunchGroupEntriesByExpert(const uint8_t* recv, int64_t num_rows, int64_t hidden_size,
                                        int top_k, const int32_t* slot_ids, int num_local_experts,
                                        const ExpertEntryBuffers& buffers, cudaStream_t stream);

// LaunchGatherExpertRows()
//
// x[i, :] = hidden of row sorted_values[i] / K, for sorted positions
// i < offsets[L] (the number of local entries, read on the device). With
// `scale_input` (core::RouterWeightUse::kScalesInput, Llama-4; issue 35
// item 5) x[i, :] = bf16(w * hidden) with w the entry's router weight, so the
// expert computes e(w * x).
// x: device [max_entries, H] bf16. Errors: kInvalidArgument, kInternal.
absl::Status LaunchGatherExpertRows(const uint8_t* recv, int64_t max_entries, int64_t hidden_size,
                                    int top_k, const ExpertEntryBuffers& buffers,
                                    int num_local_experts, uint16_t* x, cudaStream_t stream,
                                    bool scale_input = false);

// LaunchSiluMul()
//
// act[i, j] = bf16( silu(gate_up[i, j]) * gate_up[i, I + j] ) for
// i < *num_entries, j < I; silu(g) = g / (1 + exp(-g)). gate_up: device
// [max_entries, 2I] fp32; act: device [max_entries, I] bf16.
// Errors: kInvalidArgument, kInternal.
absl::Status LaunchSiluMul(const float* gate_up, const int32_t* num_entries, int64_t max_entries,
                           int64_t intermediate, uint16_t* act, cudaStream_t stream);

// LaunchWeightedExpertSum()
//
// For each received row r < M with at least one local entry:
//   out[r, :] = bf16( sum over k ascending with position[r*K+k] >= 0 of
//                     weights[r, k] * y[position[r*K+k], :] )
// where y is the expert output [entries, H] fp32, or, when y == nullptr
// (identity experts), the row's own hidden state. Rows with no local entry
// (padding) are not written. out: device [M, H] bf16 (the combine send buffer).
// `unit_weights`: every weight is 1, for outputs whose input the weight
// already scaled (LaunchGatherExpertRows' scale_input); ignored for identity
// experts (y null), whose sum (sum of weights) * x is e(w * x) summed.
// Errors: kInvalidArgument, kInternal. Never allocates or synchronises.
absl::Status LaunchWeightedExpertSum(const uint8_t* recv, int64_t num_rows, int64_t hidden_size,
                                     int top_k, const int32_t* position, const float* y,
                                     uint16_t* out, cudaStream_t stream, bool unit_weights = false);

}  // namespace moe_ep::kernels
