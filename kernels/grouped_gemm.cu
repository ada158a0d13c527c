#include <cuda_bf16.h>
#include <mma.h>

#include "absl/strings/str_format.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"

namespace moe_ep::kernels {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kBM = kGroupedGemmTileRows;
constexpr int kBN = 64;
constexpr int kBK = 32;
constexpr int kLds = kBK + 8;  // padded smem row (bf16): 80 bytes, breaks bank conflicts
constexpr int kThreads = 128;  // 4 warps, 2 x 2 over the 64 x 64 tile
constexpr int kChunks = kBM * kBK / 8 / kThreads;  // 16-byte chunks per thread per matrix (2)
constexpr int kStages = 3;                         // cp.async ring depth (K slices in flight)

__global__ void ExpertTileOffsetsKernel(const int32_t* offsets, int num_local_experts,
                                        int32_t* tile_offsets) {
  int32_t acc = 0;
  for (int l = 0; l < num_local_experts; ++l) {
    tile_offsets[l] = acc;
    acc += (offsets[l + 1] - offsets[l] + kBM - 1) / kBM;
  }
  tile_offsets[num_local_experts] = acc;
}

// 8 bf16 of row `row` (or zeros when invalid) starting at column k.
__device__ __forceinline__ uint4 LoadChunk(const uint16_t* __restrict__ row, bool valid, int64_t k,
                                           int64_t len, bool vec) {
  if (!valid) return make_uint4(0, 0, 0, 0);
  if (vec && k + 8 <= len) return *reinterpret_cast<const uint4*>(row + k);
  uint16_t v[8];
  for (int i = 0; i < 8; ++i) v[i] = k + i < len ? row[k + i] : uint16_t{0};
  uint4 out;
  out.x = v[0] | (uint32_t{v[1]} << 16);
  out.y = v[2] | (uint32_t{v[3]} << 16);
  out.z = v[4] | (uint32_t{v[5]} << 16);
  out.w = v[6] | (uint32_t{v[7]} << 16);
  return out;
}

template <int kMats>
struct __align__(128) Smem {
  union {
    struct {
      uint16_t a[kStages][kBM][kLds];  // bf16 bits
      uint16_t b[kStages][kMats][kBN][kLds];
    } ab;
    float c[kThreads / 32][kMats][32 * 32];  // per-warp epilogue staging
  };
};

// 16 bytes global -> shared without registers; src_bytes 0 zero-fills.
__device__ __forceinline__ void CpAsync16(void* smem_dst, const void* src, int src_bytes) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// kFused: b is [L, 2N, K] and the block computes the gate and up tiles of the
// same columns, writing bf16 silu(gate) * up; else b is [L, N, K] and the
// block writes fp32. See the header for the tile mapping. K slices move
// through a kStages-deep cp.async ring (vec: K % 8 == 0 and 16-byte aligned
// operands); otherwise they are loaded element-wise into the same ring.
template <bool kFused>
__global__ void __launch_bounds__(kThreads)
    GroupedGemmKernel(const uint16_t* __restrict__ a, const uint16_t* __restrict__ b,
                      const int32_t* __restrict__ offsets, const int32_t* __restrict__ tile_offsets,
                      int num_local_experts, int64_t n, int64_t k, bool vec,
                      uint16_t* __restrict__ act, float* __restrict__ y) {
  constexpr int kMats = kFused ? 2 : 1;
  __shared__ Smem<kMats> smem;
  const int tile = blockIdx.x;
  if (tile >= tile_offsets[num_local_experts]) return;  // uniform over the block
  // Expert of this m-tile: the last l with tile_offsets[l] <= tile.
  int lo = 0;
  int hi = num_local_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_offsets[mid] <= tile)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int l = lo;
  const int64_t m_start = offsets[l] + int64_t{tile - tile_offsets[l]} * kBM;
  const int64_t m_end = offsets[l + 1];
  const int64_t n0 = int64_t{blockIdx.y} * kBN;
  const uint16_t* b_expert = b + int64_t{l} * kMats * n * k;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int wm = warp / 2;
  const int wn = warp % 2;

  // This thread's chunks: chunk c = tid + i * kThreads -> tile row c / 4,
  // column (c % 4) * 8 of the 32-wide K slice.
  const uint16_t* a_row[kChunks];
  bool a_ok[kChunks];
  const uint16_t* b_row[kMats][kChunks];
  bool b_ok[kChunks];
  int kc[kChunks];
  int rr[kChunks];
  for (int i = 0; i < kChunks; ++i) {
    const int c = tid + i * kThreads;
    rr[i] = c / 4;
    kc[i] = (c % 4) * 8;
    const int64_t m = m_start + rr[i];
    a_ok[i] = m < m_end;
    a_row[i] = a + (a_ok[i] ? m : 0) * k;
    const int64_t col = n0 + rr[i];
    b_ok[i] = col < n;
    for (int mat = 0; mat < kMats; ++mat) {
      b_row[mat][i] = b_expert + ((b_ok[i] ? col : 0) + mat * n) * k;
    }
  }

  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMats][2][2];
  for (int mat = 0; mat < kMats; ++mat)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[mat][i][j], 0.0f);

  const int64_t num_slices = (k + kBK - 1) / kBK;
  auto issue = [&](int64_t slice) {
    if (slice >= num_slices) return;
    const int st = static_cast<int>(slice % kStages);
    const int64_t k0 = slice * kBK;
    for (int i = 0; i < kChunks; ++i) {
      const int64_t kk = k0 + kc[i];
      if (vec) {
        const bool in = kk < k;  // K % 8 == 0: a chunk is all in or all out
        CpAsync16(&smem.ab.a[st][rr[i]][kc[i]], a_row[i] + (in ? kk : 0), a_ok[i] && in ? 16 : 0);
        for (int mat = 0; mat < kMats; ++mat) {
          CpAsync16(&smem.ab.b[st][mat][rr[i]][kc[i]], b_row[mat][i] + (in ? kk : 0),
                    b_ok[i] && in ? 16 : 0);
        }
      } else {
        *reinterpret_cast<uint4*>(&smem.ab.a[st][rr[i]][kc[i]]) =
            LoadChunk(a_row[i], a_ok[i], kk, k, false);
        for (int mat = 0; mat < kMats; ++mat) {
          *reinterpret_cast<uint4*>(&smem.ab.b[st][mat][rr[i]][kc[i]]) =
              LoadChunk(b_row[mat][i], b_ok[i], kk, k, false);
        }
      }
    }
  };
  for (int s = 0; s < kStages - 1; ++s) {
    issue(s);
    CpAsyncCommit();
  }
  for (int64_t slice = 0; slice < num_slices; ++slice) {
    CpAsyncWait<kStages - 2>();  // slice's group has landed
    __syncthreads();             // ... for every thread; slice - 1's buffer is free
    issue(slice + kStages - 1);
    CpAsyncCommit();
    const int st = static_cast<int>(slice % kStages);
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
      for (int i = 0; i < 2; ++i) {
        wmma::load_matrix_sync(
            fa[i], reinterpret_cast<const __nv_bfloat16*>(&smem.ab.a[st][wm * 32 + i * 16][kk]),
            kLds);
      }
      for (int mat = 0; mat < kMats; ++mat) {
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
          wmma::load_matrix_sync(
              fb, reinterpret_cast<const __nv_bfloat16*>(&smem.ab.b[st][mat][wn * 32 + j * 16][kk]),
              kLds);
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[mat][i][j], fa[i], fb, acc[mat][i][j]);
        }
      }
    }
  }
  CpAsyncWait<0>();
  __syncthreads();  // the ring is dead before the epilogue reuses it

  // Epilogue through this warp's staging.
  for (int mat = 0; mat < kMats; ++mat)
    for (int i = 0; i < 2; ++i)
      for (int j = 0; j < 2; ++j) {
        wmma::store_matrix_sync(&smem.c[warp][mat][i * 16 * 32 + j * 16], acc[mat][i][j], 32,
                                wmma::mem_row_major);
      }
  __syncwarp();
  const int lane = tid % 32;
  for (int idx = lane; idx < 32 * 32; idx += 32) {
    const int i = idx / 32;
    const int j = idx % 32;
    const int64_t row = m_start + wm * 32 + i;
    const int64_t col = n0 + wn * 32 + j;
    if (row >= m_end || col >= n) continue;
    if constexpr (kFused) {
      const float g = smem.c[warp][0][idx];
      const float u = smem.c[warp][1][idx];
      const __nv_bfloat16 v = __float2bfloat16_rn(g / (1.0f + __expf(-g)) * u);
      act[row * n + col] = *reinterpret_cast<const uint16_t*>(&v);
    } else {
      y[row * n + col] = smem.c[warp][0][idx];
    }
  }
}

absl::Status Check(const GroupedGemmParams& p, const void* out, const char* who) {
  if (p.a == nullptr || p.b == nullptr || p.offsets == nullptr || p.tile_offsets == nullptr ||
      out == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: null device pointer", who));
  }
  if (p.max_rows < 0 || p.n < 1 || p.k < 1 || p.num_local_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: expected max_rows >= 0, n >= 1, k >= 1, L >= 1, got %d, %d, %d, %d",
                        who, p.max_rows, p.n, p.k, p.num_local_experts));
  }
  const int64_t m_tiles = (p.max_rows + kBM - 1) / kBM + p.num_local_experts;
  if (m_tiles > (int64_t{1} << 31) - 1 || (p.n + kBN - 1) / kBN > 65535) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: grid of %d x %d tiles too large", who,
                                                      m_tiles, (p.n + kBN - 1) / kBN));
  }
  return absl::OkStatus();
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <bool kFused>
absl::Status Launch(const GroupedGemmParams& p, uint16_t* act, float* y, cudaStream_t stream,
                    const char* name) {
  if (p.max_rows == 0) return absl::OkStatus();
  const int64_t m_tiles = (p.max_rows + kBM - 1) / kBM + p.num_local_experts;
  const dim3 grid(static_cast<unsigned>(m_tiles), static_cast<unsigned>((p.n + kBN - 1) / kBN));
  const bool vec = p.k % 8 == 0 && Aligned16(p.a) && Aligned16(p.b);
  GroupedGemmKernel<kFused><<<grid, kThreads, 0, stream>>>(
      p.a, p.b, p.offsets, p.tile_offsets, p.num_local_experts, p.n, p.k, vec, act, y);
  return internal::LaunchStatus(name);
}

}  // namespace

absl::Status LaunchExpertTileOffsets(const int32_t* offsets, int num_local_experts,
                                     int32_t* tile_offsets, cudaStream_t stream) {
  if (offsets == nullptr || tile_offsets == nullptr || num_local_experts < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchExpertTileOffsets: null pointer or num_local_experts %d < 1", num_local_experts));
  }
  ExpertTileOffsetsKernel<<<1, 1, 0, stream>>>(offsets, num_local_experts, tile_offsets);
  return internal::LaunchStatus("ExpertTileOffsetsKernel");
}

absl::Status LaunchGroupedSwiGlu(const GroupedGemmParams& p, uint16_t* act, cudaStream_t stream) {
  absl::Status s = Check(p, act, "LaunchGroupedSwiGlu");
  if (!s.ok()) return s;
  return Launch<true>(p, act, nullptr, stream, "GroupedGemmKernel<SwiGLU>");
}

absl::Status LaunchGroupedGemm(const GroupedGemmParams& p, float* y, cudaStream_t stream) {
  absl::Status s = Check(p, y, "LaunchGroupedGemm");
  if (!s.ok()) return s;
  return Launch<false>(p, nullptr, y, stream, "GroupedGemmKernel<plain>");
}

const void* internal::GroupedGemmModule() {
  return reinterpret_cast<const void*>(&ExpertTileOffsetsKernel);
}

}  // namespace moe_ep::kernels
