#include "kernels/hopper_grouped_gemm.cuh"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/bf16.h"
#include "core/model_config.h"
#include "tests/kernels/gpu_test_util.h"

// Hopper grouped expert GEMMs (issue 14) vs a naive fp64 CPU product of the
// same bf16 inputs. Row counts include empty experts, one row, partial and
// many 128-row tiles and experts whose rows stop inside the second 64-row
// half; N and K include tails (N % 128 != 0, K % 64 != 0); every (H, I) pair
// of ../shared/data/models runs both GEMMs at its real size. Outputs start as
// sentinels: rows past offsets[L] must stay untouched. Tolerance as
// tests/kernels/grouped_gemm_test.cc (fp32 accumulation vs fp64).

namespace moe_ep::kernels {
namespace hopper_grouped_gemm_test {
namespace {

using core::bf16_t;
using testing::DeviceBuffer;

#define REQUIRE_HOPPER()                                                    \
  MOE_EP_REQUIRE_GPUS(1);                                                   \
  if (absl::Status hopper_ = HopperGroupedGemmAvailable(); !hopper_.ok()) { \
    GTEST_SKIP() << hopper_;                                                \
  }

// Cheap deterministic bf16 values in [-scale, scale) (xorshift; the sizes
// here reach 4e8 weights).
std::vector<bf16_t> RandomBf16(size_t count, uint64_t seed, float scale) {
  std::vector<bf16_t> out(count);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float u = static_cast<float>(x >> 40) / static_cast<float>(1 << 24);  // [0, 1)
    v = core::FloatToBf16((2.0f * u - 1.0f) * scale);
  }
  return out;
}

struct GemmCase {
  std::vector<int32_t> rows_per_expert;
  int64_t n;
  int64_t k;
  bool fused;
};

struct GemmRun {
  std::vector<bf16_t> act;
  std::vector<float> y;
};

// Runs one case on the GPU (twice when `repeat`, returning the second run's
// output after checking the two are bit-identical).
GemmRun RunOnGpu(const GemmCase& c, const std::vector<int32_t>& offsets, int64_t max_rows,
                 const std::vector<bf16_t>& a, const std::vector<bf16_t>& b, bool repeat) {
  const int num_local = static_cast<int>(c.rows_per_expert.size());
  DeviceBuffer<bf16_t> da(a), db(b);
  DeviceBuffer<int32_t> doff(offsets);
  HopperGemmParams p;
  p.a = da.get();
  p.max_rows = max_rows;
  p.b = db.get();
  p.offsets = doff.get();
  p.num_local_experts = num_local;
  p.n = c.n;
  p.k = c.k;
  GemmRun first;
  for (int pass = 0; pass < (repeat ? 2 : 1); ++pass) {
    DeviceBuffer<bf16_t> act(std::vector<bf16_t>(c.fused ? max_rows * c.n : 0, 0x7fc1));
    DeviceBuffer<float> y(std::vector<float>(c.fused ? 0 : max_rows * c.n, -12345.0f));
    const absl::Status s = c.fused ? LaunchHopperGroupedSwiGlu(p, act.get(), nullptr)
                                   : LaunchHopperGroupedGemm(p, y.get(), nullptr);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    GemmRun run;
    if (c.fused) run.act = act.Download(max_rows * c.n);
    if (!c.fused) run.y = y.Download(max_rows * c.n);
    if (pass == 1) {
      EXPECT_TRUE(run.act == first.act && run.y == first.y) << "results differ between runs";
    }
    first = std::move(run);
  }
  return first;
}

void RunGemmCase(const GemmCase& c, bool repeat = false) {
  const int num_local = static_cast<int>(c.rows_per_expert.size());
  std::vector<int32_t> offsets(num_local + 1, 0);
  for (int l = 0; l < num_local; ++l) offsets[l + 1] = offsets[l] + c.rows_per_expert[l];
  const int64_t rows = offsets[num_local];
  const int64_t max_rows = rows + 37;  // the tile walk's bound exceeds the rows used
  const int64_t b_rows = c.fused ? 2 * c.n : c.n;
  const std::vector<bf16_t> a = RandomBf16(max_rows * c.k, c.n * 7 + c.k, 1.0f);
  const std::vector<bf16_t> b = RandomBf16(num_local * b_rows * c.k, c.n + c.k * 3, 0.25f);
  const GemmRun got = RunOnGpu(c, offsets, max_rows, a, b, repeat);
  int64_t bad = 0;
  std::vector<double> xa(c.k);
  for (int l = 0; l < num_local; ++l) {
    for (int64_t i = offsets[l]; i < offsets[l + 1]; ++i) {
      for (int64_t kk = 0; kk < c.k; ++kk) xa[kk] = core::Bf16ToFloat(a[i * c.k + kk]);
      for (int64_t j = 0; j < c.n; ++j) {
        double g = 0, u = 0, mag_g = 0, mag_u = 0;
        const bf16_t* wg = &b[(l * b_rows + j) * c.k];
        const bf16_t* wu = &b[(l * b_rows + c.n + j) * c.k];
        for (int64_t kk = 0; kk < c.k; ++kk) {
          const double pg = xa[kk] * core::Bf16ToFloat(wg[kk]);
          g += pg;
          mag_g += std::abs(pg);
          if (c.fused) {
            const double pu = xa[kk] * core::Bf16ToFloat(wu[kk]);
            u += pu;
            mag_u += std::abs(pu);
          }
        }
        if (c.fused) {
          const double want = g / (1.0 + std::exp(-g)) * u;
          const double v = core::Bf16ToFloat(got.act[i * c.n + j]);
          const double tol = std::abs(want) / 128 + 1e-3 * (mag_g * std::abs(u) + mag_u);
          if (!(std::abs(v - want) <= tol) && ++bad <= 5) {
            ADD_FAILURE() << "act[" << i << ", " << j << "] got " << v << " want " << want;
          }
        } else {
          const double v = got.y[i * c.n + j];
          if (!(std::abs(v - g) <= 1e-4 * mag_g + 1e-6) && ++bad <= 5) {
            ADD_FAILURE() << "y[" << i << ", " << j << "] got " << v << " want " << g;
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0);
  for (int64_t i = rows; i < max_rows; ++i) {
    for (int64_t j = 0; j < c.n; ++j) {
      if (c.fused) {
        ASSERT_EQ(got.act[i * c.n + j], 0x7fc1) << "row " << i << " past the experts written";
      } else {
        ASSERT_EQ(got.y[i * c.n + j], -12345.0f) << "row " << i << " past the experts written";
      }
    }
  }
}

TEST(HopperGroupedGemm, PlainEmptyPartialAndManyTiles) {
  REQUIRE_HOPPER();
  RunGemmCase({{0, 5, 64, 65, 130, 0, 1, 300}, 320, 192, false});
}
TEST(HopperGroupedGemm, PlainKTailAndNTail) {
  REQUIRE_HOPPER();
  RunGemmCase({{3, 129, 0}, 200, 72, false});
}
TEST(HopperGroupedGemm, FusedSwiGluEmptyPartialAndManyTiles) {
  REQUIRE_HOPPER();
  RunGemmCase({{17, 0, 65, 2, 128, 257}, 136, 256, true});
}
TEST(HopperGroupedGemm, FusedSwiGluSingleRow) {
  REQUIRE_HOPPER();
  RunGemmCase({{1}, 32, 64, true});
}
TEST(HopperGroupedGemm, AllExpertsEmptyWritesNothing) {
  REQUIRE_HOPPER();
  RunGemmCase({{0, 0, 0}, 128, 64, true});
}
// At >= 192 rows per expert on average the launch takes the tall tiles (up
// to 320 rows, five m64 sub-tiles dealt to the two consumer warpgroups
// alternately): experts of 0, 1, 255, 257 and 513 rows give tiles of 1, 4,
// 5 and two of 320 and 193 rows.
TEST(HopperGroupedGemm, TallTilesFusedAndPlain) {
  REQUIRE_HOPPER();
  RunGemmCase({{0, 1, 255, 257, 513}, 136, 256, true}, /*repeat=*/true);
  RunGemmCase({{0, 1, 255, 257, 513}, 200, 136, false}, /*repeat=*/true);
}
// Tall tiles at their edges: 320 rows (one full tile), 321 (192 and 129),
// 384 (two of 192), 64 and 65 (one and two sub-tiles), 1153 (three of 320
// and 193).
TEST(HopperGroupedGemm, TallTilesSplitExpertsEvenly) {
  REQUIRE_HOPPER();
  RunGemmCase({{320, 321, 384, 64, 65, 1153}, 72, 192, true}, /*repeat=*/true);
  RunGemmCase({{320, 321, 384, 64, 65, 1153}, 136, 128, false}, /*repeat=*/true);
}
// 496 experts of 200 rows: the tall tiles' m-tile prefix would not fit in
// shared memory, so the launch keeps the wide tiles; results as ever.
TEST(HopperGroupedGemm, ManyExpertsAtPrefillKeepWideTiles) {
  REQUIRE_HOPPER();
  RunGemmCase({std::vector<int32_t>(496, 200), 24, 64, true});
  RunGemmCase({std::vector<int32_t>(496, 200), 40, 32, false});
}
// More tiles than SMs: the persistent walk's stride and the ring's phases
// wrap many times; two runs must agree bit for bit.
TEST(HopperGroupedGemm, ManyTilesRepeatBitForBit) {
  REQUIRE_HOPPER();
  std::vector<int32_t> rows(40, 9);
  rows[3] = 0;
  rows[7] = 200;
  RunGemmCase({rows, 512, 320, true}, /*repeat=*/true);
  RunGemmCase({rows, 768, 256, false}, /*repeat=*/true);
}

// Every (H, I) pair of the model configs, both GEMMs at their real size
// (gate_up: K = H, N = I; down: K = I, N = H), two experts (the first empty).
TEST(HopperGroupedGemm, EveryModelConfigShape) {
  REQUIRE_HOPPER();
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  const std::string dir =
      std::string(env != nullptr && *env != '\0' ? env : MOE_EP_DATA_DIR) + "/models";
  if (!std::filesystem::is_directory(dir)) GTEST_SKIP() << "model configs not found at " << dir;
  std::set<std::pair<int64_t, int64_t>> shapes;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    absl::StatusOr<core::ModelDescription> m = core::LoadModelConfig(entry.path().string());
    ASSERT_TRUE(m.ok()) << entry.path() << ": " << m.status();
    shapes.insert({m->hidden_size, m->moe_intermediate_size});
  }
  ASSERT_GE(shapes.size(), 8u);
  for (const auto& [h, i] : shapes) {
    SCOPED_TRACE(::testing::Message() << "H " << h << " I " << i);
    RunGemmCase({{0, 3}, i, h, true});
    RunGemmCase({{0, 2}, h, i, false});
  }
}

// Captured once in a CUDA graph, replayed with other per-expert counts
// written to the same device offsets: each replay matches the reference.
TEST(HopperGroupedGemm, GraphReplayReadsCountsOnDevice) {
  REQUIRE_HOPPER();
  const int64_t n = 192, k = 128, max_rows = 300;
  const int num_local = 3;
  const std::vector<bf16_t> a = RandomBf16(max_rows * k, 5, 1.0f);
  const std::vector<bf16_t> b = RandomBf16(num_local * 2 * n * k, 6, 0.25f);
  DeviceBuffer<bf16_t> da(a), db(b), act(max_rows * n);
  DeviceBuffer<int32_t> doff(num_local + 1);
  HopperGemmParams p;
  p.a = da.get();
  p.max_rows = max_rows;
  p.b = db.get();
  p.offsets = doff.get();
  p.num_local_experts = num_local;
  p.n = n;
  p.k = k;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status s = LaunchHopperGroupedSwiGlu(p, act.get(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_TRUE(s.ok()) << s;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const std::vector<int32_t>& offsets :
       {std::vector<int32_t>{0, 5, 5, 140}, std::vector<int32_t>{0, 0, 299, 300}}) {
    doff.Upload(offsets);
    act.Upload(std::vector<bf16_t>(max_rows * n, 0x7fc1));
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto got = act.Download(max_rows * n);
    int64_t bad = 0;
    for (int l = 0; l < num_local; ++l) {
      for (int64_t r = offsets[l]; r < offsets[l + 1]; ++r) {
        for (int64_t j = 0; j < n; ++j) {
          double g = 0, u = 0;
          for (int64_t kk = 0; kk < k; ++kk) {
            const double x = core::Bf16ToFloat(a[r * k + kk]);
            g += x * core::Bf16ToFloat(b[(l * 2 * n + j) * k + kk]);
            u += x * core::Bf16ToFloat(b[(l * 2 * n + n + j) * k + kk]);
          }
          const double want = g / (1.0 + std::exp(-g)) * u;
          const double v = core::Bf16ToFloat(got[r * n + j]);
          if (!(std::abs(v - want) <= std::abs(want) / 128 + 2e-3) && ++bad <= 5) {
            ADD_FAILURE() << "act[" << r << ", " << j << "] got " << v << " want " << want;
          }
        }
      }
    }
    EXPECT_EQ(bad, 0);
    for (int64_t r = offsets[num_local]; r < max_rows; ++r) {
      ASSERT_EQ(got[r * n], 0x7fc1) << "row " << r << " past the experts written";
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(HopperGroupedGemm, RejectsBadArguments) {
  MOE_EP_REQUIRE_GPUS(1);
  HopperGemmParams p;
  EXPECT_EQ(LaunchHopperGroupedGemm(p, nullptr, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  DeviceBuffer<int32_t> off(std::vector<int32_t>{0, 0});
  DeviceBuffer<bf16_t> ab(256);
  DeviceBuffer<float> out(256);
  p.a = ab.get();
  p.b = ab.get();
  p.offsets = off.get();
  p.num_local_experts = 1;
  p.max_rows = 1;
  p.n = 8;
  p.k = 12;  // not a multiple of 8
  EXPECT_EQ(LaunchHopperGroupedGemm(p, out.get(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  p.k = 16;
  p.num_local_experts = kHopperGemmMaxExperts + 1;
  EXPECT_EQ(LaunchHopperGroupedSwiGlu(p, ab.get(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  p.num_local_experts = 1;
  p.a = ab.get() + 1;  // 2-byte aligned only
  EXPECT_EQ(LaunchHopperGroupedGemm(p, out.get(), nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace hopper_grouped_gemm_test
}  // namespace moe_ep::kernels
