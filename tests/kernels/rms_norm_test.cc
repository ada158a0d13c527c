#include "kernels/rms_norm.cuh"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/rms_norm.h"
#include "kernels/nccl_collective.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace rms_norm_test {
namespace {

using testing::DeviceBuffer;

// The kernels accumulate the sum of squares as a tree over the block, the CPU
// in ascending column order: outputs of unit scale agree to fp32 rounding.
// |gpu - cpu| <= kAbsTol + kRelTol * |cpu|.
constexpr float kAbsTol = 2e-6f;
constexpr float kRelTol = 1e-5f;
constexpr float kEps = 1e-6f;

std::vector<float> Random(uint64_t seed, size_t n, float lo, float hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

core::RmsNorm MakeNorm(int64_t hidden, uint64_t seed) {
  auto norm = core::RmsNorm::Create(Random(seed, hidden, 0.5f, 1.5f), kEps);
  EXPECT_TRUE(norm.ok()) << norm.status();
  return *norm;
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 5; ++i) {
    if (!(std::fabs(got[i] - want[i]) <= kAbsTol + kRelTol * std::fabs(want[i]))) {
      ADD_FAILURE() << what << " element " << i << ": got " << got[i] << ", want " << want[i];
      ++bad;
    }
  }
}

// ---------------------------------------------------------------------------
// Host-side argument checks: no CUDA call is made, so these run without a GPU.

TEST(LaunchRmsNorm, RejectsBadArgumentsOnHost) {
  float* p = reinterpret_cast<float*>(16);  // never dereferenced: checks come first
  auto code = [](const absl::Status& s) { return s.code(); };
  EXPECT_EQ(code(LaunchRmsNorm(p, p, p, -1, 8, kEps, nullptr)), absl::StatusCode::kInvalidArgument);
  const absl::Status h = LaunchRmsNorm(p, p, p, 1, 0, kEps, nullptr);
  EXPECT_EQ(h.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(h.message().find("hidden"), std::string::npos) << h;
  const absl::Status e = LaunchRmsNorm(p, p, p, 1, 8, 0.0f, nullptr);
  EXPECT_EQ(e.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.message().find("eps"), std::string::npos) << e;
  EXPECT_EQ(code(LaunchRmsNorm(p, p, p, 1, 8, NAN, nullptr)), absl::StatusCode::kInvalidArgument);
  const absl::Status n = LaunchRmsNorm(nullptr, p, p, 1, 8, kEps, nullptr);
  EXPECT_EQ(n.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(n.message().find("null"), std::string::npos) << n;
  EXPECT_EQ(code(LaunchAddResidualRmsNorm(p, nullptr, p, 2, 8, kEps, nullptr)),
            absl::StatusCode::kInvalidArgument);
  const absl::Status alias = LaunchAddResidualRmsNorm(p, p, p, 2, 8, kEps, nullptr);
  EXPECT_EQ(alias.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(alias.message().find("different"), std::string::npos) << alias;
  EXPECT_EQ(code(LaunchStoreResidualRmsNorm(p, p, p, 2, 8, kEps, nullptr)),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(LaunchAddInPlace(p, p, -4, nullptr)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(LaunchAddInPlace(nullptr, p, 4, nullptr)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(LaunchSumChunks(p, 0, 4, p, nullptr)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(LaunchSumChunks(nullptr, 2, 4, p, nullptr)), absl::StatusCode::kInvalidArgument);
}

// Zero rows (a rank with zero tokens) enqueue nothing, even with null buffers.
TEST(LaunchRmsNorm, ZeroRowsIsANoOp) {
  EXPECT_TRUE(LaunchRmsNorm(nullptr, nullptr, nullptr, 0, 7168, kEps, nullptr).ok());
  EXPECT_TRUE(LaunchAddResidualRmsNorm(nullptr, nullptr, nullptr, 0, 7168, kEps, nullptr).ok());
  EXPECT_TRUE(LaunchStoreResidualRmsNorm(nullptr, nullptr, nullptr, 0, 64, kEps, nullptr).ok());
  EXPECT_TRUE(LaunchAddInPlace(nullptr, nullptr, 0, nullptr).ok());
  EXPECT_TRUE(LaunchSumChunks(nullptr, 2, 0, nullptr, nullptr).ok());
}

TEST(AllReduceNormImplName, Names) {
  EXPECT_STREQ(AllReduceNormImplName(AllReduceNormImpl::kFused), "fused");
  EXPECT_STREQ(AllReduceNormImplName(AllReduceNormImpl::kUnfused), "unfused");
}

// ---------------------------------------------------------------------------
// Kernels against core::RmsNorm. Hidden sizes cover the float4 path with the
// row cached in shared memory (7168, 64), the scalar path (13, 37 rows of an
// odd width) and the uncached path (H = 16384 > 12032).

struct Shape {
  int64_t rows;
  int64_t hidden;
};
const Shape kShapes[] = {{1, 7168}, {33, 7168}, {5, 64}, {7, 13}, {3, 16384}, {2, 4}};

TEST(LaunchRmsNorm, MatchesCpuNormInAndOutOfPlace) {
  MOE_EP_REQUIRE_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (const Shape& s : kShapes) {
    const std::string what = "rows " + std::to_string(s.rows) + " H " + std::to_string(s.hidden);
    const core::RmsNorm norm = MakeNorm(s.hidden, 7 + s.hidden);
    const std::vector<float> x = Random(s.rows * 100 + s.hidden, s.rows * s.hidden, -2.0f, 2.0f);
    std::vector<float> want = x;
    ASSERT_TRUE(norm.Apply(absl::MakeSpan(want), s.rows).ok());
    DeviceBuffer<float> dw(norm.weight());
    DeviceBuffer<float> dx(x);
    DeviceBuffer<float> dout(x.size());
    ASSERT_TRUE(
        LaunchRmsNorm(dx.get(), dout.get(), dw.get(), s.rows, s.hidden, kEps, nullptr).ok());
    ASSERT_TRUE(LaunchRmsNorm(dx.get(), dx.get(), dw.get(), s.rows, s.hidden, kEps, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ExpectClose(dout.Download(x.size()), want, what + " out of place");
    ExpectClose(dx.Download(x.size()), want, what + " in place");
  }
}

TEST(LaunchAddResidualRmsNorm, MatchesCpuApplyWithResidual) {
  MOE_EP_REQUIRE_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (const Shape& s : kShapes) {
    const std::string what = "rows " + std::to_string(s.rows) + " H " + std::to_string(s.hidden);
    const core::RmsNorm norm = MakeNorm(s.hidden, 11 + s.hidden);
    const std::vector<float> x = Random(s.rows * 31 + s.hidden, s.rows * s.hidden, -1.0f, 1.0f);
    const std::vector<float> r = Random(s.rows * 37 + s.hidden, s.rows * s.hidden, -1.0f, 1.0f);
    std::vector<float> want_x = x;
    std::vector<float> want_r = r;
    ASSERT_TRUE(
        norm.ApplyWithResidual(absl::MakeSpan(want_x), absl::MakeSpan(want_r), s.rows).ok());
    DeviceBuffer<float> dw(norm.weight());
    DeviceBuffer<float> dx(x);
    DeviceBuffer<float> dr(r);
    ASSERT_TRUE(
        LaunchAddResidualRmsNorm(dx.get(), dr.get(), dw.get(), s.rows, s.hidden, kEps, nullptr)
            .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // The residual is a plain fp32 add: bitwise equal.
    EXPECT_EQ(dr.Download(r.size()), want_r) << what;
    ExpectClose(dx.Download(x.size()), want_x, what);
  }
}

TEST(LaunchStoreResidualRmsNorm, CopiesInputThenNorms) {
  MOE_EP_REQUIRE_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const int64_t rows = 9, hidden = 7168;
  const core::RmsNorm norm = MakeNorm(hidden, 3);
  const std::vector<float> x = Random(5, rows * hidden, -3.0f, 3.0f);
  std::vector<float> want = x;
  ASSERT_TRUE(norm.Apply(absl::MakeSpan(want), rows).ok());
  DeviceBuffer<float> dw(norm.weight());
  DeviceBuffer<float> dx(x);
  DeviceBuffer<float> dr(x.size());
  ASSERT_TRUE(
      LaunchStoreResidualRmsNorm(dx.get(), dr.get(), dw.get(), rows, hidden, kEps, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(dr.Download(x.size()), x);
  ExpectClose(dx.Download(x.size()), want, "store residual");
}

// Hand-worked: H 4, x = [1, 2, 3, 4] -> mean square 7.5, inv = 1/sqrt(7.5 +
// eps); weight [1, 1, 2, 0.5] -> [0.36515, 0.73030, 2.19089, 0.73030].
TEST(LaunchRmsNorm, HandWorkedRow) {
  MOE_EP_REQUIRE_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  DeviceBuffer<float> dx(std::vector<float>{1, 2, 3, 4});
  DeviceBuffer<float> dw(std::vector<float>{1, 1, 2, 0.5f});
  ASSERT_TRUE(LaunchRmsNorm(dx.get(), dx.get(), dw.get(), 1, 4, kEps, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = dx.Download(4);
  const double inv = 1.0 / std::sqrt(7.5 + 1e-6);
  const double want[4] = {1 * inv, 2 * inv, 3 * 2 * inv, 4 * 0.5 * inv};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[i], 1e-6) << i;
}

TEST(LaunchAddInPlace, AddsBitwise) {
  MOE_EP_REQUIRE_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (int64_t n : {1, 4, 1001, 7168 * 3}) {
    const std::vector<float> a = Random(n, n, -1, 1);
    const std::vector<float> b = Random(n + 1, n, -1, 1);
    std::vector<float> want(n);
    for (int64_t i = 0; i < n; ++i) want[i] = a[i] + b[i];
    DeviceBuffer<float> da(a);
    DeviceBuffer<float> db(b);
    ASSERT_TRUE(LaunchAddInPlace(da.get(), db.get(), n, nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(da.Download(n), want) << n;
  }
}

TEST(LaunchSumChunks, SumsInAscendingChunkOrder) {
  MOE_EP_REQUIRE_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  for (int chunks : {1, 2, 3}) {
    for (int64_t count : {5, 64}) {
      const std::vector<float> in = Random(chunks * count, chunks * count, -1, 1);
      std::vector<float> want(in.begin(), in.begin() + count);
      for (int c = 1; c < chunks; ++c) {
        for (int64_t i = 0; i < count; ++i) want[i] += in[c * count + i];
      }
      DeviceBuffer<float> din(in);
      DeviceBuffer<float> dout(count);
      ASSERT_TRUE(LaunchSumChunks(din.get(), chunks, count, dout.get(), nullptr).ok());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(dout.Download(count), want) << chunks << " chunks of " << count;
    }
  }
}

// ---------------------------------------------------------------------------
// All-reduce + residual + norm over NCCL.

// Runs body(rank, group) on `n` threads, GPU r for rank r.
void RunRanks(int n, const std::function<void(int, NcclCollective&)>& body) {
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int rank = 0; rank < n; ++rank) {
    threads.emplace_back([&, rank] {
      ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
      auto c = NcclCollective::Create(*id, rank, n, rank, std::chrono::seconds(30));
      ASSERT_TRUE(c.ok()) << c.status();
      body(rank, **c);
    });
  }
  for (auto& t : threads) t.join();
}

// Each rank holds x_r (the partial attention output) and the same residual;
// both implementations must give norm(residual + x_0 + x_1) and the new
// residual, like the CPU path (2-rank sums are exact-order: x_0 + x_1).
// Covers 0 rows (all ranks), 1, 7 and 128 rows at H 7168 and 5 rows at H 13.
TEST(AllReduceAddRmsNorm, FusedAndUnfusedMatchCpuOnTwoRanks) {
  MOE_EP_REQUIRE_GPUS(2);
  const Shape shapes[] = {{0, 7168}, {1, 7168}, {7, 7168}, {128, 7168}, {5, 13}};
  RunRanks(2, [&](int rank, NcclCollective& group) {
    for (const Shape& s : shapes) {
      const int64_t n = s.rows * s.hidden;
      const core::RmsNorm norm = MakeNorm(s.hidden, 99);
      const std::vector<float> x0 = Random(1000 + n, n, -1, 1);
      const std::vector<float> x1 = Random(2000 + n, n, -1, 1);
      const std::vector<float> r = Random(3000 + n, n, -1, 1);
      std::vector<float> want_x(n);
      for (int64_t i = 0; i < n; ++i) want_x[i] = x0[i] + x1[i];
      std::vector<float> want_r = r;
      ASSERT_TRUE(
          norm.ApplyWithResidual(absl::MakeSpan(want_x), absl::MakeSpan(want_r), s.rows).ok());
      DeviceBuffer<float> dw(norm.weight());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      std::vector<std::vector<float>> outs;
      for (AllReduceNormImpl impl : {AllReduceNormImpl::kFused, AllReduceNormImpl::kUnfused}) {
        const std::string what = std::string(AllReduceNormImplName(impl)) + " rank " +
                                 std::to_string(rank) + " rows " + std::to_string(s.rows) + " H " +
                                 std::to_string(s.hidden);
        DeviceBuffer<float> dx(std::max<size_t>(n, 1));
        DeviceBuffer<float> dr(std::max<size_t>(n, 1));
        dx.Upload(rank == 0 ? x0 : x1);
        dr.Upload(r);
        // The uploads are ordered on the legacy stream, the group's stream is
        // non-blocking: land them first.
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        ASSERT_TRUE(
            AllReduceAddRmsNorm(group, impl, dx.get(), dr.get(), dw.get(), s.rows, s.hidden, kEps)
                .ok())
            << what;
        ASSERT_TRUE(group.Synchronize().ok()) << what;
        EXPECT_EQ(dr.Download(n), want_r) << what;
        outs.push_back(dx.Download(n));
        ExpectClose(outs.back(), want_x, what);
      }
      // Fused == unfused: same adds, same reduction tree, same products.
      EXPECT_EQ(outs[0], outs[1]) << "fused vs unfused, rows " << s.rows << " H " << s.hidden;
    }
  });
}

// The collective path refuses host memory (it would stage and wait) and bad
// shapes, before entering the all-reduce.
TEST(AllReduceAddRmsNorm, RejectsHostPointersAndBadShapes) {
  MOE_EP_REQUIRE_GPUS(1);
  RunRanks(1, [&](int, NcclCollective& group) {
    std::vector<float> host(8, 1.0f);
    DeviceBuffer<float> dw(std::vector<float>(8, 1.0f));
    DeviceBuffer<float> dr(8);
    const absl::Status s = AllReduceAddRmsNorm(group, AllReduceNormImpl::kFused, host.data(),
                                               dr.get(), dw.get(), 1, 8, kEps);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("device memory"), std::string::npos) << s;
    EXPECT_EQ(AllReduceAddRmsNorm(group, AllReduceNormImpl::kUnfused, dr.get(), dr.get(), dw.get(),
                                  1, 8, kEps)
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(AllReduceAddRmsNorm(group, static_cast<AllReduceNormImpl>(7), host.data(), dr.get(),
                                  dw.get(), 1, 8, kEps)
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(group.healthy());
  });
}

}  // namespace
}  // namespace rms_norm_test
}  // namespace moe_ep::kernels
