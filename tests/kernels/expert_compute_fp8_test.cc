// ExpertCompute::RunFp8 (kernels/expert_compute.h; issue 35 item 3): the
// fp8 block-scaled SwiGLU experts of one rank over received rows, against
// the CPU reference core::quant::Fp8SwiGluForward per (row, local choice),
// summed with the router weights in fp64. Slots are a set of ids that is
// not a range; invalid ids and other ranks' ids contribute nothing; rows
// with no local choice are not written. Real size: DeepSeek-V3's H 7168,
// I 2048 for a few tokens, the experts generated on the device
// (kernels/seeded_weights.cuh + LaunchQuantizeFp8BlockMatrices) and checked
// bit for bit against core::quant::GenerateFp8SwiGlu. The step replays from
// a CUDA graph with the same bits and repeats bit for bit.
//
// Tolerance of out[r, j] against the reference sum W = sum_k w_k y_k:
//   |W|/256 (bf16 output) + sum_k w_k (|y_k|/256 (y's bf16 rounding) +
//   2^-10 S_k + M_k / 4)
// with S_k = sum_i |A_i D_i| and M_k = max_i |A_i D_i| over the down GEMM's
// terms (A the reference's quantized intermediate, D the down weights): the
// tensor cores' in-block rounding (2^-10 of the |products|, as
// tests/kernels/fp8_grouped_gemm_test.cc) and up to two e4m3 code flips of
// the intermediate where the GPU's fp32 h sits on a rounding boundary a
// rounding away from the reference's (each moves one term by an e4m3 ulp,
// <= 2^-3 of it).

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "core/bf16.h"
#include "core/fp8_e4m3.h"
#include "core/quantized_expert_compute.h"
#include "core/quantized_weights.h"
#include "kernels/expert_compute.h"
#include "kernels/fp8_expert_kernels.cuh"
#include "kernels/hopper_grouped_gemm.cuh"
#include "kernels/seeded_weights.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

using core::bf16_t;
using core::quant::Fp8SwiGluWeights;
using testing::DeviceBuffer;

#define REQUIRE_HOPPER()                                                    \
  MOE_EP_REQUIRE_GPUS(1);                                                   \
  if (absl::Status hopper_ = HopperGroupedGemmAvailable(); !hopper_.ok()) { \
    GTEST_SKIP() << hopper_;                                                \
  }

struct Layer {
  int64_t hidden = 0, inter = 0;
  int num_experts = 0;   // global experts the rows route to
  std::vector<int> ids;  // the rank's slots (ascending)
  uint64_t seed = 0;
  int layer = 0;
};

// The rank's fp8 experts on the device, generated there and checked against
// core::quant::GenerateFp8SwiGlu (returned in `host`).
struct DeviceFp8 {
  DeviceBuffer<int32_t> slot_ids;
  DeviceBuffer<uint8_t> gate_up, down;
  DeviceBuffer<float> gate_up_scale, down_scale;
  Fp8SwiGluExperts view;
  DeviceFp8(const Layer& c, std::vector<Fp8SwiGluWeights>* host)
      : slot_ids(std::vector<int32_t>(c.ids.begin(), c.ids.end())),
        gate_up(c.ids.size() * 2 * c.inter * c.hidden),
        down(c.ids.size() * c.hidden * c.inter),
        gate_up_scale(c.ids.size() * 2 * (c.inter / 128) * (c.hidden / 128)),
        down_scale(c.ids.size() * (c.hidden / 128) * (c.inter / 128)) {
    const int64_t gsz = c.inter * c.hidden;
    const int64_t ssz = (c.inter / 128) * (c.hidden / 128);
    DeviceBuffer<uint16_t> bf_gu(2 * gsz), bf_down(gsz);
    for (size_t l = 0; l < c.ids.size(); ++l) {
      SeededSwiGluParams p;
      p.seed = c.seed;
      p.layer = c.layer;
      p.first_expert = c.ids[l];
      p.num_experts = 1;
      p.hidden = c.hidden;
      p.intermediate = c.inter;
      p.gate_up = bf_gu.get();
      p.down = bf_down.get();
      EXPECT_TRUE(LaunchSeededSwiGluWeights(p, nullptr).ok());
      EXPECT_TRUE(LaunchQuantizeFp8BlockMatrices(bf_gu.get(), 2, c.inter, c.hidden,
                                                 gate_up.get() + l * 2 * gsz,
                                                 gate_up_scale.get() + l * 2 * ssz, nullptr)
                      .ok());
      EXPECT_TRUE(LaunchQuantizeFp8BlockMatrices(bf_down.get(), 1, c.hidden, c.inter,
                                                 down.get() + l * gsz, down_scale.get() + l * ssz,
                                                 nullptr)
                      .ok());
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      auto w = core::quant::GenerateFp8SwiGlu(c.seed, c.layer, c.ids[l], c.hidden, c.inter);
      EXPECT_TRUE(w.ok()) << w.status();
      // The device's weights are the host generator's, bit for bit.
      std::vector<uint8_t> codes(2 * gsz);
      std::vector<float> scales(2 * ssz);
      EXPECT_EQ(
          cudaMemcpy(codes.data(), gate_up.get() + l * 2 * gsz, 2 * gsz, cudaMemcpyDeviceToHost),
          cudaSuccess);
      EXPECT_EQ(cudaMemcpy(scales.data(), gate_up_scale.get() + l * 2 * ssz, 8 * ssz,
                           cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_TRUE(std::equal(w->gate.codes.begin(), w->gate.codes.end(), codes.begin()));
      EXPECT_TRUE(std::equal(w->up.codes.begin(), w->up.codes.end(), codes.begin() + gsz));
      EXPECT_TRUE(std::equal(w->gate.scale_inv.begin(), w->gate.scale_inv.end(), scales.begin()));
      EXPECT_TRUE(std::equal(w->up.scale_inv.begin(), w->up.scale_inv.end(), scales.begin() + ssz));
      codes.resize(gsz);
      scales.resize(ssz);
      EXPECT_EQ(cudaMemcpy(codes.data(), down.get() + l * gsz, gsz, cudaMemcpyDeviceToHost),
                cudaSuccess);
      EXPECT_EQ(
          cudaMemcpy(scales.data(), down_scale.get() + l * ssz, 4 * ssz, cudaMemcpyDeviceToHost),
          cudaSuccess);
      EXPECT_TRUE(std::equal(w->down.codes.begin(), w->down.codes.end(), codes.begin()));
      EXPECT_TRUE(std::equal(w->down.scale_inv.begin(), w->down.scale_inv.end(), scales.begin()));
      host->push_back(std::move(*w));
    }
    view.slot_ids = slot_ids.get();
    view.num_experts = static_cast<int>(c.ids.size());
    view.hidden = c.hidden;
    view.intermediate = c.inter;
    view.gate_up = gate_up.get();
    view.gate_up_scale = gate_up_scale.get();
    view.down = down.get();
    view.down_scale = down_scale.get();
  }
};

// scale_input: Llama-4's e(w * x) (issue 35 item 5): the reference feeds
// bf16(w * x), the row the GPU quantizes, and sums the outputs with weight 1.
void RunLayer(const Layer& c, int64_t rows, int top_k, double invalid_fraction,
              bool expect_nonlocal_rows, bool scale_input = false) {
  SCOPED_TRACE(::testing::Message() << "H " << c.hidden << " I " << c.inter << " rows " << rows
                                    << (scale_input ? " e(w x)" : ""));
  std::vector<Fp8SwiGluWeights> host;
  DeviceFp8 dev(c, &host);
  dev.view.scales_input = scale_input;
  ASSERT_EQ(host.size(), c.ids.size());
  const testing::MoeInputs in =
      testing::MakeInputs(c.seed + 1, rows, c.hidden, top_k, c.num_experts, invalid_fraction);
  auto compute =
      ExpertCompute::Create(rows, top_k, c.hidden, c.inter, static_cast<int>(c.ids.size()));
  ASSERT_TRUE(compute.ok()) << compute.status();
  DeviceBuffer<uint8_t> recv(testing::PackRows(in, rows, c.hidden, top_k));
  DeviceBuffer<bf16_t> out(std::vector<bf16_t>(rows * c.hidden, 0xffff));
  ASSERT_TRUE((*compute)->RunFp8(recv.get(), rows, dev.view, out.get(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<bf16_t> got = out.Download(rows * c.hidden);

  // Repeat eagerly, then from a graph: the same bits.
  DeviceBuffer<bf16_t> out2(std::vector<bf16_t>(rows * c.hidden, 0xffff));
  const absl::Status replayed = testing::ReplayFromGraph([&](cudaStream_t stream) {
    return (*compute)->RunFp8(recv.get(), rows, dev.view, out2.get(), stream);
  });
  ASSERT_TRUE(replayed.ok()) << replayed;
  EXPECT_TRUE(out2.Download(rows * c.hidden) == got) << "graph replay differs from the eager run";

  // Reference, per row and local choice.
  int64_t bad = 0, local_rows = 0;
  double worst = 0;  // largest |error| / tolerance
  std::vector<float> x(c.hidden), xk(c.hidden), y(c.hidden);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < c.hidden; ++j) x[j] = core::Bf16ToFloat(in.hidden[r * c.hidden + j]);
    std::vector<double> want(c.hidden, 0.0), tol(c.hidden, 0.0);
    bool local = false;
    for (int k = 0; k < top_k; ++k) {
      const int32_t id = in.ids[r * top_k + k];
      const auto it = std::find(c.ids.begin(), c.ids.end(), id);
      if (it == c.ids.end()) continue;
      local = true;
      const Fp8SwiGluWeights& w = host[it - c.ids.begin()];
      core::quant::Fp8SwiGluTrace trace;
      const float weight = in.weights[r * top_k + k];
      for (int64_t j = 0; j < c.hidden; ++j) {
        xk[j] = scale_input ? core::Bf16ToFloat(core::FloatToBf16(weight * x[j])) : x[j];
      }
      ASSERT_TRUE(core::quant::Fp8SwiGluForward(w, xk, 1, absl::MakeSpan(y), &trace).ok());
      const double wk = scale_input ? 1.0 : weight;
      for (int64_t j = 0; j < c.hidden; ++j) {
        double s = 0, m = 0;
        for (int64_t i = 0; i < c.inter; ++i) {
          const double a = static_cast<double>(core::fp8::E4m3ToFloat(trace.h_q.codes[i])) *
                           trace.h_q.scales[i / 128];
          const double t = std::abs(a * w.down.Value(j, i));
          s += t;
          m = std::max(m, t);
        }
        want[j] += wk * y[j];
        tol[j] += wk * (std::abs(y[j]) / 256 + s / 1024 + m / 4);
      }
    }
    local_rows += local;
    for (int64_t j = 0; j < c.hidden; ++j) {
      const bf16_t g = got[r * c.hidden + j];
      if (!local) {
        bad += g != 0xffff;
        continue;
      }
      const double t = tol[j] + std::abs(want[j]) / 256 + 1e-30;
      const double err = std::abs(core::Bf16ToFloat(g) - want[j]);
      worst = std::max(worst, err / t);
      if (!(err <= t) && ++bad <= 5) {
        ADD_FAILURE() << "out[" << r << ", " << j << "] got " << core::Bf16ToFloat(g) << " want "
                      << want[j] << " tol " << t;
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_GT(local_rows, 0);
  if (expect_nonlocal_rows) {
    EXPECT_LT(local_rows, rows) << "some rows must reach none of the rank's experts";
  }
  std::printf("[          ] largest |error| / tolerance: %.3g\n", worst);
}

// H 256, I 512, 12 experts of which the rank holds {1, 4, 5, 9}.
Layer SmallLayer(uint64_t seed, int layer) {
  Layer c;
  c.hidden = 256;
  c.inter = 512;
  c.num_experts = 12;
  c.ids = {1, 4, 5, 9};
  c.seed = seed;
  c.layer = layer;
  return c;
}

TEST(ExpertComputeFp8, SmallLayerOnSlotsThatAreNotARangeEqualsTheReference) {
  REQUIRE_HOPPER();
  RunLayer(SmallLayer(5, 2), 80, 4, 0.1, true);
}

TEST(ExpertComputeFp8, InputScalingComputesExpertOfTheScaledRow) {
  REQUIRE_HOPPER();
  const Layer c = SmallLayer(9, 1);
  RunLayer(c, 80, 1, 0.1, true, /*scale_input=*/true);  // Llama-4: top-1
  RunLayer(c, 80, 4, 0.1, true, /*scale_input=*/true);  // any top-k alike
}

TEST(ExpertComputeFp8, DeepSeekV3ShapeForAFewTokens) {
  REQUIRE_HOPPER();
  Layer c;
  c.hidden = 7168;
  c.inter = 2048;
  c.num_experts = 16;
  c.ids = {0, 1, 2, 3};
  c.seed = 7;
  c.layer = 3;
  RunLayer(c, 6, 8, 0.0, false);
}

TEST(ExpertComputeFp8, RejectsAnIntermediateOffTheScaleBlock) {
  REQUIRE_HOPPER();
  auto compute = ExpertCompute::Create(4, 2, 256, 512, 2);
  ASSERT_TRUE(compute.ok()) << compute.status();
  Fp8SwiGluExperts e;
  e.hidden = 256;
  e.intermediate = 320;
  e.num_experts = 1;
  const absl::Status s = (*compute)->RunFp8(nullptr, 4, e, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("got intermediate 320, hidden 256"), std::string::npos) << s;
}

}  // namespace
}  // namespace moe_ep::kernels
