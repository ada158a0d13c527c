#include "kernels/grouped_gemm.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/bf16.h"
#include "tests/kernels/gpu_test_util.h"

// Grouped expert GEMMs with device-side row counts vs a naive fp64 CPU
// product of the same bf16 inputs. Expert row counts include 0, partial tiles
// and several tiles; N and K include tails (N % 64 != 0, K % 8 != 0 takes
// the scalar load path). Tolerance: fp32 accumulation of K bf16 products
// differs from fp64 by well under 1e-3 relative to sum |a*b| here.

namespace moe_ep::kernels {
namespace grouped_gemm_test {
namespace {

using core::bf16_t;
using testing::DeviceBuffer;

struct GemmCase {
  std::vector<int32_t> rows_per_expert;
  int64_t n;
  int64_t k;
  bool fused;
};

void RunGemmCase(const GemmCase& c) {
  MOE_EP_REQUIRE_GPUS(1);
  const int num_local = static_cast<int>(c.rows_per_expert.size());
  std::vector<int32_t> offsets(num_local + 1, 0);
  for (int l = 0; l < num_local; ++l) offsets[l + 1] = offsets[l] + c.rows_per_expert[l];
  const int64_t rows = offsets[num_local];
  const int64_t max_rows = rows + 37;  // the grid bound exceeds the rows used
  const int64_t b_rows = c.fused ? 2 * c.n : c.n;
  std::mt19937_64 rng(42);
  std::uniform_real_distribution<float> v(-1.0f, 1.0f);
  std::vector<bf16_t> a(max_rows * c.k), b(num_local * b_rows * c.k);
  for (auto& x : a) x = core::FloatToBf16(v(rng));
  for (auto& x : b) x = core::FloatToBf16(v(rng) * 0.25f);
  DeviceBuffer<bf16_t> da(a), db(b);
  DeviceBuffer<int32_t> doff(offsets), dtiles(num_local + 1);
  ASSERT_TRUE(LaunchExpertTileOffsets(doff.get(), num_local, dtiles.get(), nullptr).ok());
  GroupedGemmParams p;
  p.a = da.get();
  p.max_rows = max_rows;
  p.b = db.get();
  p.offsets = doff.get();
  p.tile_offsets = dtiles.get();
  p.num_local_experts = num_local;
  p.n = c.n;
  p.k = c.k;
  // Sentinel-filled outputs: rows past offsets[L] must stay untouched.
  std::vector<bf16_t> act_init(max_rows * c.n, 0x7fc1);
  std::vector<float> y_init(max_rows * c.n, -12345.0f);
  DeviceBuffer<bf16_t> act(act_init);
  DeviceBuffer<float> y(y_init);
  absl::Status s =
      c.fused ? LaunchGroupedSwiGlu(p, act.get(), nullptr) : LaunchGroupedGemm(p, y.get(), nullptr);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto tiles = dtiles.Download(num_local + 1);
  int32_t want_tiles = 0;
  for (int l = 0; l < num_local; ++l) {
    EXPECT_EQ(tiles[l], want_tiles) << "expert " << l;
    want_tiles += (c.rows_per_expert[l] + kGroupedGemmTileRows - 1) / kGroupedGemmTileRows;
  }
  EXPECT_EQ(tiles[num_local], want_tiles);
  const auto got_act = act.Download(max_rows * c.n);
  const auto got_y = y.Download(max_rows * c.n);
  int64_t bad = 0;
  for (int l = 0; l < num_local; ++l) {
    for (int64_t i = offsets[l]; i < offsets[l + 1]; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        double g = 0, u = 0, mag_g = 0, mag_u = 0;
        for (int64_t kk = 0; kk < c.k; ++kk) {
          const double x = core::Bf16ToFloat(a[i * c.k + kk]);
          const double wg = core::Bf16ToFloat(b[(l * b_rows + j) * c.k + kk]);
          g += x * wg;
          mag_g += std::abs(x * wg);
          if (c.fused) {
            const double wu = core::Bf16ToFloat(b[(l * b_rows + c.n + j) * c.k + kk]);
            u += x * wu;
            mag_u += std::abs(x * wu);
          }
        }
        if (c.fused) {
          const double want = g / (1.0 + std::exp(-g)) * u;
          const double got = core::Bf16ToFloat(got_act[i * c.n + j]);
          // bf16 output rounding (2^-8 relative) plus fp32 accumulation.
          const double tol = std::abs(want) / 128 + 1e-3 * (mag_g * std::abs(u) + mag_u);
          if (!(std::abs(got - want) <= tol) && ++bad <= 5) {
            ADD_FAILURE() << "act[" << i << ", " << j << "] got " << got << " want " << want;
          }
        } else {
          const double got = got_y[i * c.n + j];
          if (!(std::abs(got - g) <= 1e-4 * mag_g + 1e-6) && ++bad <= 5) {
            ADD_FAILURE() << "y[" << i << ", " << j << "] got " << got << " want " << g;
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
  for (int64_t i = rows; i < max_rows; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      if (c.fused) {
        ASSERT_EQ(got_act[i * c.n + j], 0x7fc1) << "row " << i << " past the experts written";
      } else {
        ASSERT_EQ(got_y[i * c.n + j], -12345.0f) << "row " << i << " past the experts written";
      }
    }
  }
}

TEST(GroupedGemm, PlainWithEmptyAndMultiTileExperts) {
  RunGemmCase({{0, 5, 64, 130, 0, 1}, 96, 128, false});
}
TEST(GroupedGemm, PlainScalarTailK) { RunGemmCase({{3, 70, 0}, 64, 36, false}); }
TEST(GroupedGemm, FusedSwiGlu) { RunGemmCase({{17, 0, 65, 2}, 72, 256, true}); }
TEST(GroupedGemm, FusedSwiGluSingleRow) { RunGemmCase({{1}, 32, 64, true}); }
TEST(GroupedGemm, AllExpertsEmptyWritesNothing) { RunGemmCase({{0, 0, 0}, 64, 64, true}); }

TEST(GroupedGemm, RejectsBadArguments) {
  MOE_EP_REQUIRE_GPUS(1);
  GroupedGemmParams p;
  float* y = nullptr;
  EXPECT_EQ(LaunchGroupedGemm(p, y, nullptr).code(), absl::StatusCode::kInvalidArgument);
  DeviceBuffer<int32_t> off(std::vector<int32_t>{0, 0});
  DeviceBuffer<bf16_t> ab(64);
  DeviceBuffer<float> out(64);
  p.a = ab.get();
  p.b = ab.get();
  p.offsets = off.get();
  p.tile_offsets = off.get();
  p.num_local_experts = 1;
  p.max_rows = 1;
  p.n = 0;
  p.k = 8;
  EXPECT_EQ(LaunchGroupedGemm(p, out.get(), nullptr).code(), absl::StatusCode::kInvalidArgument);
  p.n = 8;
  p.num_local_experts = 0;
  EXPECT_EQ(LaunchGroupedSwiGlu(p, ab.get(), nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LaunchExpertTileOffsets(off.get(), 0, off.get(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace grouped_gemm_test
}  // namespace moe_ep::kernels
