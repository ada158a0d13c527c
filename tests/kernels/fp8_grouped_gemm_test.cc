#include "kernels/fp8_grouped_gemm.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/fp8_e4m3.h"
#include "core/model_config.h"
#include "core/quantized_expert_compute.h"
#include "core/quantized_formats.h"
#include "core/quantized_weights.h"
#include "kernels/hopper_grouped_gemm.cuh"
#include "tests/kernels/gpu_test_util.h"

// fp8 block-scaled grouped GEMMs (issue 35 item 3) against the CPU reference
// of core/quantized_expert_compute.h (core::quant::Fp8BlockGemm and the
// activation rule of core/quantized_formats.h):
//  - exact cases: small-integer codes and power-of-two scales make every
//    block's partial sum and every promotion exact in any order, so the GPU
//    must equal the reference bit for bit (plain y, fused act codes and
//    scales: gate sums >= 64, so silu(g) = g exactly on both sides);
//  - random cases (activations quantized from U(-1, 1), weights from
//    QuantizeFp8Block of random bf16): within the rounding of the tensor
//    cores' in-block order, bounded by 2^-10 of the sum of |products| (the
//    largest ratio seen is printed), plus bf16's rounding of y; fused: the
//    dequantized act within e4m3's half ulp of the reference's fp32 h.
// Row counts include empty experts, one row, 64/65 (the second m64 half),
// several m-tiles, both tile heights (128 and 256 rows); outputs start as sentinels and rows past
// offsets[L] must stay untouched; repeated runs agree bit for bit; a CUDA
// graph replays with new counts; every fp8 config's (H, I) runs at real size.
// The variants (Fp8GemmParams::l2_hint 1-3, cluster 2 and 3) equal the
// default mode bit for bit on random uneven experts.

namespace moe_ep::kernels {
namespace fp8_grouped_gemm_test {
namespace {

using core::bf16_t;
using core::quant::Fp8Activations;
using core::quant::Fp8BlockMatrix;
using testing::DeviceBuffer;

#define REQUIRE_HOPPER()                                                    \
  MOE_EP_REQUIRE_GPUS(1);                                                   \
  if (absl::Status hopper_ = HopperGroupedGemmAvailable(); !hopper_.ok()) { \
    GTEST_SKIP() << hopper_;                                                \
  }

// xorshift uniform in [0, 1).
struct Rng {
  uint64_t x;
  explicit Rng(uint64_t seed) : x(seed * 0x9E3779B97F4A7C15ull + 1) {}
  float Next() {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return static_cast<float>(x >> 40) / static_cast<float>(1 << 24);
  }
  int Int(int lo, int hi) { return lo + static_cast<int>(Next() * (hi - lo + 1)) % (hi - lo + 1); }
};

struct GemmCase {
  std::vector<int32_t> rows_per_expert;
  int64_t n;
  int64_t k;
  bool fused;
  bool exact;
  int tile_rows = 0;  // Fp8GemmParams::tile_rows
  int cluster = 0;    // Fp8GemmParams::cluster
  int l2_hint = 0;    // Fp8GemmParams::l2_hint
};

struct Inputs {
  std::vector<int32_t> offsets;
  int64_t rows = 0;      // offsets[L]
  int64_t max_rows = 0;  // rows + 37
  Fp8Activations a;      // [max_rows, K]
  // Per expert: plain -> one [N, K]; fused -> gate [N, K], up [N, K].
  std::vector<Fp8BlockMatrix> w;
};

// An exact-case matrix: codes of small integers in [lo, hi], scales 2^{-1,0,1}.
Fp8BlockMatrix ExactMatrix(int64_t rows, int64_t cols, int lo, int hi, Rng& rng) {
  Fp8BlockMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.codes.resize(rows * cols);
  for (auto& c : m.codes) c = core::fp8::E4m3FromFloat(static_cast<float>(rng.Int(lo, hi)));
  m.scale_inv.resize(m.scale_rows() * m.scale_cols());
  for (auto& s : m.scale_inv) s = std::ldexp(1.0f, rng.Int(-1, 1));
  return m;
}

Fp8BlockMatrix RandomMatrix(int64_t rows, int64_t cols, float scale, Rng& rng) {
  std::vector<bf16_t> w(rows * cols);
  for (auto& v : w) v = core::FloatToBf16((2.0f * rng.Next() - 1.0f) * scale);
  return core::quant::QuantizeFp8Block(w, rows, cols);
}

Inputs MakeCase(const GemmCase& c, uint64_t seed) {
  Rng rng(seed);
  Inputs in;
  const int num_local = static_cast<int>(c.rows_per_expert.size());
  in.offsets.assign(num_local + 1, 0);
  for (int l = 0; l < num_local; ++l) in.offsets[l + 1] = in.offsets[l] + c.rows_per_expert[l];
  in.rows = in.offsets[num_local];
  in.max_rows = in.rows + 37;
  if (c.exact) {
    // Positive activations (gate sums large and positive: silu(g) = g).
    const Fp8BlockMatrix a = ExactMatrix(in.max_rows, c.k, 1, 4, rng);
    in.a.rows = in.max_rows;
    in.a.cols = c.k;
    in.a.codes = a.codes;
    in.a.scales.resize(in.max_rows * (c.k / 128));
    for (auto& s : in.a.scales) s = std::ldexp(1.0f, rng.Int(-1, 1));
  } else {
    std::vector<float> x(in.max_rows * c.k);
    for (auto& v : x) v = 2.0f * rng.Next() - 1.0f;
    in.a = core::quant::Fp8QuantizeActivations(x, in.max_rows, c.k);
  }
  for (int l = 0; l < num_local; ++l) {
    for (int m = 0; m < (c.fused ? 2 : 1); ++m) {
      const bool gate = c.fused && m == 0;
      in.w.push_back(c.exact ? ExactMatrix(c.n, c.k, gate ? 1 : -3, 3, rng)
                             : RandomMatrix(c.n, c.k, 0.05f, rng));
    }
  }
  return in;
}

// The rows [begin, end) of `a`.
Fp8Activations Slice(const Fp8Activations& a, int64_t begin, int64_t end) {
  Fp8Activations s;
  s.rows = end - begin;
  s.cols = a.cols;
  const int64_t kb = a.cols / 128;
  s.codes.assign(a.codes.begin() + begin * a.cols, a.codes.begin() + end * a.cols);
  s.scales.assign(a.scales.begin() + begin * kb, a.scales.begin() + end * kb);
  return s;
}

// sum_k |A W| of row r of `a` against row j of `w` (dequantized, fp64).
double AbsProducts(const Fp8Activations& a, int64_t r, const Fp8BlockMatrix& w, int64_t j) {
  double sum = 0;
  for (int64_t k = 0; k < a.cols; ++k) {
    const double av = static_cast<double>(core::fp8::E4m3ToFloat(a.codes[r * a.cols + k])) *
                      a.scales[r * (a.cols / 128) + k / 128];
    sum += std::abs(av * w.Value(j, k));
  }
  return sum;
}

struct GpuRun {
  std::vector<uint16_t> y;    // plain [max_rows, N] bf16
  std::vector<uint8_t> act;   // fused [max_rows, N]
  std::vector<float> act_sc;  // fused [N / 128, max_rows]
};

GpuRun RunOnGpu(const GemmCase& c, const Inputs& in, int passes) {
  const int num_local = static_cast<int>(c.rows_per_expert.size());
  const int64_t kb = c.k / 128;
  std::vector<float> a_scale(kb * in.max_rows);  // transposed [K/128, max_rows]
  for (int64_t r = 0; r < in.max_rows; ++r) {
    for (int64_t b = 0; b < kb; ++b) a_scale[b * in.max_rows + r] = in.a.scales[r * kb + b];
  }
  std::vector<uint8_t> b_codes;
  std::vector<float> b_scale;
  for (const Fp8BlockMatrix& m : in.w) {
    b_codes.insert(b_codes.end(), m.codes.begin(), m.codes.end());
    b_scale.insert(b_scale.end(), m.scale_inv.begin(), m.scale_inv.end());
  }
  DeviceBuffer<uint8_t> da(in.a.codes), db(b_codes);
  DeviceBuffer<float> das(a_scale), dbs(b_scale);
  DeviceBuffer<int32_t> doff(in.offsets);
  Fp8GemmParams p;
  p.a = da.get();
  p.a_scale = das.get();
  p.a_scale_stride = in.max_rows;
  p.max_rows = in.max_rows;
  p.b = db.get();
  p.b_scale = dbs.get();
  p.offsets = doff.get();
  p.num_local_experts = num_local;
  p.n = c.n;
  p.k = c.k;
  p.tile_rows = c.tile_rows;
  p.cluster = c.cluster;
  p.l2_hint = c.l2_hint;
  GpuRun first;
  for (int pass = 0; pass < passes; ++pass) {
    DeviceBuffer<uint16_t> y(std::vector<uint16_t>(c.fused ? 0 : in.max_rows * c.n, 0x7fc1));
    DeviceBuffer<uint8_t> act(std::vector<uint8_t>(c.fused ? in.max_rows * c.n : 0, 0x5a));
    DeviceBuffer<float> act_sc(
        std::vector<float>(c.fused ? in.max_rows * (c.n / 128) : 0, -12345.0f));
    const absl::Status s =
        c.fused ? LaunchFp8GroupedSwiGlu(p, act.get(), act_sc.get(), in.max_rows, nullptr)
                : LaunchFp8GroupedGemm(p, y.get(), nullptr);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    GpuRun run;
    run.y = y.Download(c.fused ? 0 : in.max_rows * c.n);
    run.act = act.Download(c.fused ? in.max_rows * c.n : 0);
    run.act_sc = act_sc.Download(c.fused ? in.max_rows * (c.n / 128) : 0);
    if (pass > 0) {
      EXPECT_TRUE(run.y == first.y && run.act == first.act && run.act_sc == first.act_sc)
          << "results differ between runs";
    }
    first = std::move(run);
  }
  return first;
}

constexpr double kGemmRel = 1.0 / 1024;  // of sum |products|: the tensor cores' in-block order

void RunGemmCase(const GemmCase& c, int passes = 1, uint64_t seed = 1) {
  SCOPED_TRACE(::testing::Message()
               << "N " << c.n << " K " << c.k << (c.fused ? " fused" : "")
               << (c.exact ? " exact" : " random") << " tile_rows " << c.tile_rows << " cluster "
               << c.cluster << " l2_hint " << c.l2_hint);
  const Inputs in = MakeCase(c, seed + c.n * 31 + c.k);
  const GpuRun got = RunOnGpu(c, in, passes);
  const int num_local = static_cast<int>(c.rows_per_expert.size());
  const int64_t nb = c.n / 128;
  int64_t bad = 0;
  double worst = 0;  // largest (|error| - rounding of y) / sum |products| seen
  for (int l = 0; l < num_local; ++l) {
    const int64_t r0 = in.offsets[l], r1 = in.offsets[l + 1];
    if (r0 == r1) continue;
    const Fp8Activations a = Slice(in.a, r0, r1);
    std::vector<float> g((r1 - r0) * c.n), u((r1 - r0) * c.n);
    const Fp8BlockMatrix& wg = in.w[c.fused ? 2 * l : l];
    ASSERT_TRUE(core::quant::Fp8BlockGemm(a, wg, absl::MakeSpan(g)).ok());
    if (!c.fused) {
      for (int64_t i = 0; i < r1 - r0; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
          const float want = g[i * c.n + j];
          const uint16_t v = got.y[(r0 + i) * c.n + j];
          if (c.exact) {
            if (v != core::FloatToBf16(want) && ++bad <= 5) {
              ADD_FAILURE() << "y[" << r0 + i << ", " << j << "] got " << core::Bf16ToFloat(v)
                            << " want " << want << " (exact)";
            }
            continue;
          }
          const double sum_abs = AbsProducts(a, i, wg, j);
          const double err = std::abs(core::Bf16ToFloat(v) - want) - std::abs(want) / 256;
          worst = std::max(worst, err / sum_abs);
          if (!(err <= kGemmRel * sum_abs + 1e-30) && ++bad <= 5) {
            ADD_FAILURE() << "y[" << r0 + i << ", " << j << "] got " << core::Bf16ToFloat(v)
                          << " want " << want << " sum|AW| " << sum_abs;
          }
        }
      }
      continue;
    }
    const Fp8BlockMatrix& wu = in.w[2 * l + 1];
    ASSERT_TRUE(core::quant::Fp8BlockGemm(a, wu, absl::MakeSpan(u)).ok());
    std::vector<float> h(g.size());
    for (size_t i = 0; i < h.size(); ++i) {
      h[i] = core::fp8::MulRn(core::quant::SwiGluSilu(g[i]), u[i]);
    }
    const Fp8Activations want = core::quant::Fp8QuantizeActivations(h, r1 - r0, c.n);
    for (int64_t i = 0; i < r1 - r0; ++i) {
      const int64_t row = r0 + i;
      for (int64_t b = 0; b < nb; ++b) {
        const float s_got = got.act_sc[b * in.max_rows + row];
        const float s_want = want.scales[i * nb + b];
        if (c.exact && s_got != s_want && ++bad <= 5) {
          ADD_FAILURE() << "act scale[" << row << ", block " << b << "] got " << s_got << " want "
                        << s_want;
        }
        for (int64_t j = b * 128; j < b * 128 + 128; ++j) {
          const uint8_t q = got.act[row * c.n + j];
          if (c.exact) {
            if (q != want.codes[i * c.n + j] && ++bad <= 5) {
              ADD_FAILURE() << "act[" << row << ", " << j << "] got code " << int{q} << " want "
                            << int{want.codes[i * c.n + j]};
            }
            continue;
          }
          // |deq - h| <= half an e4m3 ulp (2^-4 relative, 2^-10 * scale for
          // subnormals) of the GPU's own h, which is within dh of h.
          const double gd = g[i * c.n + j], ud = u[i * c.n + j];
          const double tg = kGemmRel * AbsProducts(a, i, wg, j) + 1e-30;
          const double tu = kGemmRel * AbsProducts(a, i, wu, j) + 1e-30;
          const double dh =
              1.1 * std::abs(ud) * tg + (std::abs(gd) + tg) * tu + 1e-7 * std::abs(h[i * c.n + j]);
          const double deq = static_cast<double>(core::fp8::E4m3ToFloat(q)) * s_got;
          const double hv = h[i * c.n + j];
          const double tol = (std::abs(hv) + dh) / 16 + dh + s_got / 1024;
          if (!(std::abs(deq - hv) <= tol) && ++bad <= 5) {
            ADD_FAILURE() << "act[" << row << ", " << j << "] dequantized " << deq << " want h "
                          << hv << " tol " << tol;
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
  if (!c.exact && !c.fused) {
    std::printf("[          ] largest (|y - ref| - |ref|/256) / sum|AW|: %.3g (bound %.3g)\n",
                worst, kGemmRel);
  }
  // Rows past offsets[L]: untouched.
  for (int64_t row = in.rows; row < in.max_rows; ++row) {
    for (int64_t j = 0; j < c.n; ++j) {
      if (c.fused) {
        ASSERT_EQ(got.act[row * c.n + j], 0x5a) << "row " << row << " past the experts written";
      } else {
        ASSERT_EQ(got.y[row * c.n + j], 0x7fc1) << "row " << row << " past the experts written";
      }
    }
    for (int64_t b = 0; c.fused && b < nb; ++b) {
      ASSERT_EQ(got.act_sc[b * in.max_rows + row], -12345.0f) << "scale of row " << row;
    }
  }
}

const std::vector<int32_t> kEdgeRows = {0, 1, 64, 65, 130, 0, 300};

TEST(Fp8GroupedGemm, PlainExactEqualsTheReferenceBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({kEdgeRows, 256, 384, false, true}, /*passes=*/2);
}
TEST(Fp8GroupedGemm, FusedSwiGluExactCodesAndScalesBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({kEdgeRows, 384, 256, true, true}, /*passes=*/2);
}
// 256-row tiles (four m64 sub-tiles, two per consumer warpgroup): experts
// of 1, 255, 256, 257 (cut evenly: m-tiles of 192 and 65 rows), 321 (192,
// 129) and 513 (192, 192, 129) rows; forced, then picked by the launch (>= 192
// rows per expert).
const std::vector<int32_t> kTallRows = {1, 255, 0, 256, 257, 321, 513, 64};

TEST(Fp8GroupedGemm, TallTilesPlainExactBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({kTallRows, 256, 384, false, true, 256}, /*passes=*/2);
  RunGemmCase({kTallRows, 128, 256, false, true, 0});
}
TEST(Fp8GroupedGemm, TallTilesFusedExactBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({kTallRows, 384, 256, true, true, 256}, /*passes=*/2);
  RunGemmCase({kTallRows, 256, 256, true, true, 0});
}
TEST(Fp8GroupedGemm, TallTilesRandomWithinTheRounding) {
  REQUIRE_HOPPER();
  RunGemmCase({kTallRows, 256, 512, false, false, 256});
  RunGemmCase({kTallRows, 256, 512, true, false, 256});
}
TEST(Fp8GroupedGemm, PlainRandomWithinTheBlockRounding) {
  REQUIRE_HOPPER();
  RunGemmCase({kEdgeRows, 256, 512, false, false});
}
TEST(Fp8GroupedGemm, FusedSwiGluRandomWithinE4m3Rounding) {
  REQUIRE_HOPPER();
  RunGemmCase({kEdgeRows, 256, 512, true, false});
}
TEST(Fp8GroupedGemm, AllExpertsEmptyWritesNothing) {
  REQUIRE_HOPPER();
  RunGemmCase({{0, 0, 0}, 128, 128, true, true});
  RunGemmCase({{0, 0, 0}, 128, 128, false, true});
}
// More tiles than SMs: the persistent walk and the ring's phases wrap many
// times (fused tiles run two passes over K each); one expert of 200 rows
// keeps both consumer warpgroups busy in some tiles.
std::vector<int32_t> ManyTileRows() {
  std::vector<int32_t> rows(40, 9);
  rows[3] = 0;
  rows[7] = 200;
  return rows;
}
TEST(Fp8GroupedGemm, ManyTilesFusedRepeatBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({ManyTileRows(), 1024, 256, true, true}, /*passes=*/2);
}
TEST(Fp8GroupedGemm, ManyTilesPlainRepeatBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({ManyTileRows(), 1024, 256, false, true}, /*passes=*/2);
}
// 128-row tiles run in 2-CTA clusters by default where N / 128 is even (the
// cases above with N 256 and 1024); the same cases one CTA a tile, and the
// clusters forced where N / 128 is odd (no pairs: one CTA a tile).
TEST(Fp8GroupedGemm, ManyTilesOneCtaPerTileRepeatBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({ManyTileRows(), 1024, 256, true, true, 128, 1}, /*passes=*/2);
  RunGemmCase({ManyTileRows(), 1024, 384, false, true, 128, 1}, /*passes=*/2);
  RunGemmCase({kEdgeRows, 384, 256, false, false, 128, 2});
}
TEST(Fp8GroupedGemm, ClusterPairsRandomWithinTheRounding) {
  REQUIRE_HOPPER();
  RunGemmCase({kTallRows, 256, 640, false, false, 128, 2});
  RunGemmCase({kTallRows, 512, 384, true, false, 128, 2});
}

// 256-row tiles in A-sharing pairs (cluster 2, issue 35): exact against the
// CPU reference (several m-tiles an expert, edge rows, both kernels).
TEST(Fp8GroupedGemm, TallClusterPairsExactBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({kTallRows, 256, 384, false, true, 256, 2}, /*passes=*/2);
  RunGemmCase({kTallRows, 512, 256, true, true, 256, 2}, /*passes=*/2);
  RunGemmCase({kEdgeRows, 256, 256, false, true, 256, 2}, /*passes=*/2);
}

// Variants against the default mode (cluster 0, l2_hint 0, the same tile
// height) on the same inputs: the same products in the same order, so
// every output byte agrees, the sentinels of rows past offsets[L] included;
// the variant runs twice (repeats bit for bit). No fp64 reference: random
// values at any size stay cheap.
void ExpectTheDefaultsBits(const GemmCase& variant, uint64_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "N " << variant.n << " K " << variant.k << (variant.fused ? " fused" : " plain")
               << " tile_rows " << variant.tile_rows << " cluster " << variant.cluster
               << " l2_hint " << variant.l2_hint << " seed " << seed);
  const Inputs in = MakeCase(variant, seed);
  GemmCase base = variant;
  base.cluster = 0;
  base.l2_hint = 0;
  const GpuRun want = RunOnGpu(base, in, 1);
  const GpuRun got = RunOnGpu(variant, in, 2);
  auto expect_same = [](const auto& g, const auto& w, const char* what, int64_t n) {
    ASSERT_EQ(g.size(), w.size()) << what;
    int64_t bad = 0;
    for (size_t i = 0; i < g.size(); ++i) {
      if (g[i] != w[i] && ++bad <= 5) {
        ADD_FAILURE() << what << "[" << static_cast<int64_t>(i) / n << ", "
                      << static_cast<int64_t>(i) % n << "] differs from the default mode's";
      }
    }
    EXPECT_EQ(bad, 0) << what;
  };
  expect_same(got.y, want.y, "y", variant.n);
  expect_same(got.act, want.act, "act", variant.n);
  // act_sc is [N / 128, max_rows]: (block, row).
  expect_same(got.act_sc, want.act_sc, "act_scale", in.max_rows);
}

// Uneven experts: empty ones, 1 row, 64/65 (the second m64 half), 129, 257,
// 513 and 600 (> 512: several m-tiles of either height, an odd count rounded
// up to even pairs with cluster 3), and seeded random counts up to 300,
// shuffled.
std::vector<int32_t> UnevenRows(uint64_t seed) {
  Rng rng(seed);
  std::vector<int32_t> rows = {0, 1, 64, 65, 129, 0, 257, 513, 600};
  for (int i = 0; i < 7; ++i) rows.push_back(rng.Int(0, 300));
  for (int i = static_cast<int>(rows.size()) - 1; i > 0; --i)
    std::swap(rows[i], rows[rng.Int(0, i)]);
  return rows;
}

TEST(Fp8GroupedGemm, L2HintsEqualTheDefaultBitForBit) {
  REQUIRE_HOPPER();
  for (int hint = 1; hint <= 3; ++hint) {
    for (int tile_rows : {128, 256}) {
      for (bool fused : {false, true}) {
        ExpectTheDefaultsBits({UnevenRows(hint), 384, 256, fused, false, tile_rows, 0, hint},
                              10 + hint);
      }
    }
  }
}
// The hinted multicast copies: A shared over n-tile pairs (cluster 2),
// B over m-tile pairs (cluster 3).
TEST(Fp8GroupedGemm, L2HintsInClustersEqualTheDefaultBitForBit) {
  REQUIRE_HOPPER();
  for (int hint = 1; hint <= 3; ++hint) {
    ExpectTheDefaultsBits({UnevenRows(4), 512, 256, hint == 2, false, 128, 2, hint}, 20 + hint);
    ExpectTheDefaultsBits({UnevenRows(5), 384, 256, hint != 2, false, 128, 3, hint}, 30 + hint);
    ExpectTheDefaultsBits({UnevenRows(6), 256, 384, hint == 3, false, 256, 3, hint}, 40 + hint);
  }
}
TEST(Fp8GroupedGemm, BSharingPairsEqualTheDefaultBitForBit) {
  REQUIRE_HOPPER();
  for (uint64_t seed : {1, 2, 3}) {
    for (int tile_rows : {128, 256}) {
      for (bool fused : {false, true}) {
        ExpectTheDefaultsBits({UnevenRows(seed), 384, 384, fused, false, tile_rows, 3}, seed);
      }
    }
  }
}
// 256-row A-sharing pairs against one CTA a tile, uneven experts and more
// units than resident clusters (the walk wraps), both kernels.
TEST(Fp8GroupedGemm, TallAPairsEqualTheDefaultBitForBit) {
  REQUIRE_HOPPER();
  for (uint64_t seed : {1, 2}) {
    for (bool fused : {false, true}) {
      ExpectTheDefaultsBits({UnevenRows(seed), 512, 384, fused, false, 256, 2}, 50 + seed);
    }
  }
  ExpectTheDefaultsBits({ManyTileRows(), 1024, 256, true, false, 256, 2}, 60);
  ExpectTheDefaultsBits({ManyTileRows(), 1024, 384, false, false, 256, 2}, 61);
}
// More pair units than resident clusters: the walk and the ring's phases
// wrap many times, experts of 9 rows leave every pair's second CTA empty
// (it still loads its B half for the first).
TEST(Fp8GroupedGemm, ManyBSharingPairsEqualTheDefaultBitForBit) {
  REQUIRE_HOPPER();
  for (int tile_rows : {128, 256}) {
    ExpectTheDefaultsBits({ManyTileRows(), 1024, 256, true, false, tile_rows, 3}, 7);
    ExpectTheDefaultsBits({ManyTileRows(), 1024, 384, false, false, tile_rows, 3}, 8);
  }
}
// Against the CPU reference, exact: small-integer codes make every sum
// exact, so each output is known without the GPU's order.
TEST(Fp8GroupedGemm, BSharingPairsExactBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({kEdgeRows, 256, 384, false, true, 128, 3}, /*passes=*/2);
  RunGemmCase({kEdgeRows, 384, 256, true, true, 128, 3}, /*passes=*/2);
  RunGemmCase({kTallRows, 256, 384, false, true, 256, 3}, /*passes=*/2);
  RunGemmCase({kTallRows, 384, 256, true, true, 256, 3}, /*passes=*/2);
}
TEST(Fp8GroupedGemm, L2HintsExactBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({kEdgeRows, 256, 384, false, true, 128, 0, 1});
  RunGemmCase({kTallRows, 384, 256, true, true, 256, 0, 2});
  RunGemmCase({kEdgeRows, 384, 256, true, true, 128, 3, 3});
}

TEST(Fp8GroupedGemm, ManyTallTilesFusedRepeatBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({ManyTileRows(), 1024, 256, true, true, 256}, /*passes=*/2);
}
TEST(Fp8GroupedGemm, ManyTallTilesPlainRepeatBitForBit) {
  REQUIRE_HOPPER();
  RunGemmCase({ManyTileRows(), 1024, 256, false, true, 256}, /*passes=*/2);
}

// Every (H, I) of the fp8 model configs (quantization_config fp8) at real
// size, both GEMMs (gate_up: K = H, N = I; down: K = I, N = H), two experts
// (the first empty), random values.
TEST(Fp8GroupedGemm, EveryFp8ModelConfigShape) {
  REQUIRE_HOPPER();
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  const std::string dir =
      std::string(env != nullptr && *env != '\0' ? env : MOE_EP_DATA_DIR) + "/models";
  if (!std::filesystem::is_directory(dir)) GTEST_SKIP() << "model configs not found at " << dir;
  // The fp8 families' (H, I) as published (DeepSeek-V3/R1, Kimi-K2: 7168,
  // 2048; MiniMax-M2.5: 3072, 1536), checked against the configs.
  const std::set<std::pair<int64_t, int64_t>> fp8_shapes = {{7168, 2048}, {3072, 1536}};
  std::set<std::pair<int64_t, int64_t>> seen;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    absl::StatusOr<core::ModelDescription> m = core::LoadModelConfig(entry.path().string());
    ASSERT_TRUE(m.ok()) << entry.path() << ": " << m.status();
    if (fp8_shapes.count({m->hidden_size, m->moe_intermediate_size}) != 0) {
      seen.insert({m->hidden_size, m->moe_intermediate_size});
    }
  }
  ASSERT_EQ(seen, fp8_shapes);
  for (const auto& [h, i] : fp8_shapes) {
    SCOPED_TRACE(::testing::Message() << "H " << h << " I " << i);
    RunGemmCase({{0, 3}, i, h, true, false});
    RunGemmCase({{0, 2}, h, i, false, false});
    RunGemmCase({{0, 3}, i, h, true, false, 256});
  }
}

// Captured once in a CUDA graph, replayed with other per-expert counts
// written to the same device offsets: each replay equals the exact reference.
TEST(Fp8GroupedGemm, GraphReplayReadsCountsOnDevice) {
  REQUIRE_HOPPER();
  const GemmCase c{{100, 100, 100}, 128, 256, false, true};
  const Inputs in = MakeCase(c, 9);  // max_rows 337
  std::vector<float> a_scale((c.k / 128) * in.max_rows);
  for (int64_t r = 0; r < in.max_rows; ++r) {
    for (int64_t b = 0; b < c.k / 128; ++b) {
      a_scale[b * in.max_rows + r] = in.a.scales[r * (c.k / 128) + b];
    }
  }
  std::vector<uint8_t> b_codes;
  std::vector<float> b_scale;
  for (const Fp8BlockMatrix& m : in.w) {
    b_codes.insert(b_codes.end(), m.codes.begin(), m.codes.end());
    b_scale.insert(b_scale.end(), m.scale_inv.begin(), m.scale_inv.end());
  }
  DeviceBuffer<uint8_t> da(in.a.codes), db(b_codes);
  DeviceBuffer<float> das(a_scale), dbs(b_scale);
  DeviceBuffer<int32_t> doff(4);
  DeviceBuffer<uint16_t> y(in.max_rows * c.n);
  Fp8GemmParams p;
  p.a = da.get();
  p.a_scale = das.get();
  p.a_scale_stride = in.max_rows;
  p.max_rows = in.max_rows;
  p.b = db.get();
  p.b_scale = dbs.get();
  p.offsets = doff.get();
  p.num_local_experts = 3;
  p.n = c.n;
  p.k = c.k;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status s = LaunchFp8GroupedGemm(p, y.get(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(s.ok()) << s;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const std::vector<int32_t>& offsets :
       {std::vector<int32_t>{0, 5, 5, 300}, std::vector<int32_t>{0, 129, 200, 337}}) {
    doff.Upload(offsets);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const std::vector<uint16_t> got = y.Download(in.max_rows * c.n);
    int64_t bad = 0;
    for (int l = 0; l < 3; ++l) {
      if (offsets[l] == offsets[l + 1]) continue;
      const Fp8Activations a = Slice(in.a, offsets[l], offsets[l + 1]);
      std::vector<float> want(a.rows * c.n);
      ASSERT_TRUE(core::quant::Fp8BlockGemm(a, in.w[l], absl::MakeSpan(want)).ok());
      for (int64_t i = 0; i < a.rows * c.n; ++i) {
        bad += got[offsets[l] * c.n + i] != core::FloatToBf16(want[i]);
      }
    }
    EXPECT_EQ(bad, 0) << "offsets " << offsets[1] << ", " << offsets[2] << ", " << offsets[3];
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(Fp8GroupedGemm, RejectsShapesOffTheScaleBlock) {
  REQUIRE_HOPPER();
  DeviceBuffer<uint8_t> a(256 * 256), b(256 * 256);
  DeviceBuffer<float> s(256 * 4);
  DeviceBuffer<int32_t> off(std::vector<int32_t>{0, 4});
  DeviceBuffer<uint16_t> y(256 * 256);
  Fp8GemmParams p;
  p.a = a.get();
  p.a_scale = s.get();
  p.a_scale_stride = 4;
  p.max_rows = 4;
  p.b = b.get();
  p.b_scale = s.get();
  p.offsets = off.get();
  p.num_local_experts = 1;
  p.n = 128;
  p.k = 192;
  absl::Status st = LaunchFp8GroupedGemm(p, y.get(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("multiples of the 128-wide scale block"), std::string::npos) << st;
  p.k = 128;
  p.a_scale_stride = 3;
  st = LaunchFp8GroupedGemm(p, y.get(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("a_scale_stride expected >= max_rows 4, got 3"), std::string::npos)
      << st;
  p.a_scale_stride = 4;
  p.cluster = 4;
  st = LaunchFp8GroupedGemm(p, y.get(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("cluster expected 0 .. 3, got 4"), std::string::npos) << st;
  p.cluster = 3;
  p.l2_hint = 4;
  st = LaunchFp8GroupedGemm(p, y.get(), nullptr);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("l2_hint expected 0 .. 3, got 4"), std::string::npos) << st;
}

}  // namespace
}  // namespace fp8_grouped_gemm_test
}  // namespace moe_ep::kernels
