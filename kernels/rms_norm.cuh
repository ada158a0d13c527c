#pragma once

// Device RMSNorm with the decoder layer's residual add (DESIGN §3), and the
// TP all-reduce + residual add + RMSNorm of the before-MLP step in two forms:
// fused (NCCL all-reduce, then one add-and-norm kernel) and unfused (NCCL
// all-reduce, then an add kernel, then a norm kernel). Both forms always run
// the all-reduce.
//
// Tensors are fp32 [rows, H] device buffers, row-major, matching the CPU path
// (core/rms_norm.h, core/step_executor.h). The math is the CPU's:
//   inv = 1 / sqrt(sum(v^2) / H + eps);  out = v * inv * weight
// with the sum of squares accumulated in fp32 but in a different order (a
// tree over the block, not ascending columns), so results agree with
// core::RmsNorm to fp32 rounding (relative ~1e-6 at H = 7168), not bitwise.
// The add is a plain fp32 add and the sum-of-chunks is in ascending chunk
// order, both bitwise equal to the CPU path.
//
// Launchers check their arguments on the host, enqueue on the given stream
// (or the collective's stream) and return; they never allocate or
// synchronise, so they can be captured in a CUDA graph. Zero rows enqueue
// nothing. Source: DESIGN §3 (all-reduce + add-residual + norm, fused where
// available, the fallback never skips the all-reduce); issue 4.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

class StreamCollective;

// LaunchRmsNorm()
//
// out = norm(in) * weight, row by row. `in` and `out` [rows, H] may alias (in
// place). `weight` [H].
// Errors: kInvalidArgument for rows < 0, H < 1, eps not finite and > 0, null
// pointers when rows > 0; kInternal when the launch fails.
absl::Status LaunchRmsNorm(const float* in, float* out, const float* weight, int64_t rows,
                           int64_t hidden, float eps, cudaStream_t stream);

// LaunchAddResidualRmsNorm()
//
// The fused add-and-norm of core::RmsNorm::ApplyWithResidual, in one pass:
//   residual += x;  x = norm(residual) * weight
// `x`, `residual` [rows, H], `weight` [H]. Each element of x and residual is
// read once and written once: the summed row is kept in shared memory for
// the second half of the pass when it fits (H <= 12032), otherwise it
// is re-read from `residual` (which the same thread just wrote).
// Errors: as LaunchRmsNorm; x == residual is kInvalidArgument.
absl::Status LaunchAddResidualRmsNorm(float* x, float* residual, const float* weight, int64_t rows,
                                      int64_t hidden, float eps, cudaStream_t stream);

// LaunchStoreResidualRmsNorm()
//
// The first layer's input norm (no residual yet), in one pass:
//   residual = x;  x = norm(x) * weight
// Errors: as LaunchAddResidualRmsNorm.
absl::Status LaunchStoreResidualRmsNorm(float* x, float* residual, const float* weight,
                                        int64_t rows, int64_t hidden, float eps,
                                        cudaStream_t stream);

// LaunchAddInPlace()
//
// dst[i] += src[i] for i < count (the unfused path's residual add, and the
// residual add of the after-MLP step). Grid-stride, 256 threads a block.
// Errors: kInvalidArgument for count < 0 or null pointers when count > 0;
// kInternal when the launch fails.
absl::Status LaunchAddInPlace(float* dst, const float* src, int64_t count, cudaStream_t stream);

// LaunchSumChunks()
//
// out[i] = in[0 * count + i] + in[1 * count + i] + ... (ascending chunk
// order, fp32) for i < count: the local half of a reduce-scatter built from
// an all-to-all (core/step_executor.h), bitwise equal to the CPU sum.
// `in` [num_chunks, count], `out` [count]; out must not overlap in.
// Errors: kInvalidArgument for num_chunks < 1, count < 0, null pointers when
// count > 0; kInternal when the launch fails.
absl::Status LaunchSumChunks(const float* in, int num_chunks, int64_t count, float* out,
                             cudaStream_t stream);

// How the before-MLP all-reduce + residual + norm runs.
enum class AllReduceNormImpl {
  // NCCL all-reduce of x in place, then LaunchAddResidualRmsNorm on the same
  // stream: x is read once after the all-reduce.
  kFused,
  // NCCL all-reduce of x in place, then LaunchAddInPlace(residual, x), then
  // LaunchRmsNorm(residual -> x): three passes over the data.
  kUnfused,
};

// "fused", "unfused".
const char* AllReduceNormImplName(AllReduceNormImpl impl);

// AllReduceAddRmsNorm()
//
// x = sum of x over `group` (NCCL all-reduce, in place), then
//   residual += x;  x = norm(residual) * weight
// with `impl`. Everything is enqueued on group.stream(); returns once
// enqueued (call group.Synchronize() to wait). Both implementations perform
// the all-reduce whenever there is data; with rows == 0 (the same on every
// rank of the group, see REQUIRES) nothing is enqueued on any rank, which is
// what NCCL does with a zero-count all-reduce anyway.
// `x`, `residual` [rows, H], `weight` [H]: device memory of group.device().
// REQUIRES: every rank of `group` calls with the same rows and H.
// Errors: kInvalidArgument as LaunchAddResidualRmsNorm, or a pointer that is
// not device memory (it would make the collective stage and wait); the
// collective's errors (kUnavailable, kDeadlineExceeded, kFailedPrecondition).
absl::Status AllReduceAddRmsNorm(StreamCollective& group, AllReduceNormImpl impl, float* x,
                                 float* residual, const float* weight, int64_t rows, int64_t hidden,
                                 float eps);

}  // namespace moe_ep::kernels
