#include "kernels/fp8_expert_kernels.cuh"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "core/bf16.h"
#include "core/fp8_e4m3.h"
#include "core/quantized_formats.h"
#include "core/quantized_weights.h"
#include "kernels/dispatch_pack.cuh"
#include "kernels/seeded_weights.cuh"
#include "tests/kernels/gpu_test_util.h"

// The kernels around the fp8 expert GEMMs (issue 35 item 3) against core/:
// the gathered rows' quantization equals core::quant::Fp8QuantizeActivationRow
// bit for bit (zero blocks, NaN, large values included); the block
// quantization of bf16 matrices equals core::quant::QuantizeFp8Block (partial
// edge blocks) and, on seeded experts, core::quant::GenerateFp8SwiGlu; the
// weighted sum of bf16 expert outputs matches an fp64 sum within bf16's
// rounding and leaves rows with no local entry untouched.

namespace moe_ep::kernels {
namespace {

using core::bf16_t;
using testing::DeviceBuffer;

TEST(GatherQuantizeExpertRows, EqualsTheActivationRuleBitForBit) {
  MOE_EP_REQUIRE_GPUS(1);
  constexpr int64_t kRows = 40, kHidden = 384;
  constexpr int kTopK = 3;
  const testing::MoeInputs in = testing::MakeInputs(3, kRows, kHidden, kTopK, 8, 0.0);
  std::vector<bf16_t> hidden = in.hidden;
  for (int64_t j = 128; j < 256; ++j) hidden[5 * kHidden + j] = 0;  // an all-zero block
  hidden[6 * kHidden + 7] = 0x7fc0;                                 // NaN: not the amax
  hidden[7 * kHidden + 300] = core::FloatToBf16(3.0e4f);            // a large value
  const int64_t row_bytes = DispatchRowBytes(kHidden, kTopK);
  std::vector<uint8_t> recv(kRows * row_bytes, 0);
  for (int64_t r = 0; r < kRows; ++r) {
    std::memcpy(recv.data() + r * row_bytes, hidden.data() + r * kHidden, kHidden * 2);
  }
  // 70 of the 120 entries in a scrambled order; positions 70.. are not written.
  constexpr int64_t kEntries = kRows * kTopK, kUsed = 70;
  std::vector<int32_t> sorted(kEntries);
  for (int64_t i = 0; i < kEntries; ++i) sorted[i] = static_cast<int32_t>((i * 37) % kEntries);
  // position: the inverse of sorted over the used positions, -1 elsewhere.
  std::vector<int32_t> position(kEntries, -1);
  for (int64_t i = 0; i < kUsed; ++i) position[sorted[i]] = static_cast<int32_t>(i);
  DeviceBuffer<uint8_t> drecv(recv);
  DeviceBuffer<int32_t> dsorted(sorted), doff(std::vector<int32_t>{0, 30, kUsed}), dpos(position);
  // Entry-major (no position) and token-major (position set: each row
  // quantized once, scattered to its positions) kernels alike.
  for (const bool token_major : {false, true}) {
    SCOPED_TRACE(token_major ? "token-major" : "entry-major");
    ExpertEntryBuffers b;
    b.sorted_values = dsorted.get();
    b.offsets = doff.get();
    b.position = token_major ? dpos.get() : nullptr;
    DeviceBuffer<uint8_t> x(std::vector<uint8_t>(kEntries * kHidden, 0x5a));
    DeviceBuffer<float> xs(std::vector<float>(kEntries * 3, -1.0f));
    ASSERT_TRUE(LaunchGatherQuantizeExpertRows(drecv.get(), kEntries, kHidden, kTopK, b, 2, x.get(),
                                               xs.get(), kEntries, nullptr)
                    .ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint8_t> codes = x.Download(kEntries * kHidden);
    const std::vector<float> scales = xs.Download(kEntries * 3);
    int64_t bad = 0;
    for (int64_t i = 0; i < kEntries; ++i) {
      const int64_t r = sorted[i] / kTopK;
      std::vector<float> row(kHidden);
      for (int64_t j = 0; j < kHidden; ++j) row[j] = core::Bf16ToFloat(hidden[r * kHidden + j]);
      std::vector<uint8_t> want(kHidden);
      float want_s[3];
      core::quant::Fp8QuantizeActivationRow(row.data(), kHidden, want.data(), want_s);
      for (int64_t blk = 0; blk < 3; ++blk) {
        const float got = scales[blk * kEntries + i];
        if (i < kUsed) {
          bad += core::fp8::FloatBits(got) != core::fp8::FloatBits(want_s[blk]);
        } else {
          bad += got != -1.0f;
        }
      }
      for (int64_t j = 0; j < kHidden; ++j) {
        bad += codes[i * kHidden + j] != (i < kUsed ? want[j] : 0x5a);
      }
    }
    EXPECT_EQ(bad, 0);
    // The zero block of row 5 has scale 1 and codes 0 wherever row 5 lands.
    for (int64_t i = 0; i < kUsed; ++i) {
      if (sorted[i] / kTopK == 5) {
        EXPECT_EQ(scales[1 * kEntries + i], 1.0f);
      }
    }
  }
}

TEST(GatherQuantizeExpertRows, RejectsHiddenOffTheBlock) {
  ExpertEntryBuffers b;
  const absl::Status s =
      LaunchGatherQuantizeExpertRows(nullptr, 4, 200, 2, b, 1, nullptr, nullptr, 4, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("hidden a positive multiple of 128 (got 200)"), std::string::npos)
      << s;
}

TEST(QuantizeFp8BlockMatrices, EqualsQuantizeFp8BlockWithPartialBlocks) {
  MOE_EP_REQUIRE_GPUS(1);
  constexpr int64_t kMats = 3, kRows = 200, kCols = 300;  // 2 x 3 blocks, partial at the edges
  std::vector<bf16_t> w(kMats * kRows * kCols);
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> v(-2.0f, 2.0f);
  for (auto& x : w) x = core::FloatToBf16(v(rng));
  for (int64_t c = 0; c < kCols; ++c) w[kRows * kCols + 130 * kCols + c] = 0;  // zero rows
  w[5] = 0xffc0;  // NaN: skipped by the amax
  DeviceBuffer<bf16_t> dw(w);
  DeviceBuffer<uint8_t> codes(w.size());
  DeviceBuffer<float> scales(kMats * 2 * 3);
  ASSERT_TRUE(LaunchQuantizeFp8BlockMatrices(dw.get(), kMats, kRows, kCols, codes.get(),
                                             scales.get(), nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> got_codes = codes.Download(w.size());
  const std::vector<float> got_scales = scales.Download(kMats * 6);
  for (int64_t m = 0; m < kMats; ++m) {
    const std::vector<bf16_t> one(w.begin() + m * kRows * kCols,
                                  w.begin() + (m + 1) * kRows * kCols);
    const core::quant::Fp8BlockMatrix want = core::quant::QuantizeFp8Block(one, kRows, kCols);
    EXPECT_TRUE(
        std::equal(want.codes.begin(), want.codes.end(), got_codes.begin() + m * kRows * kCols))
        << "codes of matrix " << m;
    EXPECT_TRUE(
        std::equal(want.scale_inv.begin(), want.scale_inv.end(), got_scales.begin() + m * 6))
        << "scales of matrix " << m;
  }
}

// Seeded bf16 experts generated on the device and block-quantized there are
// core::quant::GenerateFp8SwiGlu's weights, in Fp8SwiGluExperts' layout.
TEST(QuantizeFp8BlockMatrices, SeededExpertsEqualGenerateFp8SwiGlu) {
  MOE_EP_REQUIRE_GPUS(1);
  constexpr int64_t kHidden = 256, kInter = 384;
  constexpr int kExperts = 2, kFirst = 3, kLayer = 1;
  constexpr uint64_t kSeed = 17;
  DeviceBuffer<uint16_t> gate_up(kExperts * 2 * kInter * kHidden),
      down(kExperts * kHidden * kInter);
  SeededSwiGluParams p;
  p.seed = kSeed;
  p.layer = kLayer;
  p.first_expert = kFirst;
  p.num_experts = kExperts;
  p.hidden = kHidden;
  p.intermediate = kInter;
  p.gate_up = gate_up.get();
  p.down = down.get();
  ASSERT_TRUE(LaunchSeededSwiGluWeights(p, nullptr).ok());
  DeviceBuffer<uint8_t> gu_codes(kExperts * 2 * kInter * kHidden),
      d_codes(kExperts * kHidden * kInter);
  DeviceBuffer<float> gu_scales(kExperts * 2 * 3 * 2), d_scales(kExperts * 2 * 3);
  ASSERT_TRUE(LaunchQuantizeFp8BlockMatrices(gate_up.get(), 2 * kExperts, kInter, kHidden,
                                             gu_codes.get(), gu_scales.get(), nullptr)
                  .ok());
  ASSERT_TRUE(LaunchQuantizeFp8BlockMatrices(down.get(), kExperts, kHidden, kInter, d_codes.get(),
                                             d_scales.get(), nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<uint8_t> guc = gu_codes.Download(kExperts * 2 * kInter * kHidden);
  const std::vector<float> gus = gu_scales.Download(kExperts * 12);
  const std::vector<uint8_t> dc = d_codes.Download(kExperts * kHidden * kInter);
  const std::vector<float> ds = d_scales.Download(kExperts * 6);
  for (int l = 0; l < kExperts; ++l) {
    auto want = core::quant::GenerateFp8SwiGlu(kSeed, kLayer, kFirst + l, kHidden, kInter);
    ASSERT_TRUE(want.ok()) << want.status();
    const int64_t gsz = kInter * kHidden;
    EXPECT_TRUE(
        std::equal(want->gate.codes.begin(), want->gate.codes.end(), guc.begin() + (2 * l) * gsz));
    EXPECT_TRUE(
        std::equal(want->up.codes.begin(), want->up.codes.end(), guc.begin() + (2 * l + 1) * gsz));
    EXPECT_TRUE(std::equal(want->gate.scale_inv.begin(), want->gate.scale_inv.end(),
                           gus.begin() + (2 * l) * 6));
    EXPECT_TRUE(std::equal(want->up.scale_inv.begin(), want->up.scale_inv.end(),
                           gus.begin() + (2 * l + 1) * 6));
    EXPECT_TRUE(std::equal(want->down.codes.begin(), want->down.codes.end(), dc.begin() + l * gsz));
    EXPECT_TRUE(
        std::equal(want->down.scale_inv.begin(), want->down.scale_inv.end(), ds.begin() + l * 6));
  }
}

TEST(WeightedExpertSumBf16, SumsTheLocalEntriesInFp32) {
  MOE_EP_REQUIRE_GPUS(1);
  constexpr int64_t kRows = 6, kHidden = 64;
  constexpr int kTopK = 3;
  const int64_t row_bytes = DispatchRowBytes(kHidden, kTopK);
  std::vector<uint8_t> recv(kRows * row_bytes, 0);
  // position [r * K + k]: entry index into y, or -1 (row 2 has none).
  const std::vector<int32_t> position = {0, -1, 1,  2, 3, 4, -1, -1, -1,
                                         5, -1, -1, 6, 7, 8, -1, 9,  -1};
  std::vector<float> w(kRows * kTopK);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int k = 0; k < kTopK; ++k) {
      w[r * kTopK + k] = 0.25f * static_cast<float>(k + 1) + 0.01f * static_cast<float>(r);
      std::memcpy(recv.data() + r * row_bytes + 2 * kHidden + 4 * kTopK + 4 * k, &w[r * kTopK + k],
                  4);
    }
  }
  std::vector<bf16_t> y(10 * kHidden);
  for (size_t i = 0; i < y.size(); ++i) {
    y[i] = core::FloatToBf16(std::sin(0.37f * static_cast<float>(i)) * 3.0f);
  }
  DeviceBuffer<uint8_t> drecv(recv);
  DeviceBuffer<int32_t> dpos(position);
  DeviceBuffer<bf16_t> dy(y), out(std::vector<bf16_t>(kRows * kHidden, 0xffff));
  ASSERT_TRUE(LaunchWeightedExpertSumBf16(drecv.get(), kRows, kHidden, kTopK, dpos.get(), dy.get(),
                                          out.get(), nullptr)
                  .ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<bf16_t> got = out.Download(kRows * kHidden);
  for (int64_t r = 0; r < kRows; ++r) {
    for (int64_t h = 0; h < kHidden; ++h) {
      double want = 0, mag = 0;
      bool any = false;
      for (int k = 0; k < kTopK; ++k) {
        const int32_t p = position[r * kTopK + k];
        if (p < 0) continue;
        any = true;
        const double t = w[r * kTopK + k] * core::Bf16ToFloat(y[p * kHidden + h]);
        want += t;
        mag += std::abs(t);
      }
      const bf16_t g = got[r * kHidden + h];
      if (!any) {
        EXPECT_EQ(g, 0xffff) << "row " << r << " has no local entry";
        continue;
      }
      EXPECT_NEAR(core::Bf16ToFloat(g), want, std::abs(want) / 256 + 1e-6 * mag)
          << "row " << r << " col " << h;
    }
  }
}

}  // namespace
}  // namespace moe_ep::kernels
