#include "kernels/seeded_weights.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/experts.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace seeded_weights_test {
namespace {

using testing::DeviceBuffer;

struct Shape {
  uint64_t seed;
  int layer;
  int first_expert;
  int num_experts;
  int64_t hidden;
  int64_t intermediate;
};

// Generates `s` on the device and compares every element with the host
// generator (core::ExpertSet::GenerateSwiGlu), bit for bit, in the device
// layout gate_up [L, 2I, H], down [L, H, I].
void ExpectDeviceEqualsHost(const Shape& s) {
  SCOPED_TRACE(::testing::Message() << "seed " << s.seed << " layer " << s.layer << " experts ["
                                    << s.first_expert << ", " << s.first_expert + s.num_experts
                                    << ") H " << s.hidden << " I " << s.intermediate);
  const int64_t n = s.hidden * s.intermediate;
  DeviceBuffer<uint16_t> gate_up(s.num_experts * 2 * n);
  DeviceBuffer<uint16_t> down(s.num_experts * n);
  // Poison, so an element the kernel skips cannot pass by accident.
  ASSERT_EQ(cudaMemset(gate_up.get(), 0xff, s.num_experts * 2 * n * 2), cudaSuccess);
  ASSERT_EQ(cudaMemset(down.get(), 0xff, s.num_experts * n * 2), cudaSuccess);
  SeededSwiGluParams params;
  params.seed = s.seed;
  params.layer = s.layer;
  params.first_expert = s.first_expert;
  params.num_experts = s.num_experts;
  params.hidden = s.hidden;
  params.intermediate = s.intermediate;
  params.gate_up = gate_up.get();
  params.down = down.get();
  ASSERT_TRUE(LaunchSeededSwiGluWeights(params, nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint16_t> dev_gate_up = gate_up.Download(s.num_experts * 2 * n);
  const std::vector<uint16_t> dev_down = down.Download(s.num_experts * n);

  auto host = core::ExpertSet::GenerateSwiGlu(s.seed, s.layer, s.first_expert, s.num_experts,
                                              s.hidden, s.intermediate);
  ASSERT_TRUE(host.ok()) << host.status();
  for (int l = 0; l < s.num_experts; ++l) {
    const core::SwiGluWeights& w = host->swiglu_weights(l);
    const auto gate = dev_gate_up.begin() + l * 2 * n;
    const auto up = gate + n;
    const auto dn = dev_down.begin() + l * n;
    ASSERT_TRUE(std::equal(w.gate.begin(), w.gate.end(), gate)) << "gate of local expert " << l;
    ASSERT_TRUE(std::equal(w.up.begin(), w.up.end(), up)) << "up of local expert " << l;
    ASSERT_TRUE(std::equal(w.down.begin(), w.down.end(), dn)) << "down of local expert " << l;
  }
}

TEST(LaunchSeededSwiGluWeights, BitIdenticalToHostGenerator) {
  MOE_EP_REQUIRE_GPUS(1);
  const Shape shapes[] = {
      {1, 0, 0, 1, 64, 16},                  // pinned in tests/core/experts_test.cc
      {9, 4, 7, 3, 5, 3},                    // odd I * H: 16-bit stores and the tail element
      {0xdeadbeefull, 60, 250, 6, 7168, 8},  // DeepSeek-V3 hidden, last experts of 256
      {7, 2, 0, 2, 2048, 1408},              // 1.44 M pairs per tensor: the grid-stride loop wraps
      {~0ull, 0, 0, 4, 1, 1},                // n = 1: only the tail
  };
  for (const Shape& s : shapes) ExpectDeviceEqualsHost(s);
}

// More experts than one launch's grid rows (65535 / 3 = 21845 per launch).
TEST(LaunchSeededSwiGluWeights, SplitsManyExpertsOverLaunches) {
  MOE_EP_REQUIRE_GPUS(1);
  ExpectDeviceEqualsHost({3, 1, 5, 21850, 2, 1});
}

TEST(LaunchSeededSwiGluWeights, ZeroExpertsEnqueueNothing) {
  SeededSwiGluParams params;
  params.hidden = 8;
  params.intermediate = 4;
  EXPECT_TRUE(LaunchSeededSwiGluWeights(params, nullptr).ok());  // null pointers allowed
}

TEST(LaunchSeededSwiGluWeights, RejectsBadArguments) {
  uint16_t storage[1] = {};
  uint16_t* fake = storage;  // non-null, never dereferenced: the checks come first
  SeededSwiGluParams ok;
  ok.num_experts = 1;
  ok.hidden = 8;
  ok.intermediate = 4;
  ok.gate_up = fake;
  ok.down = fake;
  auto expect_invalid = [](const SeededSwiGluParams& p, const char* fragment) {
    const absl::Status st = LaunchSeededSwiGluWeights(p, nullptr);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_NE(st.message().find(fragment), absl::string_view::npos) << st;
  };
  SeededSwiGluParams p = ok;
  p.hidden = 0;
  expect_invalid(p, "hidden and intermediate expected >= 1, got 0 and 4");
  p = ok;
  p.intermediate = -2;
  expect_invalid(p, "got 8 and -2");
  p = ok;
  p.num_experts = -1;
  expect_invalid(p, "num_experts and first_expert expected >= 0, got -1 and 0");
  p = ok;
  p.first_expert = -3;
  expect_invalid(p, "got 1 and -3");
  p = ok;
  p.down = nullptr;
  expect_invalid(p, "null gate_up or down");
}

}  // namespace
}  // namespace seeded_weights_test
}  // namespace moe_ep::kernels
