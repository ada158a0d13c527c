#pragma once

// The copy-engine bulk path of the one-sided data plane (DESIGN §13 "Bulk",
// issue 15 item 3): which path a step of R rows takes, and the copies that
// move its rows into the peers' windows without SMs.
//
// The copy-engine (ce) step (protocol in kernels/onesided/onesided_kernels.cuh):
//   dispatch = route kernel (slot of token t = t) | one cudaMemcpy2DAsync per
//     destination of this rank's hidden rows [T, H] into the destination's
//     dispatch_recv slab at the window's row pitch | send kernel (ids,
//     weights, padding ids; flags released after the copies by stream order);
//   combine = (identity experts: LaunchOsIdentityRows into the expert output)
//     | one cudaMemcpyAsync per source of the expert-output slab [R, H] into
//     the source's combine_recv | combine kernel (flags, reduction; no push).
// Outputs equal the SM path's bit for bit (the same arithmetic, the same
// rank order); determinism (§7), the (epoch, R) agreement and the bounded
// waits are the kernels'. Copies are stream-ordered and capturable (memcpy
// graph nodes); a captured graph copies the bucket's rows (T <= R at replay
// reads rows [T, R) of the captured hidden buffer too, which must hold R
// rows; their ids are the padding ids, so they reach no expert).
// Thread safety: functions are pure or enqueue on the caller's stream.

#include <cuda_runtime.h>

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/onesided/onesided_kernels.cuh"

namespace moe_ep::kernels::onesided {

// The path a step took.
enum class OsPath { kSm, kCopyEngine };
// The path option: kAuto takes the copy engine for R >= ce_min_tokens.
enum class OsPathChoice { kAuto, kSm, kCopyEngine };

// "sm" / "ce".
const char* OsPathName(OsPath path);
// "auto", "sm", "ce"; else kInvalidArgument naming the accepted values.
absl::StatusOr<OsPathChoice> ParseOsPathChoice(std::string_view name);

// The path of a step of R rows: kSm for fp8_e4m3 dispatch (the send kernel
// quantizes) and for kAuto below ce_min_tokens, else kCopyEngine.
OsPath ChooseOsPath(OsPathChoice choice, int64_t r, int64_t ce_min_tokens, bool fp8);

// Enqueues the dispatch copies of rows [0, rows) of p.hidden (bf16 [rows, H])
// to slab p.rank of every destination's dispatch_recv (R = p.step.r, row
// pitch 2H + 8K), between LaunchOsRoute and LaunchOsSend. rows == 0 enqueues
// nothing. Errors: kInvalidArgument (rows outside [0, R], null hidden with
// rows > 0, fp8), kInternal (CUDA).
absl::Status EnqueueOsBulkDispatch(const OsDispatchParams& p, int64_t rows, cudaStream_t stream);

// Enqueues the combine copies: slab s of expert_out ([E, R, H] bf16) to
// combine_recv slab `rank` of source s's window, for every s, before
// LaunchOsCombine with ce set. Errors: kInvalidArgument (null expert_out with
// R > 0, R < 0), kInternal (CUDA).
absl::Status EnqueueOsBulkCombine(const OsPeerTable& peers, const OsWindowOffsets& off, int rank,
                                  int ep_size, int64_t r, int64_t hidden,
                                  const uint16_t* expert_out, cudaStream_t stream);

}  // namespace moe_ep::kernels::onesided
