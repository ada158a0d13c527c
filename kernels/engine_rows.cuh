#pragma once

// The received rows of an engine's in-process dispatch on the GPU (DESIGN
// §14, issue 16): the dispatcher's receive region (packed rows [E, R,
// row_bytes], kernels/dispatch_pack.cuh) unpacked into the caller's three
// buffers with room for `rows` >= R slots per source, plus the per-source
// and per-local-expert counts, all on the device and on one stream, so the
// call only enqueues and can be captured in a CUDA graph.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

struct UnpackReceivedParams {
  const uint8_t* recv = nullptr;  // device [E, R, 2H + 8K]: hidden, ids, weights per slot
  int64_t runtime_max = 0;        // R of the step
  int64_t rows = 0;               // slots per source in the outputs (>= R)
  int64_t hidden_size = 0;        // H (a multiple of 4)
  int top_k = 0;                  // K
  int ep_size = 0;                // E
  int first_expert = 0;           // this rank's experts [first_expert, first_expert + L)
  int num_local_experts = 0;      // L
  int32_t invalid_expert_id = -1;
  uint16_t* hidden = nullptr;        // device [E, rows, H] bf16
  int32_t* topk_ids = nullptr;       // device [E, rows, K]
  float* topk_weights = nullptr;     // device [E, rows, K]
  int64_t* source_counts = nullptr;  // device [E]: slots of source s holding a token
  int64_t* expert_counts = nullptr;  // device [L]: (slot, choice) pairs per local expert
  // The two count arrays are zero already (a kernel before this one on the
  // stream zeroed them: OsZeroCounts), so no cudaMemsetAsync is enqueued.
  bool counts_zeroed = false;
  // Device [E], or null: the rows source s really sent; slots j in
  // [recv_counts[s], R) are then written as padding whatever the receive
  // region holds there (the one-sided plane's window keeps an earlier
  // step's rows past the count; the NCCL plane's pack writes padding rows).
  const int32_t* recv_counts = nullptr;
};

// LaunchUnpackReceived()
//
// Slot j < R of source s is copied as is (a token, or padding: zero hidden,
// the invalid id, zero weights, as the pack kernel wrote it); slots [R, rows)
// are written as padding, and with recv_counts the slots [recv_counts[s], R)
// too. A slot holds a token when one of its K ids is a
// local expert (a token is sent only to ranks owning one of its experts;
// padding carries only the invalid id); source_counts[s] counts those slots,
// expert_counts[l] the ids equal to first_expert + l among them. The counts
// are zeroed on the stream first (or, with counts_zeroed, by a kernel before
// this one on the stream: OsZeroCounts). Errors: kInvalidArgument (null pointers
// with rows > 0, rows < R, H not a positive multiple of 4, sizes),
// kInternal (launch). Never allocates or synchronises.
absl::Status LaunchUnpackReceived(const UnpackReceivedParams& p, cudaStream_t stream);

// CheckUnpackReceived()
//
// LaunchUnpackReceived's argument checks alone, for a kernel that unpacks
// in its own tail (kernels/onesided: OsDispatchParams::fuse_unpack). Same
// errors.
absl::Status CheckUnpackReceived(const UnpackReceivedParams& p);

#ifdef __CUDACC__
// UnpackSourceRow()
//
// The received row [2H bf16 | K ids | K weights] that output slot b of
// [E * rows] copies: slot j < R of source s = b / rows, at row s * R + j of
// the receive region; nullptr for the padding slots [R, rows), and with
// recv_counts for [recv_counts[s], R) too.
__device__ inline const uint8_t* UnpackSourceRow(const UnpackReceivedParams& u, int64_t b) {
  const int64_t s = b / u.rows;
  const int64_t j = b % u.rows;
  if (j >= u.runtime_max || (u.recv_counts != nullptr && j >= u.recv_counts[s])) return nullptr;
  return u.recv + (s * u.runtime_max + j) * (2 * u.hidden_size + 8 * static_cast<int64_t>(u.top_k));
}

// UnpackLocalExpert()
//
// The local expert l of `id` (id == first_expert + l, l < num_local_experts),
// or -1 for the invalid id and another rank's expert: which ids count in
// expert_counts and make a slot count in source_counts.
__device__ inline int UnpackLocalExpert(const UnpackReceivedParams& u, int32_t id) {
  const int l = id - u.first_expert;
  return id != u.invalid_expert_id && l >= 0 && l < u.num_local_experts ? l : -1;
}

// UnpackPadIds()
//
// Output slot b's ids and weights as padding (the invalid id, zero
// weights), by `width` threads, this one `lane` of them.
__device__ inline void UnpackPadIds(const UnpackReceivedParams& u, int64_t b, int lane, int width) {
  for (int k = lane; k < u.top_k; k += width) {
    u.topk_ids[b * u.top_k + k] = u.invalid_expert_id;
    u.topk_weights[b * u.top_k + k] = 0.0f;
  }
}

// UnpackSlotIds()
//
// The ids and weights of output slot b of [E * rows] by `width` threads,
// this one `lane` of them: slot j < R of source s = b / rows copied as it
// is, slots [R, rows) (and with recv_counts [recv_counts[s], R)) written as
// padding (the invalid id, zero weights),
// expert_counts[l] bumped for each of this thread's ids equal to
// first_expert + l. Returns whether this thread's ids held a local expert:
// the caller ORs that over the `width` threads and counts the slot once in
// source_counts[s]. The hidden row is the caller's (UnpackSlot's loop, or
// the one-sided fused unpack's chunks).
__device__ inline bool UnpackSlotIds(const UnpackReceivedParams& u, int64_t b, int lane,
                                     int width) {
  const int K = u.top_k;
  const int64_t H = u.hidden_size;
  int32_t* ids = u.topk_ids + b * K;
  float* weights = u.topk_weights + b * K;
  const uint8_t* row = UnpackSourceRow(u, b);
  if (row == nullptr) {
    UnpackPadIds(u, b, lane, width);
    return false;
  }
  const int32_t* row_ids = reinterpret_cast<const int32_t*>(row + 2 * H);
  const float* row_weights = reinterpret_cast<const float*>(row + 2 * H + 4 * K);
  bool local = false;
  for (int k = lane; k < K; k += width) {
    const int32_t id = row_ids[k];
    ids[k] = id;
    weights[k] = row_weights[k];
    const int l = UnpackLocalExpert(u, id);
    if (l >= 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(u.expert_counts + l), 1ull);
      local = true;
    }
  }
  return local;
}

// UnpackSlot()
//
// All of output slot b by `width` threads: its hidden row (slot j < R of
// source s copied as uint2 = 4 bf16, H % 4 == 0 and 2H + 8K a multiple of 8
// keeping the vectors aligned; zeros past R, and with recv_counts past
// recv_counts[s]), then UnpackSlotIds, whose
// return value it passes on. LaunchUnpackReceived's, a block a slot.
__device__ inline bool UnpackSlot(const UnpackReceivedParams& u, int64_t b, int lane, int width) {
  const int64_t H = u.hidden_size;
  const int64_t vecs = H / 4;
  uint2* dst = reinterpret_cast<uint2*>(u.hidden + b * H);
  const uint2* src = reinterpret_cast<const uint2*>(UnpackSourceRow(u, b));
  if (src == nullptr) {
    for (int64_t v = lane; v < vecs; v += width) dst[v] = make_uint2(0, 0);
  } else {
    for (int64_t v = lane; v < vecs; v += width) dst[v] = src[v];
  }
  return UnpackSlotIds(u, b, lane, width);
}
#endif  // __CUDACC__

// EnqueueExpertOutputsPack()
//
// Enqueues on `stream` the copy of an engine's expert outputs [E, rows, H]
// bf16 at `expert_out` into [E, R, H] at `dst` (R = `runtime_max` <= rows;
// what a combine sends). Errors: kInternal (cudaMemcpy2DAsync).
absl::Status EnqueueExpertOutputsPack(const void* expert_out, int64_t rows, void* dst,
                                      int64_t runtime_max, int64_t hidden, int ep_size,
                                      cudaStream_t stream);

}  // namespace moe_ep::kernels
