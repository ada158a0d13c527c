#pragma once

// Host launchers of the one-sided dispatch and combine kernels (DESIGN §13,
// issue 15 item 2). Kernels store straight into peers' windows through a
// pointer table and synchronise through flags in those windows.
//
// Window of every rank (offsets in OsWindowOffsets, each region 128-byte
// aligned; E = ep_size, N = capacity, row = 2H + 8K, or with fp8_e4m3
// dispatch the fp8 wire row of kernels/fp8_dispatch.cuh, H + H/32 + 8K:
// the send kernel quantizes each token per 128-value block with
// core/fp8_e4m3.h and the owner dequantizes the received rows into its
// local bf16 rows before the experts read them; issue 15 item 4):
//   seq            uint64       this rank's step counter q (in the window, so
//                               a later dispatcher over the same windows
//                               continues the sequence)
//   dispatch_flags [E] OsFlag   written by source s at [s]
//   combine_flags  [E] OsFlag   written by expert rank d at [d]
//   dispatch_recv  [E, R, row]  source s's tokens for this rank in slots
//                               0..count-1 of slab s, padding slots
//                               [count, R) carry the invalid id, zero weights
//   combine_recv   [E, R, H]    rank d's result for this rank's token in slot
//                               j at row d * R + j
//   receive_hidden [E, N, H]    bf16, with receive buffers only (below)
//   receive_ids    [E, N, K]    int32
//   receive_weights [E, N, K]   fp32
// (regions sized for R = N; a step packs them by its R, as the NCCL path.)
// Receive buffers (OsWindowLayout's receive_buffers, bf16 dispatch): an
// engine's dispatch buffers [E, N, ...] inside the window, laid out as the
// engine's own (engine_rows.cuh). An engine dispatch into them on the fused
// path (OsDispatchParams::peer_direct) has each source store its rows,
// ids and weights straight into slab `source` of every destination's
// receive buffers, so no row is copied again after the flag round (what
// bounded issue 30's EP 2 dispatch at 1.54-1.60x of the bare kernel,
// bench/results/engine-host call 15; DeepEP's low-latency mode likewise
// returns tensors inside its buffer).
//
// Protocol of one step with sequence number q (a counter in every rank's
// window that each step advances once, so all ranks agree on it):
//   dispatch (one kernel for R <= kOsFusedMaxTokens, else route + send): a
//     warp per token stores its row + ids + weights into [me, slot] of each
//     destination (slots in increasing source-token order: a scan, no
//     atomics); every block fences and counts itself done; the last block
//     stores {epoch, R, count} into dispatch_flags[me] of each peer, then q
//     with a release store, and acquires every source's flag until its q
//     arrives (a rank alone that unpacks nothing skips the count and the
//     flag: nothing waits on it, stream order carries its rows). A source
//     whose (epoch, R) differs is recorded (kMismatch), T becomes 0 (no
//     output row) and no row is pushed back; a flag that does not arrive
//     within timeout_ns (%globaltimer) is recorded as kDeadline naming the
//     source.
//   combine (one kernel): a warp per received row j < count of source s
//     pushes it to combine_recv[me, j] of s's window — for identity experts
//     computed on the fly from the received row (bf16(sum of the local
//     weights * x), the expert kernel's own arithmetic), else copied from the
//     expert output (me's own rows too, or with OsCombineParams::push_own
//     false read in place by the reduction). The last block release-stores q into
//     combine_flags[me] of every peer; every block acquires every peer's
//     flag (bounded the same way; at EP 1 with the rows in place there is no
//     flag to wait for) and reduces its share of this rank's tokens: out[t] =
//     bf16(sum over d ascending of combine_recv[d, slot] [+ shared]) in fp32,
//     the arithmetic of combine_reduce.cuh, so outputs equal the NCCL
//     plane's bit for bit. A block whose wait fails writes no row (other
//     blocks may have: after a combine deadline the output is not valid). A
//     refused combine pushes nothing and publishes r = kOsRefusedR with its
//     q: no rank writes an output row and each peer records a combine-phase
//     mismatch naming it (issue 30 item 1).
// Copy-engine path (ce, issue 15 item 3; kernels/onesided/onesided_bulk.h):
//   a source's slot for token t at every destination is t itself (no
//   compaction, count = T: increasing source-token order still), so its
//   hidden rows reach each destination as one cudaMemcpy2DAsync (the row
//   pitch of the window) enqueued between the route and the send kernels;
//   the send kernel then stores only ids, weights and the padding ids, and
//   publishes the flags after the copies (stream order). Rows of tokens not
//   routed to d carry ids of other ranks' experts, which d's experts skip.
//   The combine's rows reach the sources as one cudaMemcpyAsync of the
//   expert output slab per source (R rows: the host does not know the
//   counts) before the combine kernel, which then skips the push; identity
//   experts first write their rows into the expert output
//   (LaunchOsIdentityRows, the push's arithmetic).
// Stores and flags are ordered at GPU scope when every window is on this GPU
// (sys_scope false), else at system scope.
// After a kDeadline record no later wait spins (the step and the group are
// failed; the owner reports it and refuses further steps).
// Every launcher: never allocates or synchronises; graph-capturable.
// Errors: kInvalidArgument (host checks named in the message), kInternal
// (launch).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/engine_rows.cuh"
#include "kernels/route.cuh"

namespace moe_ep::kernels::onesided {

// A flag slot in a window: the fields, then seq (the release-stored word).
struct alignas(32) OsFlag {
  int64_t epoch;
  int64_t r;
  int64_t count;
  uint64_t seq;  // the step number q once the fields above are valid
};

// The first failure a rank's kernels saw since the owner last cleared it.
enum OsErrorKind : int32_t { kOsNone = 0, kOsMismatch = 1, kOsDeadline = 2 };
// The R a refused dispatch publishes in its flags (OsDispatchParams::
// refused): every peer sees an (epoch, R) mismatch naming the refusing rank.
inline constexpr int64_t kOsRefusedR = -1;
// Set in the R a peer_direct dispatch publishes in its flags, so that a
// peer that dispatched the other way (rows in its window's dispatch_recv)
// sees a mismatch: its rows would land in the layout the owner does not
// read. OneSidedDispatcher::CheckStep names the two ways.
inline constexpr int64_t kOsPeerDirectR = int64_t{1} << 40;
enum OsPhase : int32_t { kOsDispatch = 0, kOsCombine = 1 };
struct OsStepError {
  int32_t kind;  // OsErrorKind
  int32_t rank;  // the source (dispatch) or expert rank (combine) concerned
  int32_t phase;
  int32_t claimed;  // set by the first recorder (kernels), cleared with the record
  uint64_t seq;     // the step
  int64_t their_epoch, their_r, my_epoch, my_r;
  ExpertIdError ids;  // ids neither valid nor the invalid id (kernels/expert_id_error.h)
};

// Byte offsets of the regions inside every window.
struct OsWindowOffsets {
  int64_t seq = 0;
  int64_t dispatch_flags = 0;
  int64_t combine_flags = 0;
  int64_t dispatch_recv = 0;
  int64_t combine_recv = 0;
  // The receive buffers (0: the window has none), N rows per source.
  int64_t receive_rows = 0;
  int64_t receive_hidden = 0;
  int64_t receive_ids = 0;
  int64_t receive_weights = 0;
  int64_t total_bytes = 0;
};

// The per-rank pointer table, by value in every kernel's parameters.
struct OsPeerTable {
  uint8_t* window[kMaxEpSize];
};

// The step's (epoch, R, T) as the first kernel of a step receives them.
struct OsStepArgs {
  int64_t epoch = 0;
  int64_t r = 0;
  int64_t t = 0;
};

// Local device state of one rank (not in the window).
struct OsLocalState {
  int32_t* token_slot = nullptr;   // [N, E]: slot of token t on rank d, or -1
  int32_t* send_counts = nullptr;  // [E]
  int32_t* recv_counts = nullptr;  // [E]: rows to push back to each source
  int64_t* header = nullptr;       // {epoch, R, T}; T set to 0 on failure
  uint64_t* seq = nullptr;         // the step counter q (in this rank's window)
  uint32_t* done = nullptr;        // [2] block counters (dispatch, combine)
  // The step q whose received rows the fused send kernel's blocks may
  // unpack (released by its last block; OsDispatchParams::fuse_unpack).
  uint64_t* unpacked = nullptr;
  OsStepError* error = nullptr;
};

// Device int64 arrays the send kernel zeroes before anything reads them:
// an engine's count outputs, which the unpack that follows the dispatch on
// the same stream adds into (in place of two cudaMemsetAsync calls of host
// time each: issue 30 item 3). n[i] == 0: none.
struct OsZeroCounts {
  int64_t* ptr[2] = {nullptr, nullptr};
  int n[2] = {0, 0};
};

struct OsDispatchParams {
  OsPeerTable peers;
  OsWindowOffsets off;
  OsLocalState local;
  OsStepArgs step;
  const uint16_t* hidden = nullptr;   // [T, H] bf16
  const int32_t* topk_ids = nullptr;  // [T, K]
  const float* topk_weights = nullptr;
  int rank = 0;
  int ep_size = 0;
  int64_t hidden_size = 0;  // multiple of 8
  int top_k = 0;
  int num_experts = 0;
  int32_t invalid_expert_id = -1;
  int blocks = 1;  // SM budget of the send kernel (grid size)
  uint64_t timeout_ns = 0;
  bool sys_scope = true;  // false: every window on this GPU
  bool fp8 = false;       // fp8_e4m3 wire rows (H a multiple of 128)
  // Copy-engine path: slots = token index, the send kernel moves no hidden
  // bytes (EnqueueOsBulkDispatch copies them); never with fp8.
  bool ce = false;
  OsZeroCounts zero;  // zeroed by the send kernel's block 0
  // This rank's caller failed its checks (T = 0, no inputs): its flags carry
  // R = kOsRefusedR, so every rank's kernel sees a mismatch and writes no
  // output instead of waiting out the timeout for a dispatch that never
  // comes (issue 30 item 1 on the GPU planes).
  bool refused = false;
  // An engine's dispatch on the fused SM path (bf16): after the flags, every
  // block of the send kernel unpacks its share of the received rows into
  // the engine's buffers, as LaunchUnpackReceived would (same results), so
  // the call launches one kernel instead of two (host time, issue 30 item
  // 3). The blocks that finish sending first wait for the last block's
  // release of q in local.unpacked. On unless MOE_EP_ONESIDED_FUSED_UNPACK=0
  // (OneSidedDispatcher::Dispatch).
  UnpackReceivedParams unpack;
  bool fuse_unpack = false;
  // With fuse_unpack, where the engine's buffers take 16-byte rows and the
  // local experts fit kOsDirectMaxLocalExperts: the send writes each token
  // this rank keeps straight into its slot of the engine's own slab (source
  // = this rank) and that slab's padding slots [count, rows), and block 0
  // writes its counts; the unpack after the flag round copies the peers'
  // slabs only. A rank alone then has nothing in the window to wait for:
  // no second pass, no grid-wide count, no flag (issue 30 item 3, the graph
  // dispatch against the bare kernel). Same results as the window path;
  // this rank's own receive rows in the window are not written (an
  // engine's combine reads its own expert outputs).
  bool direct_unpack = false;
  // With direct_unpack, the unpack buffers being this rank's window's
  // receive buffers (unpack.rows = N, the window's capacity, and the same
  // buffers on every rank by offset): the rows for each peer d are stored
  // into slab `rank` of d's receive buffers (ids and weights too) instead
  // of its dispatch_recv, and after the flag round each block counts its
  // share of the peers' slots from the ids (expert_counts, source_counts)
  // and writes slots [count, R) of the peers' slabs as padding. Slots
  // [R, N) are not written. The flags carry R | kOsPeerDirectR.
  bool peer_direct = false;
};

// The most local experts a direct unpack counts (one int32 each in the send
// kernel's shared memory).
inline constexpr int kOsDirectMaxLocalExperts = 1024;

// OsDirectUnpackFits()
//
// Whether an engine dispatch with these buffers may unpack its own rows
// directly (OsDispatchParams::direct_unpack): the engine's hidden buffer
// 16-byte aligned with H a multiple of 8, at most kOsDirectMaxLocalExperts
// local experts.
inline bool OsDirectUnpackFits(const UnpackReceivedParams& u) {
  return u.num_local_experts <= kOsDirectMaxLocalExperts && u.hidden_size % 8 == 0 &&
         reinterpret_cast<uintptr_t>(u.hidden) % 16 == 0;
}

// OsUnpacksIntoReceiveBuffers()
//
// Whether `u`'s hidden, ids and weights are exactly the receive buffers of
// the window at `own` (laid out by `off`, with rows = its N): the one test
// of OsDispatchParams::peer_direct, for the dispatcher that sets it and the
// launcher that checks it.
inline bool OsUnpacksIntoReceiveBuffers(const UnpackReceivedParams& u, const uint8_t* own,
                                        const OsWindowOffsets& off) {
  return off.receive_hidden != 0 && own != nullptr &&
         reinterpret_cast<const uint8_t*>(u.hidden) == own + off.receive_hidden &&
         reinterpret_cast<const uint8_t*>(u.topk_ids) == own + off.receive_ids &&
         reinterpret_cast<const uint8_t*>(u.topk_weights) == own + off.receive_weights &&
         u.rows == off.receive_rows;
}

struct OsCombineParams {
  OsPeerTable peers;
  OsWindowOffsets off;
  OsLocalState local;
  // Identity experts (true): rows are computed from the received rows with
  // the local slots answering to slot_ids [num_local_experts] (device,
  // ascending: DeviceExpertSet::device_slot_ids; core::LocalSlot finds an
  // id's slot); else expert_out [E, R, H] holds them (rows j < recv_counts[s]
  // of slab s).
  bool identity = false;
  const int32_t* slot_ids = nullptr;
  int num_local_experts = 0;
  const uint16_t* expert_out = nullptr;
  // Rows per source slab of expert_out (>= R; 0 = R): an engine's own
  // [E, rows, H] buffer is read in place.
  int64_t expert_out_rows = 0;
  // The bf16 rows [E, R, 2H + 8K] identity experts read: null = the
  // window's dispatch_recv (bf16 dispatch); with fp8 the owner's
  // dequantized rows.
  const uint8_t* rows = nullptr;
  uint16_t* output = nullptr;        // [T, H] bf16
  const uint16_t* shared = nullptr;  // [T, H] bf16 shared-expert term, or null
  int rank = 0;
  int ep_size = 0;
  int64_t hidden_size = 0;
  int top_k = 0;
  int64_t max_tokens = 0;  // R
  int blocks = 1;
  uint64_t timeout_ns = 0;
  bool sys_scope = true;
  // Copy-engine path: the rows are already in the sources' windows
  // (EnqueueOsBulkCombine before this kernel): no push.
  bool ce = false;
  // This rank's caller failed its combine's checks (issue 30 item 1): no
  // row is pushed, its flags carry r = kOsRefusedR and it writes no
  // output; every peer's kernel records a combine-phase mismatch naming
  // this rank and writes no output, instead of waiting out the timeout.
  bool refused = false;
  // Push this rank's own rows into its window too, and reduce them from
  // there (the layout's first protocol; MOE_EP_ONESIDED_PUSH_OWN=1, and a
  // combine whose output overlaps its expert output). False: the
  // reduction reads them in place (expert_out, or the received row scaled
  // as the push would), half the bytes at EP 1 (issue 32).
  bool push_own = false;
};

// Identity experts of the copy-engine path: out[s, j] = bf16(ws * row[s, j])
// for j < recv_counts[s] (ws = sum over k ascending of the weights whose id
// a local slot answers to), the arithmetic the SM path's combine applies as
// it pushes.
struct OsIdentityParams {
  const uint8_t* rows = nullptr;  // [E, R, 2H + 8K] bf16 received rows
  uint16_t* out = nullptr;        // [E, R, H] expert output
  const int32_t* recv_counts = nullptr;
  int ep_size = 0;
  int64_t hidden_size = 0;
  int top_k = 0;
  const int32_t* slot_ids = nullptr;  // device [num_local_experts], ascending
  int num_local_experts = 0;
  int64_t max_tokens = 0;  // R
  int blocks = 1;          // grid bound
};

// Largest R the fused route+send kernel takes (one thread per token of the
// block's scan); larger R routes with a separate kernel first.
inline constexpr int64_t kOsFusedMaxTokens = 512;
inline constexpr int kOsFusedMaxEpSize = 8;

// The window regions for E ranks, N tokens, H, K (each region 128-aligned);
// `fp8`: dispatch_recv holds fp8 wire rows; `receive_buffers`: the window
// also holds the receive buffers (E * N * (2H + 8K) bytes more).
OsWindowOffsets OsWindowLayout(int ep_size, int64_t capacity, int64_t hidden, int top_k,
                               bool fp8 = false, bool receive_buffers = false);

// Whether a step of R rows runs the fused kernel (no separate route launch).
inline bool OsDispatchFused(int64_t r, int ep_size) {
  return r <= kOsFusedMaxTokens && ep_size <= kOsFusedMaxEpSize;
}

// The first kernel of a dispatch of R = p.step.r rows (the one whose
// parameters a replayed graph updates with the step's (epoch, R, T)); the
// copy-engine path (ce) always starts with the route kernel.
const void* OsFirstDispatchKernel(int64_t r, int ep_size, int64_t hidden, int top_k,
                                  bool ce = false);

// Enqueues the dispatch: for small R one kernel (route fused in), else the
// route kernel then the send kernel. The first kernel writes local.header
// from p.step and advances local.seq. The copy-engine path (p.ce) instead
// enqueues LaunchOsRoute, then its copies (EnqueueOsBulkDispatch), then
// LaunchOsSend: the two halves of the unfused dispatch. Errors:
// kInvalidArgument (top_k, R, T, blocks or num_experts out of range, null
// inputs with T > 0, a missing window, fp8 with H not a multiple of 128 or
// on the copy-engine path, fuse_unpack off the fused SM bf16 path or
// without counts_zeroed, direct_unpack without fuse_unpack or with buffers
// OsDirectUnpackFits refuses, rows < R, or the unpack's H or ep_size not
// the dispatch's, peer_direct without direct_unpack or with buffers other
// than this rank's window's receive buffers), kInternal (launch).
absl::Status LaunchOsDispatch(const OsDispatchParams& p, cudaStream_t stream);
absl::Status LaunchOsRoute(const OsDispatchParams& p, cudaStream_t stream);
absl::Status LaunchOsSend(const OsDispatchParams& p, cudaStream_t stream);

// Enqueues the identity rows of the copy-engine path (OsIdentityParams).
absl::Status LaunchOsIdentityRows(const OsIdentityParams& p, cudaStream_t stream);

// Enqueues the combine: push, flag exchange and reduction in one kernel.
absl::Status LaunchOsCombine(const OsCombineParams& p, cudaStream_t stream);

}  // namespace moe_ep::kernels::onesided
