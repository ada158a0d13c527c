// The shared expert on the GPU (kernels/shared_expert.h; issue 18) against
// core::SharedExpert on the host, and the combine's shared term.

#include "kernels/shared_expert.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/bf16.h"
#include "gtest/gtest.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace shared_expert_test {
namespace {

std::vector<core::bf16_t> RandomHidden(uint32_t seed, int64_t n) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<core::bf16_t> v(n);
  for (auto& x : v) x = core::FloatToBf16(d(gen));
  return v;
}

// Runs `shared` on the device for `hidden` [T, H] and returns bf16 [T, H].
std::vector<core::bf16_t> RunOnDevice(const core::SharedExpert& shared,
                                      const std::vector<core::bf16_t>& hidden, int64_t tokens) {
  const int64_t h = shared.hidden();
  auto device = DeviceSharedExpert::Upload(shared);
  EXPECT_TRUE(device.ok()) << device.status();
  auto runner = SharedExpertRunner::Create(std::max<int64_t>(tokens, 1), h, shared.intermediate());
  EXPECT_TRUE(runner.ok()) << runner.status();
  uint16_t* d_hidden = nullptr;
  EXPECT_EQ(cudaMalloc(&d_hidden, std::max<size_t>(hidden.size(), 1) * 2), cudaSuccess);
  if (!hidden.empty()) {
    EXPECT_EQ(cudaMemcpy(d_hidden, hidden.data(), hidden.size() * 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  absl::Status s = (*runner)->Enqueue(**device, d_hidden, tokens, stream);
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  std::vector<core::bf16_t> out(tokens * h);
  if (!out.empty()) {
    EXPECT_EQ(cudaMemcpy(out.data(), (*runner)->output(), out.size() * 2, cudaMemcpyDeviceToHost),
              cudaSuccess);
  }
  cudaStreamDestroy(stream);
  cudaFree(d_hidden);
  return out;
}

// Gate [0.5, -0.5, 0, 0] on x = [2, 2, 1, 3]: logit 0 -> g = 0.5 exactly;
// gate [7.5, 7.5, 0, 0] on x = [2, 2, 1, 3]: logit 30 -> g = 1; and on
// x = [-2, -2, 1, 3]: logit -30 -> g = 9.3576e-14. Identity shared expert.
TEST(GpuSharedExpert, HandWorkedGates) {
  MOE_EP_REQUIRE_GPUS(1);
  auto half = core::SharedExpert::IdentityWithGate(
      {core::FloatToBf16(0.5f), core::FloatToBf16(-0.5f), 0, 0}, 4);
  ASSERT_TRUE(half.ok());
  const std::vector<core::bf16_t> x = {core::FloatToBf16(2), core::FloatToBf16(2),
                                       core::FloatToBf16(1), core::FloatToBf16(3)};
  std::vector<core::bf16_t> out = RunOnDevice(*half, x, 1);
  ASSERT_EQ(out.size(), 4u);
  EXPECT_EQ(core::Bf16ToFloat(out[0]), 1.0f);
  EXPECT_EQ(core::Bf16ToFloat(out[2]), 0.5f);
  EXPECT_EQ(core::Bf16ToFloat(out[3]), 1.5f);

  auto thirty = core::SharedExpert::IdentityWithGate(
      {core::FloatToBf16(7.5f), core::FloatToBf16(7.5f), 0, 0}, 4);
  ASSERT_TRUE(thirty.ok());
  std::vector<core::bf16_t> xs = x;
  xs.push_back(core::FloatToBf16(-2));
  xs.push_back(core::FloatToBf16(-2));
  xs.push_back(core::FloatToBf16(1));
  xs.push_back(core::FloatToBf16(3));
  out = RunOnDevice(*thirty, xs, 2);
  ASSERT_EQ(out.size(), 8u);
  EXPECT_EQ(core::Bf16ToFloat(out[0]), 2.0f);  // g = 1
  EXPECT_EQ(core::Bf16ToFloat(out[3]), 3.0f);
  const float g = 9.357622968840175e-14f;
  EXPECT_NEAR(core::Bf16ToFloat(out[7]), 3 * g, 3 * g / 128);  // bf16 of g * 3
  EXPECT_NEAR(core::Bf16ToFloat(out[4]), -2 * g, 2 * g / 128);
}

// Seeded gated SwiGLU (H 256, I 128) on 37 tokens agrees with the host to
// bf16 rounding: both round act to bf16 and accumulate in fp32; the gate's
// dot product is summed in a different order.
TEST(GpuSharedExpert, SeededSwiGluMatchesHost) {
  MOE_EP_REQUIRE_GPUS(1);
  const int64_t h = 256, i = 128, t = 37;
  auto shared = core::SharedExpert::Generate(11, 5, h, i, true);
  ASSERT_TRUE(shared.ok());
  const std::vector<core::bf16_t> x = RandomHidden(3, t * h);
  std::vector<float> ref(t * h);
  ASSERT_TRUE(shared->ComputeFloat(x, t, absl::MakeSpan(ref)).ok());
  const std::vector<core::bf16_t> out = RunOnDevice(*shared, x, t);
  float max_ref = 0, max_err = 0;
  for (int64_t k = 0; k < t * h; ++k) {
    max_ref = std::max(max_ref, std::fabs(ref[k]));
    max_err = std::max(max_err, std::fabs(core::Bf16ToFloat(out[k]) - ref[k]));
  }
  EXPECT_GT(max_ref, 0.01f);
  EXPECT_LE(max_err, max_ref / 64) << "max_ref " << max_ref;
}

TEST(GpuSharedExpert, ZeroTokensAndBadSizes) {
  MOE_EP_REQUIRE_GPUS(1);
  auto shared = core::SharedExpert::Generate(1, 0, 64, 32, false);
  ASSERT_TRUE(shared.ok());
  EXPECT_TRUE(RunOnDevice(*shared, {}, 0).empty());
  auto device = DeviceSharedExpert::Upload(*shared);
  auto small = SharedExpertRunner::Create(4, 64, 16);  // I 32 > 16
  ASSERT_TRUE(device.ok() && small.ok());
  EXPECT_EQ((*small)->Enqueue(**device, nullptr, 1, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
  auto runner = SharedExpertRunner::Create(4, 64, 32);
  ASSERT_TRUE(runner.ok());
  EXPECT_EQ((*runner)->Enqueue(**device, nullptr, 5, nullptr).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shared_expert_test
}  // namespace moe_ep::kernels
