#include <cuda_bf16.h>

#include <algorithm>
#include <cub/block/block_scan.cuh>
#include <type_traits>

#include "absl/strings/str_format.h"
#include "core/expert_slots.h"
#include "core/status_macros.h"
#include "kernels/fp8_dispatch.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/expert_id_check.cuh"
#include "kernels/internal/kernel_modules.h"
#include "kernels/onesided/onesided_kernels.cuh"

namespace moe_ep::kernels::onesided {
namespace {

constexpr int kThreads = 512;  // == kOsFusedMaxTokens: one scan lane per token
constexpr int kWarps = kThreads / 32;
constexpr int kRouteThreads = 512;
constexpr int kUnroll = 4;  // vectors in flight per lane
static_assert(kThreads == kOsFusedMaxTokens, "fused scan needs one thread per token");

int64_t Align128(int64_t x) { return (x + 127) / 128 * 128; }

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void StoreRelease(uint64_t* p, uint64_t v, bool sys) {
  if (sys) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  } else {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
}
__device__ __forceinline__ uint64_t LoadAcquire(const uint64_t* p, bool sys) {
  uint64_t v;
  if (sys) {
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  } else {
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  }
  return v;
}
__device__ __forceinline__ void Fence(bool sys) {
  if (sys) {
    __threadfence_system();
  } else {
    __threadfence();
  }
}

__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ int RankOfExpert(int expert, int base, int rem) {
  const int big = rem * (base + 1);
  return expert < big ? expert / (base + 1) : rem + (expert - big) / base;
}

// Destination ranks of token t as a bit mask (ids outside [0, num_experts)
// select none).
__device__ __forceinline__ uint64_t DestMask(const int32_t* ids, int64_t t, int top_k,
                                             int num_experts, int base, int rem) {
  uint64_t m = 0;
  for (int k = 0; k < top_k; ++k) {
    const int32_t id = ids[t * top_k + k];
    if (id >= 0 && id < num_experts) m |= uint64_t{1} << RankOfExpert(id, base, rem);
  }
  return m;
}

// Records token t's ids that are neither valid nor the invalid id (one block
// calls it, so each is counted once; kernels/expert_id_error.h).
__device__ __forceinline__ void CheckTokenIds(const OsDispatchParams& p, int64_t t) {
  for (int k = 0; k < p.top_k; ++k) {
    internal::CheckExpertId(&p.local.error->ids, p.topk_ids[t * p.top_k + k], t * p.top_k + k,
                            p.num_experts, p.invalid_expert_id);
  }
}

// Spins until *seq == q or the timeout passes: 0 (arrived) or kOsDeadline.
__device__ __forceinline__ int WaitSeq(const uint64_t* seq, uint64_t q, uint64_t timeout_ns,
                                       bool sys) {
  const uint64_t start = GlobalTimerNs();
  while (LoadAcquire(seq, sys) != q) {
    if (GlobalTimerNs() - start > timeout_ns) return kOsDeadline;
  }
  return 0;
}

__device__ __forceinline__ int WaitFlag(const OsFlag* flag, uint64_t q, uint64_t timeout_ns,
                                        bool sys) {
  return WaitSeq(&flag->seq, q, timeout_ns, sys);
}

// Records the first failure (atomically: several blocks may fail at once).
__device__ __forceinline__ void RecordError(OsStepError* e, int kind, int rank, int phase,
                                            uint64_t q, int64_t their_epoch, int64_t their_r,
                                            int64_t my_epoch, int64_t my_r) {
  if (atomicCAS(&e->claimed, 0, 1) != 0) return;
  volatile OsStepError* v = e;
  v->rank = rank;
  v->phase = phase;
  v->seq = q;
  v->their_epoch = their_epoch;
  v->their_r = their_r;
  v->my_epoch = my_epoch;
  v->my_r = my_r;
  __threadfence();
  v->kind = kind;
}

// Counts this block done after its stores (fenced); true in the last block,
// which resets the counter for the next launch.
__device__ __forceinline__ bool CountDone(uint32_t* counter, int* is_last, bool sys) {
  __syncthreads();
  if (threadIdx.x == 0) {
    Fence(sys);  // this block's peer stores before the count
    const uint32_t prev = atomicAdd(counter, 1u);
    *is_last = prev == gridDim.x - 1;
    if (*is_last) *counter = 0;
  }
  __syncthreads();
  return *is_last != 0;
}

// One warp's share of a row copy: chunk c of a row of `vecs` vectors
// (32 * kUnroll vectors per chunk, kUnroll loads in flight per lane) from src
// to every destination rank d < n whose row pointer dst(d) is not null.
template <typename Vec, typename DstFn>
__device__ __forceinline__ void WarpCopyChunk(const Vec* __restrict__ src, int64_t vecs, int64_t c,
                                              int n, const DstFn& dst, int lane) {
  const int64_t v0 = c * 32 * kUnroll;
  Vec x[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = v0 + u * 32 + lane;
    if (v < vecs) x[u] = src[v];
  }
  for (int d = 0; d < n; ++d) {
    Vec* out = reinterpret_cast<Vec*>(dst(d));
    if (out == nullptr) continue;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32 + lane;
      if (v < vecs) out[v] = x[u];
    }
  }
}

// One warp's share of zeroing a row of `vecs` vectors: chunk c, as
// WarpCopyChunk splits it (a padding slot's hidden row).
template <typename Vec>
__device__ __forceinline__ void WarpZeroChunk(Vec* dst, int64_t vecs, int64_t c, int lane) {
  const int64_t v0 = c * 32 * kUnroll + lane;
#pragma unroll
  for (int i = 0; i < kUnroll; ++i) {
    if (v0 + i * 32 < vecs) dst[v0 + i * 32] = Vec{};
  }
}

// Chunk c (32 * kUnroll vectors, kUnroll loads in flight per lane) of the
// hidden row of the fused unpack's output slot b: its received row copied
// (WarpCopyChunk), zeros for a padding slot (UnpackSlot's values).
template <typename Vec>
__device__ __forceinline__ void UnpackHiddenChunk(const UnpackReceivedParams& u, int64_t b,
                                                  int64_t c, int lane) {
  const int64_t vecs = 2 * u.hidden_size / static_cast<int64_t>(sizeof(Vec));
  Vec* dst = reinterpret_cast<Vec*>(u.hidden + b * u.hidden_size);
  const Vec* src = reinterpret_cast<const Vec*>(UnpackSourceRow(u, b));
  if (src != nullptr) {
    WarpCopyChunk<Vec>(
        src, vecs, c, 1, [&](int) { return dst; }, lane);
    return;
  }
  WarpZeroChunk<Vec>(dst, vecs, c, lane);
}

// The fused dispatch's unpack (OsDispatchParams::fuse_unpack): UnpackSlot's
// values for every slot of the engine's [E, rows] buffers, as items (slot b,
// chunk c of its hidden row) over the grid's warps, so that a row is copied
// by several warps with kUnroll loads in flight per lane (a warp a slot,
// one 8-byte load in flight per lane, took 29 us for the 128-token EP 1
// dispatch against 10.8 us without the unpack: bench/results/floors call
// 2, issue 30's graph target). Chunk 0 also writes the ids and weights and
// counts: source_counts[s] the slots with a local id (the counts zeroed by
// block 0 at the kernel's start: OsZeroCounts).
// With skip_source >= 0 that source's slab is left alone (the direct
// unpack wrote this rank's own rows already).
__device__ void UnpackShare(const UnpackReceivedParams& u, int skip_source) {
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t H = u.hidden_size;
  // 16-byte vectors where the rows and the output keep them aligned.
  const bool vec16 = (2 * H + 8 * static_cast<int64_t>(u.top_k)) % 16 == 0 && H % 8 == 0 &&
                     reinterpret_cast<uintptr_t>(u.recv) % 16 == 0 &&
                     reinterpret_cast<uintptr_t>(u.hidden) % 16 == 0;
  const int64_t vecs = 2 * H / (vec16 ? 16 : 8);
  const int64_t chunks = (vecs + 32 * kUnroll - 1) / (32 * kUnroll);
  const int64_t items = static_cast<int64_t>(u.ep_size) * u.rows * chunks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp; item < items;
       item += stride) {
    const int64_t b = item / chunks;
    const int64_t c = item % chunks;
    if (b / u.rows == skip_source) continue;  // uniform over the warp
    if (vec16) {
      UnpackHiddenChunk<uint4>(u, b, c, lane);
    } else {
      UnpackHiddenChunk<uint2>(u, b, c, lane);
    }
    if (c != 0) continue;
    const bool local = UnpackSlotIds(u, b, lane, 32);
    if (__any_sync(0xffffffffu, local) && lane == 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(u.source_counts + b / u.rows), 1ull);
    }
  }
}

// The peer-direct dispatch's pass after the flag round (OsDispatchParams::
// peer_direct): the sources' rows are in this rank's receive buffers
// already, so each item (slot b of [E, R], chunk c) only writes padding —
// slots [recv_counts[s], R) as LaunchUnpackReceived leaves them — and chunk
// 0 of a token's slot counts its ids (UnpackSlotIds's rule, no copy). The
// own slab is skipped when the direct unpack wrote it (`skip_own`); after a
// failed round the counts are zero and every slab becomes padding.
__device__ void PeerDirectShare(const OsDispatchParams& p, int64_t R, bool skip_own) {
  const UnpackReceivedParams& u = p.unpack;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t H = u.hidden_size;
  const int K = u.top_k;
  const int64_t vecs = 2 * H / 16;  // OsDirectUnpackFits: 16-byte rows
  const int64_t chunks = (vecs + 32 * kUnroll - 1) / (32 * kUnroll);
  const int64_t items = static_cast<int64_t>(u.ep_size) * R * chunks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  const volatile int32_t* counts = p.local.recv_counts;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp; item < items;
       item += stride) {
    const int64_t b = item / chunks;
    const int64_t c = item % chunks;
    const int s = static_cast<int>(b / R);
    const int64_t j = b % R;
    if (s == p.rank && skip_own) continue;  // uniform over the warp
    const int64_t slot = s * u.rows + j;
    if (j >= counts[s]) {
      WarpZeroChunk<uint4>(reinterpret_cast<uint4*>(u.hidden + slot * H), vecs, c, lane);
      if (c == 0) UnpackPadIds(u, slot, lane, 32);
      continue;
    }
    if (c != 0) continue;
    bool local = false;
    for (int k = lane; k < K; k += 32) {
      const int l = UnpackLocalExpert(u, u.topk_ids[slot * K + k]);
      if (l >= 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(u.expert_counts + l), 1ull);
        local = true;
      }
    }
    if (__any_sync(0xffffffffu, local) && lane == 0) {
      atomicAdd(reinterpret_cast<unsigned long long*>(u.source_counts + s), 1ull);
    }
  }
}

// Direct unpack (OsDispatchParams::direct_unpack): block 0's counts of this
// rank's own slab, from the inputs every block routes, with UnpackSlotIds's
// rule (a slot counts for its source once one of its ids is a local
// expert; expert_counts[l] the ids equal to first_expert + l). Written
// whole, not added to, after block 0 zeroed them: a rank alone's counts
// are then final with no grid-wide count; with peers, the unpack of their
// slabs adds to expert_counts after the flag round, which follows these
// stores.
__device__ void DirectUnpackCounts(const OsDispatchParams& p, int64_t T, int32_t* hist,
                                   int* local_tokens) {
  const UnpackReceivedParams& u = p.unpack;
  const int L = u.num_local_experts;
  const int tid = threadIdx.x;
  for (int l = tid; l < L; l += blockDim.x) hist[l] = 0;
  if (tid == 0) *local_tokens = 0;
  __syncthreads();
  if (tid < T) {
    bool local = false;
    for (int k = 0; k < p.top_k; ++k) {
      const int l =
          UnpackLocalExpert(u, internal::ExpertOrInvalid(p.topk_ids[tid * p.top_k + k],
                                                         p.num_experts, p.invalid_expert_id));
      if (l >= 0) {
        atomicAdd(&hist[l], 1);
        local = true;
      }
    }
    if (local) atomicAdd(local_tokens, 1);
  }
  __syncthreads();
  for (int l = tid; l < L; l += blockDim.x) u.expert_counts[l] = hist[l];
  if (tid == 0) u.source_counts[p.rank] = *local_tokens;
}

// Direct unpack's item (slot b, chunk c) by one warp, in this rank's own
// slab of the engine's [E, rows, H] buffers: token b's chunk c to its slot
// (its ids and weights with chunk 0), and slot b past the count sent to
// this rank written as padding (zero hidden, the invalid id, zero weights),
// as LaunchUnpackReceived leaves slots [count, rows).
template <typename Vec>
__device__ __forceinline__ void DirectUnpackItem(const OsDispatchParams& p, int64_t b, int64_t c,
                                                 int64_t T, int slot, int32_t count, int lane) {
  const UnpackReceivedParams& u = p.unpack;
  const int64_t H = p.hidden_size;
  const int K = p.top_k;
  const int64_t vecs = 2 * H / static_cast<int64_t>(sizeof(Vec));
  const int64_t own = p.rank * u.rows;  // the slab's first slot
  if (b < T && slot >= 0) {
    Vec* row = reinterpret_cast<Vec*>(u.hidden + (own + slot) * H);
    WarpCopyChunk<Vec>(
        reinterpret_cast<const Vec*>(p.hidden + b * H), vecs, c, 1, [&](int) { return row; }, lane);
    if (c == 0) {
      for (int k = lane; k < K; k += 32) {
        u.topk_ids[(own + slot) * K + k] =
            internal::ExpertOrInvalid(p.topk_ids[b * K + k], p.num_experts, p.invalid_expert_id);
        u.topk_weights[(own + slot) * K + k] = p.topk_weights[b * K + k];
      }
    }
  }
  if (b < count || b >= u.rows) return;
  WarpZeroChunk<Vec>(reinterpret_cast<Vec*>(u.hidden + (own + b) * H), vecs, c, lane);
  if (c == 0) UnpackPadIds(u, own + b, lane, 32);
}

// Whether the unpack after the flag round leaves this rank's own slab as
// the direct unpack wrote it: yes unless the round failed (recv_counts
// zeroed while rows were sent here), when the unpack writes the slab as
// padding like every other (the window path's "no row moved"). Read after
// the round's release / acquire of local.unpacked.
__device__ __forceinline__ bool OwnSlabUnpacked(const OsDispatchParams& p, bool direct,
                                                const int32_t* counts) {
  return direct &&
         reinterpret_cast<const volatile int32_t*>(p.local.recv_counts)[p.rank] == counts[p.rank];
}

// Route of the unfused path: block d = destination d, exclusive scans over
// chunks of tokens (as kernels/route.cu), plus the step header and q + 1.
__global__ void __launch_bounds__(kRouteThreads) OsRouteKernel(const OsDispatchParams p) {
  using BlockScan = cub::BlockScan<int, kRouteThreads>;
  __shared__ typename BlockScan::TempStorage temp;
  const int d = blockIdx.x;
  const int64_t n = p.step.t < p.step.r ? p.step.t : p.step.r;
  const int base = p.num_experts / p.ep_size;
  const int rem = p.num_experts % p.ep_size;
  int running = 0;
  if (p.ce) {
    // Copy-engine path: the slot of token t is t at every destination it goes to.
    for (int64_t t = threadIdx.x; t < n; t += kRouteThreads) {
      const bool to_d = (DestMask(p.topk_ids, t, p.top_k, p.num_experts, base, rem) >> d) & 1;
      p.local.token_slot[t * p.ep_size + d] = to_d ? static_cast<int32_t>(t) : -1;
      if (d == 0) CheckTokenIds(p, t);
    }
    running = static_cast<int>(n);
  }
  for (int64_t start = 0; !p.ce && start < n; start += kRouteThreads) {
    const int64_t t = start + threadIdx.x;
    int flag = 0;
    if (t < n) flag = (DestMask(p.topk_ids, t, p.top_k, p.num_experts, base, rem) >> d) & 1;
    if (t < n && d == 0) CheckTokenIds(p, t);
    int prefix = 0;
    int total = 0;
    BlockScan(temp).ExclusiveSum(flag, prefix, total);
    if (t < n) p.local.token_slot[t * p.ep_size + d] = flag ? running + prefix : -1;
    running += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    p.local.send_counts[d] = running;
    if (d == 0) {
      p.local.header[0] = p.step.epoch;
      p.local.header[1] = p.step.r;
      p.local.header[2] = n;
      *p.local.seq += 1;
    }
  }
}

// Work items (slot b, chunk c) spread over all warps of the grid: chunk c of
// token b's row to each of its destinations; chunk 0 also carries the ids
// and weights, and the padding ids/weights at slot b of every destination
// with count <= b. The last block publishes the flags and acquires the
// sources' (a rank alone that unpacks nothing or unpacks directly skips
// both: block 0 writes the header and counts). Fused: every block routes the T <= 512 tokens itself
// (a mask per token, one block scan per destination), block 0 writes token_slot.
template <bool kFused, typename Vec>
__global__ void __launch_bounds__(kThreads) OsSendKernel(const OsDispatchParams p) {
  using BlockScan = cub::BlockScan<int, kThreads>;
  __shared__ typename BlockScan::TempStorage scan;
  __shared__ int32_t counts[kMaxEpSize];
  __shared__ int16_t slots[kFused ? kOsFusedMaxTokens * kOsFusedMaxEpSize : 1];
  __shared__ int is_last;
  __shared__ int state[kMaxEpSize];
  __shared__ int64_t their_epoch[kMaxEpSize];
  __shared__ int64_t their_r[kMaxEpSize];
  __shared__ int32_t direct_hist[kFused ? kOsDirectMaxLocalExperts : 1];
  __shared__ int direct_local_tokens;
  const int E = p.ep_size;
  const int K = p.top_k;
  const int64_t H = p.hidden_size;
  const int tid = threadIdx.x;
  if (blockIdx.x == 0) {
    for (int a = 0; a < 2; ++a) {
      for (int i = tid; i < p.zero.n[a]; i += blockDim.x) p.zero.ptr[a][i] = 0;
    }
  }
  const int warp = tid / 32;
  const int lane = tid % 32;
  const bool sys = p.sys_scope;
  int64_t* header = p.local.header;
  const int64_t R = kFused ? p.step.r : header[1];
  const int64_t T = kFused ? (p.step.t < R ? p.step.t : R) : header[2];
  const int64_t epoch = kFused ? p.step.epoch : header[0];
  // A rank alone skips the grid-wide count and the flag round (below) when
  // it unpacks nothing or unpacks directly (its rows straight into the
  // engine's buffers): its block 0 then writes the sequence number while
  // other blocks may still be starting, so only block 0 reads it.
  const bool direct = kFused && p.direct_unpack;
  const bool alone = E == 1 && (!(kFused && p.fuse_unpack) || direct);
  const uint64_t q = alone && blockIdx.x != 0 ? 0 : (kFused ? *p.local.seq + 1 : *p.local.seq);
  const bool fp8 = p.fp8;
  const bool ce = !kFused && p.ce;  // the hidden rows travel by copy engine
  // Where a row's ids start: after 2H bytes of bf16, or the fp8 codes and scales.
  const int64_t hp = fp8 ? core::fp8::QuantizedHiddenBytes(H) : 2 * H;
  const int64_t row_bytes = hp + 8 * K;
  if (kFused) {
    const int base = p.num_experts / E;
    const int rem = p.num_experts % E;
    const uint64_t mask = tid < T ? DestMask(p.topk_ids, tid, K, p.num_experts, base, rem) : 0;
    if (blockIdx.x == 0 && tid < T) CheckTokenIds(p, tid);
    for (int d = 0; d < E; ++d) {
      const int flag = (mask >> d) & 1;
      int prefix = 0;
      int total = 0;
      BlockScan(scan).ExclusiveSum(flag, prefix, total);
      slots[tid * kOsFusedMaxEpSize + d] = static_cast<int16_t>(flag ? prefix : -1);
      if (tid == 0) counts[d] = total;
      __syncthreads();  // scan storage reused
      if (blockIdx.x == 0 && tid < T) p.local.token_slot[tid * E + d] = flag ? prefix : -1;
    }
  } else if (tid < E) {
    counts[tid] = p.local.send_counts[tid];
  }
  __syncthreads();
  // A rank alone's step after a deadline moves nothing (the flag round's
  // "missing peer" below): its direct unpack writes padding and zero
  // counts only. (With peers the flag round decides: see `bad`.)
  const bool moves_nothing =
      direct && E == 1 &&
      reinterpret_cast<volatile OsStepError*>(p.local.error)->kind == kOsDeadline;
  const int64_t direct_t = moves_nothing ? 0 : T;
  if (direct && blockIdx.x == 0) {
    DirectUnpackCounts(p, direct_t, direct_hist, &direct_local_tokens);
  }
  auto slot_of = [&](int64_t b, int d) -> int {
    if (b >= T) return -1;
    if (ce) return static_cast<int>(b);  // every destination, slot = token
    return kFused ? slots[b * kOsFusedMaxEpSize + d] : p.local.token_slot[b * E + d];
  };
  const int64_t vecs = 2 * H / static_cast<int64_t>(sizeof(Vec));
  // fp8: a chunk is one 128-value scale block, quantized by the warp.
  // ce: one item per slot (ids, weights, padding only).
  const int64_t chunks = ce    ? 1
                         : fp8 ? H / core::fp8::kBlockSize
                               : (vecs + 32 * kUnroll - 1) / (32 * kUnroll);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  // Peer-direct: rows for peers go to their receive buffers (stride N =
  // unpack.rows), and no slot past R is written.
  const bool peer_direct = direct && p.peer_direct;
  const int64_t n_rows = p.unpack.rows;
  // Direct: the output slots [0, rows) of the engine's buffer (rows >= R).
  const int64_t slots_out = direct && !peer_direct && n_rows > R ? n_rows : R;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp; item < slots_out * chunks;
       item += stride) {
    const int64_t b = item / chunks;
    const int64_t c = item % chunks;
    if (direct) {
      DirectUnpackItem<Vec>(p, b, c, direct_t, slot_of(b, p.rank),
                            moves_nothing ? 0 : counts[p.rank], lane);
      if (E == 1 || b >= R) continue;  // no peer's window to write
    }
    auto dst = [&](int d) -> uint8_t* {
      if (direct && d == p.rank) return nullptr;  // written above
      const int slot = slot_of(b, d);
      if (slot < 0) return nullptr;
      if (peer_direct)
        return p.peers.window[d] + p.off.receive_hidden + (p.rank * n_rows + slot) * 2 * H;
      return p.peers.window[d] + p.off.dispatch_recv + (p.rank * R + slot) * row_bytes;
    };
    if (b < T && fp8) {
      const uint2 x =
          reinterpret_cast<const uint2*>(p.hidden + b * H + c * core::fp8::kBlockSize)[lane];
      const uint16_t v[4] = {static_cast<uint16_t>(x.x), static_cast<uint16_t>(x.x >> 16),
                             static_cast<uint16_t>(x.y), static_cast<uint16_t>(x.y >> 16)};
      float scale = 0.0f;
      const uint32_t codes = internal::QuantizeWarpBlock(v, &scale);
      for (int d = 0; d < E; ++d) {
        uint8_t* row = dst(d);
        if (row == nullptr) continue;
        reinterpret_cast<uint32_t*>(row + c * core::fp8::kBlockSize)[lane] = codes;
        if (lane == 0) reinterpret_cast<float*>(row + H)[c] = scale;
      }
    } else if (b < T && !ce) {
      WarpCopyChunk<Vec>(reinterpret_cast<const Vec*>(p.hidden + b * H), vecs, c, E, dst, lane);
    }
    if (c != 0) continue;
    if (b < T) {
      for (int k = lane; k < K; k += 32) {
        const int32_t id =
            internal::ExpertOrInvalid(p.topk_ids[b * K + k], p.num_experts, p.invalid_expert_id);
        const float w = p.topk_weights[b * K + k];
        for (int d = 0; d < E; ++d) {
          uint8_t* row = dst(d);
          if (row == nullptr) continue;
          if (peer_direct) {
            const int64_t at = (p.rank * n_rows + slot_of(b, d)) * K + k;
            reinterpret_cast<int32_t*>(p.peers.window[d] + p.off.receive_ids)[at] = id;
            reinterpret_cast<float*>(p.peers.window[d] + p.off.receive_weights)[at] = w;
            continue;
          }
          reinterpret_cast<int32_t*>(row + hp)[k] = id;
          reinterpret_cast<float*>(row + hp + 4 * K)[k] = w;
        }
      }
    }
    for (int d = 0; d < E; ++d) {
      // Peer-direct: the owner pads its receive buffers after the flags.
      if (b < counts[d] || (direct && d == p.rank) || peer_direct) continue;
      uint8_t* row = p.peers.window[d] + p.off.dispatch_recv + (p.rank * R + b) * row_bytes;
      for (int k = lane; k < K; k += 32) {
        reinterpret_cast<int32_t*>(row + hp)[k] = p.invalid_expert_id;
        reinterpret_cast<float*>(row + hp + 4 * K)[k] = 0.0f;
      }
    }
  }
  if (alone) {
    // A rank alone, unpacking nothing or directly, waits for no one and no
    // block waits for it: its rows reach the next kernel by stream order. No grid-wide
    // count, no flag (issue 32: the EP 1 step at 128 tokens); block 0
    // writes what the last block would. (Unfused, after a deadline, a block
    // starting late may read T = 0 from the header: that step moves no row
    // anyway.)
    if (blockIdx.x != 0 || tid != 0) return;
    if (kFused) {
      header[0] = epoch;
      header[1] = R;
      header[2] = T;
      *p.local.seq = q;
      p.local.send_counts[0] = counts[0];
    }
    // A step after a deadline moves nothing, as the flag round's "missing
    // peer" (state 3) would have it.
    const bool failed = reinterpret_cast<volatile OsStepError*>(p.local.error)->kind == kOsDeadline;
    p.local.recv_counts[0] = failed ? 0 : counts[0];
    if (failed) header[2] = 0;
    return;
  }
  if (!CountDone(&p.local.done[0], &is_last, sys)) {
    if (kFused && p.fuse_unpack) {
      // The last block releases q once the sources' flags are in. Bounded
      // like every wait: should the grid not all be resident (no block then
      // counts last), the waiters time out, record it and free their SMs.
      __shared__ int late;
      if (tid == 0) {
        late = WaitSeq(p.local.unpacked, q, p.timeout_ns, false) != 0;
        if (late) RecordError(p.local.error, kOsDeadline, p.rank, kOsDispatch, q, 0, 0, epoch, R);
      }
      __syncthreads();
      if (!late && peer_direct) PeerDirectShare(p, R, OwnSlabUnpacked(p, direct, counts));
      if (!late && !peer_direct) {
        UnpackShare(p.unpack, OwnSlabUnpacked(p, direct, counts) ? p.rank : -1);
      }
    }
    return;
  }
  if (kFused) {
    if (tid == 0) {
      header[0] = epoch;
      header[1] = R;
      header[2] = T;
      *p.local.seq = q;
    }
    if (tid < E) p.local.send_counts[tid] = counts[tid];
  }
  Fence(sys);
  // What this rank publishes and compares: a refused dispatch's R differs
  // from every step's.
  const int64_t my_r = p.refused ? kOsRefusedR : (peer_direct ? R | kOsPeerDirectR : R);
  if (tid < E) {
    OsFlag* f = reinterpret_cast<OsFlag*>(p.peers.window[tid] + p.off.dispatch_flags) + p.rank;
    volatile OsFlag* vf = f;
    vf->epoch = epoch;
    vf->r = my_r;
    vf->count = counts[tid];
    StoreRelease(&f->seq, q, sys);
  }
  const bool skip = reinterpret_cast<volatile OsStepError*>(p.local.error)->kind == kOsDeadline;
  if (tid < E) {
    const OsFlag* f =
        reinterpret_cast<const OsFlag*>(p.peers.window[p.rank] + p.off.dispatch_flags) + tid;
    int st = skip ? 3 : WaitFlag(f, q, p.timeout_ns, sys);
    int32_t count = 0;
    if (st == 0) {
      const volatile OsFlag* vf = f;
      their_epoch[tid] = vf->epoch;
      their_r[tid] = vf->r;
      count = static_cast<int32_t>(vf->count);
      if (their_epoch[tid] != epoch || their_r[tid] != my_r) st = kOsMismatch;
    }
    p.local.recv_counts[tid] = count;
    state[tid] = st;
  }
  __syncthreads();
  if (tid == 0) {
    int bad = -1;
    for (int s = 0; s < E && bad < 0; ++s) {
      if (state[s] == kOsDeadline || state[s] == 3) bad = s;  // a missing peer first
    }
    for (int s = 0; s < E && bad < 0; ++s) {
      if (state[s] == kOsMismatch) bad = s;
    }
    if (bad >= 0) {
      header[2] = 0;  // no output row
      for (int s = 0; s < E; ++s) p.local.recv_counts[s] = 0;
      if (direct) {
        // The own slab's counts written before the flags are taken back;
        // the unpack below pads the slab (OwnSlabUnpacked).
        p.unpack.source_counts[p.rank] = 0;
        for (int l = 0; l < p.unpack.num_local_experts; ++l) p.unpack.expert_counts[l] = 0;
      }
      if (state[bad] == kOsDeadline) {
        RecordError(p.local.error, kOsDeadline, bad, kOsDispatch, q, 0, 0, epoch, R);
      } else if (state[bad] == kOsMismatch) {
        RecordError(p.local.error, kOsMismatch, bad, kOsDispatch, q, their_epoch[bad], their_r[bad],
                    epoch, my_r);
      }
    }
  }
  if (kFused && p.fuse_unpack) {
    __syncthreads();  // the flags' acquires and the decision above
    if (tid == 0) {
      __threadfence();
      StoreRelease(p.local.unpacked, q, false);
    }
    if (peer_direct) {
      PeerDirectShare(p, R, OwnSlabUnpacked(p, direct, counts));
    } else {
      UnpackShare(p.unpack, OwnSlabUnpacked(p, direct, counts) ? p.rank : -1);
    }
  }
}

// The identity expert's weight of a received bf16 row [2H values | K ids |
// K weights]: the sum over k ascending of the weights whose id is one of
// this rank's slot_ids (the expert kernel's arithmetic). Warp-wide, called by
// all 32 lanes: lane k looks up choice k, so the K lookups are one round of
// loads instead of K dependent ones (issue 32: the 4096-token identity
// combine spent its time here), and the terms are added in k order through
// shuffles, which keeps the sum bit-equal to the sequential one. Every lane
// returns the sum.
__device__ __forceinline__ float IdentityRowWeight(const uint8_t* row, int64_t H, int K,
                                                   const int32_t* slot_ids, int num_local_experts,
                                                   int lane) {
  const int32_t* ids = reinterpret_cast<const int32_t*>(row + 2 * H);
  const float* w = reinterpret_cast<const float*>(row + 2 * H + 4 * K);
  float ws = 0.f;
  for (int k0 = 0; k0 < K; k0 += 32) {
    const int k = k0 + lane;
    float term = 0.f;
    if (k < K && core::LocalSlot(slot_ids, num_local_experts, ids[k]) >= 0) term = w[k];
    const int n = K - k0 < 32 ? K - k0 : 32;
    for (int i = 0; i < n; ++i) ws += __shfl_sync(0xffffffffu, term, i);
  }
  return ws;
}

// out = bf16(ws * x) per element, the identity expert's arithmetic
// (kernels/expert_kernels.cu WeightedExpertSumKernel).
template <typename Vec>
__device__ __forceinline__ Vec ScaleBf16(const Vec& x, float ws) {
  Vec y;
  const uint32_t* in = reinterpret_cast<const uint32_t*>(&x);
  uint32_t* out = reinterpret_cast<uint32_t*>(&y);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Vec) / 4); ++i) {
    out[i] = PackBf16(ws * Bf16Lo(in[i]), ws * Bf16Hi(in[i]));
  }
  return y;
}

// Chunk c (32 * kUnroll vectors) of an identity expert's output row: the
// received bf16 row `row` scaled by its weight (IdentityRowWeight), into
// `out`. Warp-wide. The row's loads are issued before the weight's, so both
// are in flight together. Shared by the copy-engine path's identity rows and
// the combine's push.
template <typename Vec>
__device__ __forceinline__ void IdentityChunk(const uint8_t* row, Vec* out, int64_t in_vecs,
                                              int64_t c, int64_t H, int K, const int32_t* slot_ids,
                                              int num_local_experts, int lane) {
  const Vec* x = reinterpret_cast<const Vec*>(row);
  const int64_t v0 = c * 32 * kUnroll;
  Vec xv[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = v0 + u * 32 + lane;
    if (v < in_vecs) xv[u] = x[v];
  }
  const float ws = IdentityRowWeight(row, H, K, slot_ids, num_local_experts, lane);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int64_t v = v0 + u * 32 + lane;
    if (v < in_vecs) out[v] = ScaleBf16(xv[u], ws);
  }
}

// Identity rows of the copy-engine path: items (row idx = (s, j), chunk c)
// over the grid's warps, rows j < recv_counts[s], the push's arithmetic.
template <typename Vec>
__global__ void __launch_bounds__(kThreads) OsIdentityRowsKernel(const OsIdentityParams p) {
  __shared__ int32_t rc[kMaxEpSize];
  const int E = p.ep_size;
  const int K = p.top_k;
  const int64_t R = p.max_tokens;
  const int64_t H = p.hidden_size;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (threadIdx.x < E) rc[threadIdx.x] = p.recv_counts[threadIdx.x];
  __syncthreads();
  const int64_t row_bytes = 2 * H + 8 * K;
  const int64_t in_vecs = 2 * H / static_cast<int64_t>(sizeof(Vec));
  const int64_t chunks = (in_vecs + 32 * kUnroll - 1) / (32 * kUnroll);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + warp; item < E * R * chunks;
       item += stride) {
    const int64_t idx = item / chunks;
    const int64_t c = item % chunks;
    if (idx % R >= rc[idx / R]) continue;  // uniform over the warp
    IdentityChunk(p.rows + idx * row_bytes, reinterpret_cast<Vec*>(p.out + idx * H), in_vecs, c, H,
                  K, p.slot_ids, p.num_local_experts, lane);
  }
}

// Push (a warp per received row), flag exchange (last block publishes, every
// block acquires), reduction (a warp per token of this rank).
template <bool kIdentity, typename Vec>
__global__ void __launch_bounds__(kThreads) OsCombineKernel(const OsCombineParams p) {
  __shared__ int32_t rc[kMaxEpSize];
  __shared__ int is_last;
  __shared__ int failed;
  const int E = p.ep_size;
  const int K = p.top_k;
  const int64_t R = p.max_tokens;
  const int64_t H = p.hidden_size;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const bool sys = p.sys_scope;
  const uint64_t q = *p.local.seq;
  const int64_t row_bytes = 2 * H + 8 * K;
  const int64_t src_rows = p.expert_out_rows > 0 ? p.expert_out_rows : R;
  // Identity experts' received rows: the window's, or with fp8 the owner's
  // dequantized copy.
  const uint8_t* identity_rows =
      p.rows != nullptr ? p.rows : p.peers.window[p.rank] + p.off.dispatch_recv;
  if (tid < E) rc[tid] = p.local.recv_counts[tid];
  if (tid == 0) failed = 0;
  __syncthreads();
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t first_warp = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  // This rank's own rows are not pushed into its window and read back: the
  // reduction reads them where they are (the expert output, or the received
  // row scaled on the fly), which halves the bytes at EP 1 (issue 32: the
  // 4096-token combine against a copy of its bytes). Identity rows need
  // 16-byte rows for the reduction's vectors; the copy-engine path has its
  // rows in the window already.
  const bool own_in_place = !p.ce && !p.push_own && (!kIdentity || std::is_same_v<Vec, uint4>);
  // Push: items (received row idx = (s, j), chunk c) over the sources s that
  // are pushed; none on the copy-engine path (the rows are in the sources'
  // windows already).
  const int64_t in_vecs = 2 * H / static_cast<int64_t>(sizeof(Vec));
  const int64_t chunks = (in_vecs + 32 * kUnroll - 1) / (32 * kUnroll);
  const int pushed = own_in_place ? E - 1 : E;
  const int64_t push_items = p.ce || p.refused ? 0 : pushed * R * chunks;
  for (int64_t item = first_warp; item < push_items; item += stride) {
    const int64_t c = item % chunks;
    int s = static_cast<int>(item / chunks / R);
    if (own_in_place && s >= p.rank) ++s;  // skip this rank's own slab
    const int64_t j = (item / chunks) % R;
    const int64_t idx = s * R + j;
    if (j >= rc[s]) continue;  // uniform over the warp
    uint8_t* out_row = p.peers.window[s] + p.off.combine_recv + (p.rank * R + j) * H * 2;
    if (kIdentity) {
      IdentityChunk(identity_rows + idx * row_bytes, reinterpret_cast<Vec*>(out_row), in_vecs, c, H,
                    K, p.slot_ids, p.num_local_experts, lane);
    } else {
      // Same chunking over the expert output's uint4 vectors.
      const int64_t out_vecs = H / 8;
      if (c * 32 * kUnroll < out_vecs) {
        WarpCopyChunk<uint4>(
            reinterpret_cast<const uint4*>(p.expert_out + (s * src_rows + j) * H), out_vecs, c, 1,
            [&](int) { return out_row; }, lane);
      }
    }
  }
  const bool skip = reinterpret_cast<volatile OsStepError*>(p.local.error)->kind == kOsDeadline;
  // A rank alone whose rows are all in place waits for no one: no flag, no
  // grid-wide count (issue 32: the EP 1 step at 128 tokens).
  const bool alone = E == 1 && own_in_place;
  if (!alone) {
    const bool last = CountDone(&p.local.done[1], &is_last, sys);
    if (last) {
      Fence(sys);
      if (tid < E) {
        OsFlag* f = reinterpret_cast<OsFlag*>(p.peers.window[tid] + p.off.combine_flags) + p.rank;
        f->r = p.refused ? kOsRefusedR : R;  // published by the release store of q
        StoreRelease(&f->seq, q, sys);
      }
    }
    if (tid < E) {
      const OsFlag* f =
          reinterpret_cast<const OsFlag*>(p.peers.window[p.rank] + p.off.combine_flags) + tid;
      const int st = skip ? 3 : WaitFlag(f, q, p.timeout_ns, sys);
      if (st != 0) {
        atomicExch(&failed, 1);
        if (st == kOsDeadline) {
          RecordError(p.local.error, kOsDeadline, tid, kOsCombine, q, 0, 0, p.local.header[0],
                      p.local.header[1]);
        }
      } else if (!p.refused && tid != p.rank &&
                 reinterpret_cast<const volatile OsFlag*>(f)->r == kOsRefusedR) {
        // Peer tid refused its combine: its rows for this rank's tokens never
        // came, so no output row is written here. (A rank that refused too
        // records nothing: its caller has the error.)
        atomicExch(&failed, 1);
        RecordError(p.local.error, kOsMismatch, tid, kOsCombine, q, p.local.header[0], kOsRefusedR,
                    p.local.header[0], p.local.header[1]);
      }
    }
  } else if (tid == 0 && skip) {
    failed = 1;
  }
  __syncthreads();
  if (failed || p.refused) return;  // this block writes no output row
  const int64_t T = *reinterpret_cast<volatile int64_t*>(p.local.header + 2);
  const uint16_t* recv =
      reinterpret_cast<const uint16_t*>(p.peers.window[p.rank] + p.off.combine_recv);
  // Reduce: items (token t, chunk of 32 * kUnroll uint4 = 8 * that many
  // elements), kUnroll loads in flight per lane for each destination rank;
  // each element sums its E terms in rank order, then the shared term (the
  // arithmetic of combine_reduce.cuh).
  const int64_t vecs8 = H / 8;  // uint4 = 8 bf16
  const int64_t rchunks = (vecs8 + 32 * kUnroll - 1) / (32 * kUnroll);
  for (int64_t item = first_warp; item < T * rchunks; item += stride) {
    const int64_t t = item / rchunks;
    const int64_t v0 = (item % rchunks) * 32 * kUnroll + lane;
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[u][e] = 0.f;
    }
    auto add = [](float* a, const uint4& x) {
      a[0] += Bf16Lo(x.x);
      a[1] += Bf16Hi(x.x);
      a[2] += Bf16Lo(x.y);
      a[3] += Bf16Hi(x.y);
      a[4] += Bf16Lo(x.z);
      a[5] += Bf16Hi(x.z);
      a[6] += Bf16Lo(x.w);
      a[7] += Bf16Hi(x.w);
    };
    // Rank d's term of token t: its pushed row, or this rank's own row read
    // in place (for identity experts the received row, scaled below).
    auto term = [&](int d, int32_t slot, const uint8_t** own_row) -> const uint4* {
      *own_row = nullptr;
      if (d != p.rank || !own_in_place) {
        return reinterpret_cast<const uint4*>(recv + (d * R + slot) * H);
      }
      if constexpr (kIdentity) {
        *own_row = identity_rows + (p.rank * R + slot) * row_bytes;
        return reinterpret_cast<const uint4*>(*own_row);
      }
      return reinterpret_cast<const uint4*>(p.expert_out + (d * src_rows + slot) * H);
    };
    auto load = [&](const uint4* src, uint4(&x)[kUnroll]) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + u * 32 < vecs8) x[u] = src[v0 + u * 32];
      }
    };
    auto accumulate = [&](const uint4(&x)[kUnroll], const uint8_t* own_row) {
      if (kIdentity && own_row != nullptr) {
        // The push's arithmetic: bf16(ws * x), added as the pushed row would be.
        const float ws = IdentityRowWeight(own_row, H, K, p.slot_ids, p.num_local_experts, lane);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (v0 + u * 32 < vecs8) add(acc[u], ScaleBf16(x[u], ws));
        }
        return;
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + u * 32 < vecs8) add(acc[u], x[u]);
      }
    };
    // Two ranks' rows in flight at once (twice the loads per lane: the
    // reduction waits on memory, issue 32), still added in rank order.
    for (int d = 0; d < E; d += 2) {
      const int32_t s0 = p.local.token_slot[t * E + d];
      const int32_t s1 = d + 1 < E ? p.local.token_slot[t * E + d + 1] : -1;
      const uint8_t* own0 = nullptr;
      const uint8_t* own1 = nullptr;
      uint4 x0[kUnroll];
      uint4 x1[kUnroll];
      if (s0 >= 0) load(term(d, s0, &own0), x0);
      if (s1 >= 0) load(term(d + 1, s1, &own1), x1);
      if (s0 >= 0) accumulate(x0, own0);
      if (s1 >= 0) accumulate(x1, own1);
    }
    if (p.shared != nullptr) {
      uint4 x[kUnroll];
      load(reinterpret_cast<const uint4*>(p.shared + t * H), x);
      accumulate(x, nullptr);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v0 + u * 32 >= vecs8) continue;
      reinterpret_cast<uint4*>(p.output + t * H)[v0 + u * 32] =
          make_uint4(PackBf16(acc[u][0], acc[u][1]), PackBf16(acc[u][2], acc[u][3]),
                     PackBf16(acc[u][4], acc[u][5]), PackBf16(acc[u][6], acc[u][7]));
    }
  }
}

absl::Status CheckCommon(int ep_size, int64_t hidden, const OsLocalState& l, const char* who) {
  if (ep_size < 1 || ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: ep_size expected in [1, %d], got %d", who, kMaxEpSize, ep_size));
  }
  if (hidden < 8 || hidden % 8 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: hidden expected a positive multiple of 8, got %d", who, hidden));
  }
  if (l.token_slot == nullptr || l.send_counts == nullptr || l.recv_counts == nullptr ||
      l.header == nullptr || l.seq == nullptr || l.done == nullptr || l.error == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: null local state pointer", who));
  }
  return absl::OkStatus();
}

}  // namespace

OsWindowOffsets OsWindowLayout(int ep_size, int64_t capacity, int64_t hidden, int top_k, bool fp8,
                               bool receive_buffers) {
  const int64_t row = fp8 ? Fp8DispatchRowBytes(hidden, top_k) : 2 * hidden + 8 * top_k;
  OsWindowOffsets o;
  const int64_t e = ep_size;
  o.seq = 0;
  o.dispatch_flags = Align128(o.seq + 8);
  o.combine_flags = Align128(o.dispatch_flags + e * static_cast<int64_t>(sizeof(OsFlag)));
  o.dispatch_recv = Align128(o.combine_flags + e * static_cast<int64_t>(sizeof(OsFlag)));
  o.combine_recv = Align128(o.dispatch_recv + e * capacity * row);
  o.total_bytes = Align128(o.combine_recv + e * capacity * hidden * 2);
  if (receive_buffers) {
    o.receive_rows = capacity;
    o.receive_hidden = o.total_bytes;
    o.receive_ids = Align128(o.receive_hidden + e * capacity * hidden * 2);
    o.receive_weights = Align128(o.receive_ids + e * capacity * top_k * 4);
    o.total_bytes = Align128(o.receive_weights + e * capacity * top_k * 4);
  }
  return o;
}

const void* OsFirstDispatchKernel(int64_t r, int ep_size, int64_t hidden, int top_k, bool ce) {
  const bool vec16 = (2 * hidden + 8 * top_k) % 16 == 0;
  if (ce || !OsDispatchFused(r, ep_size)) return reinterpret_cast<const void*>(&OsRouteKernel);
  return vec16 ? reinterpret_cast<const void*>(&OsSendKernel<true, uint4>)
               : reinterpret_cast<const void*>(&OsSendKernel<true, uint2>);
}

namespace {

absl::Status CheckDispatch(const OsDispatchParams& p) {
  if (absl::Status s = CheckCommon(p.ep_size, p.hidden_size, p.local, "LaunchOsDispatch");
      !s.ok()) {
    return s;
  }
  if (p.fuse_unpack &&
      (p.ce || p.fp8 || !OsDispatchFused(p.step.r, p.ep_size) || !p.unpack.counts_zeroed)) {
    return absl::InvalidArgumentError(
        "LaunchOsDispatch: fuse_unpack needs the fused SM path with bf16 rows (R <= 512, E <= 8) "
        "and counts the send kernel zeroes (unpack.counts_zeroed)");
  }
  if (p.direct_unpack &&
      (!p.fuse_unpack || !OsDirectUnpackFits(p.unpack) || p.unpack.hidden_size != p.hidden_size ||
       p.unpack.rows < p.step.r || p.unpack.ep_size != p.ep_size)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchOsDispatch: direct_unpack needs fuse_unpack, at most %d local experts (got %d), a "
        "16-byte aligned hidden buffer of H %d (got H %d), rows >= R (got %d, R %d), the "
        "unpack's ep_size %d (got %d)",
        kOsDirectMaxLocalExperts, p.unpack.num_local_experts, p.hidden_size, p.unpack.hidden_size,
        p.unpack.rows, p.step.r, p.ep_size, p.unpack.ep_size));
  }
  if (p.peer_direct) {
    const uint8_t* own = p.rank >= 0 && p.rank < p.ep_size ? p.peers.window[p.rank] : nullptr;
    if (!p.direct_unpack || !OsUnpacksIntoReceiveBuffers(p.unpack, own, p.off)) {
      return absl::InvalidArgumentError(
          "LaunchOsDispatch: peer_direct needs direct_unpack into this rank's window's receive "
          "buffers (hidden, ids and weights at their offsets, rows = the window's N)");
    }
  }
  if (p.top_k < 1 || p.top_k > kMaxTopK || p.num_experts < p.ep_size || p.step.r < 0 ||
      p.step.t < 0 || p.blocks < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchOsDispatch: expected top_k in [1, %d], num_experts >= ep_size, R, T >= 0, "
        "blocks >= 1; got top_k %d, num_experts %d, ep_size %d, R %d, T %d, blocks %d",
        kMaxTopK, p.top_k, p.num_experts, p.ep_size, p.step.r, p.step.t, p.blocks));
  }
  if (p.step.t > 0 && (p.hidden == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr)) {
    return absl::InvalidArgumentError("LaunchOsDispatch: null input with T > 0");
  }
  if (p.fp8 && p.hidden_size % core::fp8::kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchOsDispatch: fp8_e4m3 needs hidden a multiple of 128, got %d", p.hidden_size));
  }
  if (p.fp8 && p.ce) {
    return absl::InvalidArgumentError(
        "LaunchOsDispatch: the copy-engine path moves bf16 rows only (fp8_e4m3 needs the SM path)");
  }
  for (int d = 0; d < p.ep_size; ++d) {
    if (p.peers.window[d] == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrFormat("LaunchOsDispatch: no window for rank %d", d));
    }
  }
  return absl::OkStatus();
}

// Grid of the send kernel: one warp per item, at most p.blocks blocks.
unsigned SendGrid(const OsDispatchParams& p) {
  const bool vec16 = (2 * p.hidden_size + 8 * p.top_k) % 16 == 0;
  const int64_t vecs = 2 * p.hidden_size / (vec16 ? 16 : 8);
  const int64_t chunks = p.ce ? 1 : (vecs + 32 * kUnroll - 1) / (32 * kUnroll);
  // A direct unpack also writes the engine's padding slots [R, rows)
  // (peer-direct: none past R).
  const int64_t slots =
      p.direct_unpack && !p.peer_direct ? std::max(p.step.r, p.unpack.rows) : p.step.r;
  const int64_t warps_needed = (slots * chunks + kWarps - 1) / kWarps;
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(warps_needed, p.blocks)));
}

}  // namespace

absl::Status LaunchOsRoute(const OsDispatchParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckDispatch(p));
  OsRouteKernel<<<p.ep_size, kRouteThreads, 0, stream>>>(p);
  return internal::LaunchStatus("OsRouteKernel");
}

absl::Status LaunchOsSend(const OsDispatchParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckDispatch(p));
  const bool vec16 = (2 * p.hidden_size + 8 * p.top_k) % 16 == 0;
  const unsigned grid = SendGrid(p);
  if (vec16) {
    OsSendKernel<false, uint4><<<grid, kThreads, 0, stream>>>(p);
  } else {
    OsSendKernel<false, uint2><<<grid, kThreads, 0, stream>>>(p);
  }
  return internal::LaunchStatus("OsSendKernel");
}

absl::Status LaunchOsDispatch(const OsDispatchParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckDispatch(p));
  const bool vec16 = (2 * p.hidden_size + 8 * p.top_k) % 16 == 0;
  const unsigned grid = SendGrid(p);
  if (!p.ce && OsDispatchFused(p.step.r, p.ep_size)) {
    if (vec16) {
      OsSendKernel<true, uint4><<<grid, kThreads, 0, stream>>>(p);
    } else {
      OsSendKernel<true, uint2><<<grid, kThreads, 0, stream>>>(p);
    }
    return internal::LaunchStatus("OsSendKernel<fused>");
  }
  RETURN_IF_ERROR(LaunchOsRoute(p, stream));
  return LaunchOsSend(p, stream);
}

absl::Status LaunchOsCombine(const OsCombineParams& p, cudaStream_t stream) {
  if (absl::Status s = CheckCommon(p.ep_size, p.hidden_size, p.local, "LaunchOsCombine"); !s.ok()) {
    return s;
  }
  if (p.max_tokens < 0 || p.blocks < 1 || p.top_k < 1 || p.top_k > kMaxTopK ||
      (p.max_tokens > 0 && !p.identity && p.expert_out == nullptr) ||
      (p.max_tokens > 0 && p.output == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchOsCombine: expected R >= 0, blocks >= 1, top_k in [1, %d], an expert output "
        "(unless identity) and an output; got R %d, blocks %d, top_k %d",
        kMaxTopK, p.max_tokens, p.blocks, p.top_k));
  }
  if (reinterpret_cast<uintptr_t>(p.output) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.shared) % 16 != 0) {
    return absl::InvalidArgumentError("LaunchOsCombine: output and shared must be 16-byte aligned");
  }
  const bool vec16 = (2 * p.hidden_size + 8 * p.top_k) % 16 == 0;
  const int64_t vecs = 2 * p.hidden_size / (vec16 ? 16 : 8);
  // The copy-engine path pushes nothing: the grid covers the reduction.
  const int64_t items =
      (p.ce ? 1 : p.ep_size) * p.max_tokens * ((vecs + 32 * kUnroll - 1) / (32 * kUnroll));
  const int64_t warps_needed = (items + kWarps - 1) / kWarps;
  const unsigned grid =
      static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(warps_needed, p.blocks)));
  if (!p.identity) {
    OsCombineKernel<false, uint4><<<grid, kThreads, 0, stream>>>(p);
  } else if (vec16) {
    OsCombineKernel<true, uint4><<<grid, kThreads, 0, stream>>>(p);
  } else {
    OsCombineKernel<true, uint2><<<grid, kThreads, 0, stream>>>(p);
  }
  return internal::LaunchStatus("OsCombineKernel");
}

absl::Status LaunchOsIdentityRows(const OsIdentityParams& p, cudaStream_t stream) {
  if (p.ep_size < 1 || p.ep_size > kMaxEpSize || p.hidden_size < 8 || p.hidden_size % 8 != 0 ||
      p.top_k < 1 || p.top_k > kMaxTopK || p.max_tokens < 0 || p.blocks < 1 ||
      (p.max_tokens > 0 && (p.rows == nullptr || p.out == nullptr || p.recv_counts == nullptr))) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchOsIdentityRows: expected ep_size in [1, %d], hidden a positive multiple of 8, "
        "top_k in [1, %d], R >= 0, blocks >= 1 and non-null rows, out, counts; got ep_size %d, "
        "hidden %d, top_k %d, R %d, blocks %d",
        kMaxEpSize, kMaxTopK, p.ep_size, p.hidden_size, p.top_k, p.max_tokens, p.blocks));
  }
  if (p.max_tokens == 0) return absl::OkStatus();
  const bool vec16 = (2 * p.hidden_size + 8 * p.top_k) % 16 == 0;
  const int64_t vecs = 2 * p.hidden_size / (vec16 ? 16 : 8);
  const int64_t items = p.ep_size * p.max_tokens * ((vecs + 32 * kUnroll - 1) / (32 * kUnroll));
  const unsigned grid = static_cast<unsigned>(
      std::max<int64_t>(1, std::min<int64_t>((items + kWarps - 1) / kWarps, p.blocks)));
  if (vec16) {
    OsIdentityRowsKernel<uint4><<<grid, kThreads, 0, stream>>>(p);
  } else {
    OsIdentityRowsKernel<uint2><<<grid, kThreads, 0, stream>>>(p);
  }
  return internal::LaunchStatus("OsIdentityRowsKernel");
}

}  // namespace moe_ep::kernels::onesided

namespace moe_ep::kernels::internal {

const void* OneSidedKernelsModule() {
  return reinterpret_cast<const void*>(&onesided::OsRouteKernel);
}

}  // namespace moe_ep::kernels::internal
