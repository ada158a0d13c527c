// The quantized CPU reference (core/quantized_expert_compute.h; issue 35
// item 3) against fp64 products of the dequantized operands, with the strict
// bounds the header states, stage by stage; and each whole expert against
// its unquantized fp64 form with a bound derived from the quantization
// errors it actually made. Real sizes: every (H, I) of the fp8 and mxfp4
// configs in ../shared/data/models, one expert, a few tokens.
#include "core/quantized_expert_compute.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/fp8_e4m3.h"
#include "core/model_config.h"
#include "core/quantized_weights.h"
#include "core/seeded_stream.h"

namespace moe_ep::core::quant {
namespace {

constexpr double kU = 1.0 / 16777216.0;  // 2^-24

double Gamma(double n) { return n * kU / (1.0 - n * kU); }

// Seeded bf16-valued activations in about [-2, 2] (fp32 holding bf16 values).
std::vector<float> Activations(uint64_t seed, int64_t rows, int64_t cols) {
  const uint64_t key = SeededTensorKey(seed, 99, 0, SeededProjection::kGate);
  const SeededUniform range = SeededUniformFor(1);  // [-1, 1)
  std::vector<float> x(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) x[i] = 2.0f * Bf16ToFloat(SeededElement(key, i, range));
  return x;
}

std::vector<bf16_t> Bf16Matrix(uint64_t seed, SeededProjection proj, int64_t n, int64_t fan_in) {
  const uint64_t key = SeededTensorKey(seed, 1, 2, proj);
  const SeededUniform range = SeededUniformFor(fan_in);
  std::vector<bf16_t> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = SeededElement(key, i, range);
  return w;
}

double Dequant(const Fp8Activations& a, int64_t m, int64_t k) {
  return static_cast<double>(fp8::E4m3ToFloat(a.codes[m * a.cols + k])) *
         a.scales[m * Fp8ScaleBlocks(a.cols) + k / kFp8Block];
}

// Checks out [M, N] against the fp64 product of the dequantized operands
// with the bound of Fp8BlockGemm; returns the largest error / bound seen.
double CheckFp8Gemm(const Fp8Activations& a, const Fp8BlockMatrix& w,
                    const std::vector<float>& out) {
  const double bound_factor = Gamma(kFp8Block + Fp8ScaleBlocks(w.cols) + 2);
  double worst = 0.0;
  for (int64_t m = 0; m < a.rows; ++m) {
    for (int64_t n = 0; n < w.rows; ++n) {
      double exact = 0.0, abs_sum = 0.0;
      for (int64_t k = 0; k < w.cols; ++k) {
        const double p = Dequant(a, m, k) * w.Value(n, k);
        exact += p;
        abs_sum += std::abs(p);
      }
      const double err = std::abs(out[m * w.rows + n] - exact);
      const double bound = bound_factor * abs_sum;
      EXPECT_LE(err, bound) << "m " << m << " n " << n << " exact " << exact;
      if (bound > 0) worst = std::max(worst, err / bound);
    }
  }
  return worst;
}

TEST(Fp8QuantizeActivations, EveryRowByItsOwnBlocks) {
  const std::vector<float> x = Activations(3, 3, 300);
  const Fp8Activations a = Fp8QuantizeActivations(x, 3, 300);
  ASSERT_EQ(a.codes.size(), 900u);
  ASSERT_EQ(a.scales.size(), 9u);  // 3 blocks a row: 128, 128, 44
  for (int64_t r = 0; r < 3; ++r) {
    for (int64_t b = 0; b < 3; ++b) {
      float amax = 0.0f;
      for (int64_t k = b * 128; k < std::min<int64_t>(300, b * 128 + 128); ++k) {
        amax = std::max(amax, std::abs(x[r * 300 + k]));
      }
      const float scale = amax / 448.0f;
      EXPECT_EQ(a.scales[r * 3 + b], scale);
      for (int64_t k = b * 128; k < std::min<int64_t>(300, b * 128 + 128); ++k) {
        EXPECT_EQ(a.codes[r * 300 + k], fp8::E4m3FromFloat(x[r * 300 + k] / scale));
      }
    }
  }
}

TEST(Fp8BlockGemm, WithinItsBoundOnRaggedBlocks) {
  // N 200 and K 300: partial blocks on both axes; one all-zero token.
  // Each weight block and each activation block has its own amplitude, so
  // a scale read from the wrong block is caught (seeded uniform values give
  // every block the same amax).
  const int64_t M = 4, N = 200, K = 300;
  std::vector<float> x = Activations(5, M, K);
  for (int64_t i = 0; i < M * K; ++i) {
    const int64_t amplitude = 1 + ((i % K) / 128) + (3 * (i / K));
    x[i] = Bf16ToFloat(FloatToBf16(x[i] * static_cast<float>(amplitude)));
  }
  std::fill(x.begin() + 2 * K, x.begin() + 3 * K, 0.0f);
  const Fp8Activations a = Fp8QuantizeActivations(x, M, K);
  std::vector<bf16_t> wb = Bf16Matrix(7, SeededProjection::kGate, N * K, K);
  for (int64_t i = 0; i < N * K; ++i) {
    const int64_t rb = (i / K) / 128, cb = (i % K) / 128;
    wb[i] = FloatToBf16(Bf16ToFloat(wb[i]) * static_cast<float>((1 + rb) * (1 + 2 * cb)));
  }
  const Fp8BlockMatrix w = QuantizeFp8Block(wb, N, K);
  EXPECT_NE(w.scale_inv[0], w.scale_inv[3]);  // row blocks differ
  EXPECT_NE(w.scale_inv[0], w.scale_inv[1]);  // column blocks differ
  EXPECT_NE(a.scales[0], a.scales[1]);
  std::vector<float> out(M * N, -1.0f);
  ASSERT_TRUE(Fp8BlockGemm(a, w, absl::MakeSpan(out)).ok());
  CheckFp8Gemm(a, w, out);
  for (int64_t n = 0; n < N; ++n) EXPECT_EQ(out[2 * N + n], 0.0f);
}

TEST(Fp8BlockGemm, PromotesEachBlockWithItsScales) {
  // Hand-worked: K = 256, one token, one output. Block 0: x = 1 at k 0 (amax
  // 1: scale 1/448, code 448), weight code 1.0 with scale_inv 0.5; block 1:
  // x = 2 at k 128 (scale 2/448, code 448), weight 1.0 with scale_inv 4.
  // out = 448 * 1 * (1/448 * 0.5) + 448 * 1 * (2/448 * 4) = 0.5 + 8 = 8.5.
  std::vector<float> x(256, 0.0f);
  x[0] = 1.0f;
  x[128] = 2.0f;
  const Fp8Activations a = Fp8QuantizeActivations(x, 1, 256);
  Fp8BlockMatrix w;
  w.rows = 1;
  w.cols = 256;
  w.codes.assign(256, 0);
  w.codes[0] = 0x38;
  w.codes[128] = 0x38;
  w.scale_inv = {0.5f, 4.0f};
  std::vector<float> out(1);
  ASSERT_TRUE(Fp8BlockGemm(a, w, absl::MakeSpan(out)).ok());
  EXPECT_FLOAT_EQ(out[0], 8.5f);
}

TEST(Fp8BlockGemm, RefusesMismatchedChannels) {
  const Fp8Activations a = Fp8QuantizeActivations(std::vector<float>(256, 1.0f), 1, 256);
  Fp8BlockMatrix w;
  w.rows = 2;
  w.cols = 128;
  w.codes.assign(256, 0);
  w.scale_inv = {1.0f};
  std::vector<float> out(2);
  const absl::Status s = Fp8BlockGemm(a, w, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("256 channels"), std::string::npos) << s;
}

TEST(Mxfp4Gemm, WithinItsBoundWithBias) {
  const int64_t M = 3, N = 150, K = 96;
  const std::vector<float> a = Activations(11, M, K);
  // Rows and 32-blocks of different amplitude: distinct E8M0 scales.
  std::vector<bf16_t> wb = Bf16Matrix(13, SeededProjection::kUp, N * K, K);
  for (int64_t i = 0; i < N * K; ++i) {
    wb[i] =
        FloatToBf16(std::ldexp(Bf16ToFloat(wb[i]), static_cast<int>((i / K) % 5 + (i % K) / 32)));
  }
  const Mxfp4Matrix w = QuantizeMxfp4(wb, N, K);
  EXPECT_NE(w.scales[0], w.scales[1]);
  EXPECT_NE(w.scales[0], w.scales[3]);
  const std::vector<bf16_t> bias = Bf16Matrix(17, SeededProjection::kGateUpBias, N, K);
  std::vector<float> out(M * N);
  ASSERT_TRUE(Mxfp4Gemm(a, M, w, bias, absl::MakeSpan(out)).ok());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t n = 0; n < N; ++n) {
      double exact = Bf16ToFloat(bias[n]), abs_sum = std::abs(exact);
      for (int64_t k = 0; k < K; ++k) {
        const double p = static_cast<double>(a[m * K + k]) * w.Value(n, k);
        exact += p;
        abs_sum += std::abs(p);
      }
      EXPECT_LE(std::abs(out[m * N + n] - exact), Gamma(K + 1) * abs_sum) << m << " " << n;
    }
  }
  const absl::Status s = Mxfp4Gemm(a, M, w, std::vector<bf16_t>(3), absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("bias"), std::string::npos) << s;
}

// The fp8 SwiGLU expert of (H, I), stage by stage and end to end.
void CheckFp8Expert(int64_t H, int64_t I, int64_t rows) {
  SCOPED_TRACE(::testing::Message() << "fp8 expert H " << H << " I " << I);
  absl::StatusOr<Fp8SwiGluWeights> w = GenerateFp8SwiGlu(21, 3, 5, H, I);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::vector<float> x = Activations(23, rows, H);
  std::vector<float> out(rows * H);
  Fp8SwiGluTrace t;
  ASSERT_TRUE(Fp8SwiGluForward(*w, x, rows, absl::MakeSpan(out), &t).ok());
  // The quantized input is the contract's quantization of x.
  const Fp8Activations xq = Fp8QuantizeActivations(x, rows, H);
  EXPECT_EQ(t.x_q.codes, xq.codes);
  EXPECT_EQ(t.x_q.scales, xq.scales);
  // gate, up and down GEMMs within the strict bound.
  CheckFp8Gemm(t.x_q, w->gate, t.g);
  CheckFp8Gemm(t.x_q, w->up, t.u);
  const Fp8Activations hq = Fp8QuantizeActivations(t.h, rows, I);
  EXPECT_EQ(t.h_q.codes, hq.codes);
  EXPECT_EQ(t.h_q.scales, hq.scales);
  CheckFp8Gemm(t.h_q, w->down, out);

  // End to end against the unquantized expert (fp64, dequantized weights,
  // x and h exact): the error is bounded by what the quantization of x and
  // h actually moved, propagated through the GEMMs (|silu'| <= 1.1), plus
  // the GEMMs' own rounding.
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> dg(I), du(I), g(I), u(I), h(I), dh(I);
    for (int64_t j = 0; j < I; ++j) {
      double gj = 0.0, uj = 0.0, gerr = 0.0, uerr = 0.0, gabs = 0.0, uabs = 0.0;
      for (int64_t k = 0; k < H; ++k) {
        const double xk = x[r * H + k];
        const double dx = std::abs(Dequant(t.x_q, r, k) - xk);
        const double wg = w->gate.Value(j, k), wu = w->up.Value(j, k);
        gj += wg * xk;
        uj += wu * xk;
        gerr += std::abs(wg) * dx;
        uerr += std::abs(wu) * dx;
        gabs += std::abs(wg * Dequant(t.x_q, r, k));
        uabs += std::abs(wu * Dequant(t.x_q, r, k));
      }
      const double round = Gamma(kFp8Block + Fp8ScaleBlocks(H) + 2);
      dg[j] = gerr + round * gabs;
      du[j] = uerr + round * uabs;
      g[j] = gj;
      u[j] = uj;
      const double silu = gj / (1.0 + std::exp(-gj));
      h[j] = silu * uj;
      // |silu(g') u' - silu(g) u| <= 1.1 dg (|u| + du) + |silu(g)| du, plus
      // the fp32 evaluation of h (a few ulps) and its quantization.
      const double dq = std::abs(Dequant(t.h_q, r, j) - t.h[r * I + j]);
      dh[j] = 1.1 * dg[j] * (std::abs(uj) + du[j]) + std::abs(silu) * du[j] +
              8.0 * kU * std::abs(t.h[r * I + j]) + dq;
    }
    double worst_rel = 0.0;
    for (int64_t n = 0; n < H; ++n) {
      double exact = 0.0, bound = 0.0, qabs = 0.0;
      for (int64_t j = 0; j < I; ++j) {
        const double wd = w->down.Value(n, j);
        exact += wd * h[j];
        bound += std::abs(wd) * dh[j];
        qabs += std::abs(wd * Dequant(t.h_q, r, j));
      }
      bound += Gamma(kFp8Block + Fp8ScaleBlocks(I) + 2) * qabs;
      const double err = std::abs(out[r * H + n] - exact);
      EXPECT_LE(err, bound) << "row " << r << " n " << n;
      worst_rel = std::max(worst_rel, err / (std::abs(exact) + 1e-3));
    }
    // And the quantized expert is close to the model's: e4m3 moves each
    // activation (x and h) by at most 2^-4 of itself, so the output's RMS
    // relative error is a few percent (measured 4.3% at 7168 x 2048 and 4.2%
    // at 3072 x 1536, 2 tokens); a broken scale is off by 2x or more.
    double num = 0.0, den = 0.0;
    for (int64_t n = 0; n < H; ++n) {
      double exact = 0.0;
      for (int64_t j = 0; j < I; ++j) exact += w->down.Value(n, j) * h[j];
      num += (out[r * H + n] - exact) * (out[r * H + n] - exact);
      den += exact * exact;
    }
    EXPECT_LT(std::sqrt(num / den), 0.06) << "row " << r;
  }
}

TEST(Fp8SwiGluForward, SmallRaggedExpert) { CheckFp8Expert(320, 200, 3); }

// The gpt-oss expert of (H, I), stage by stage and end to end.
void CheckGptOssExpert(int64_t H, int64_t I, int64_t rows, float limit) {
  SCOPED_TRACE(::testing::Message() << "gpt-oss expert H " << H << " I " << I);
  absl::StatusOr<GptOssExpertWeights> w = GenerateGptOssExpert(31, 2, 9, H, I);
  ASSERT_TRUE(w.ok()) << w.status();
  // Inputs scaled up so that some gates and ups reach the clamp at 7.
  std::vector<float> x = Activations(37, rows, H);
  for (float& v : x) v = Bf16ToFloat(FloatToBf16(v * 24.0f));
  std::vector<float> out(rows * H);
  GptOssTrace t;
  GptOssActivation act;
  act.limit = limit;
  ASSERT_TRUE(GptOssExpertForward(*w, x, rows, act, absl::MakeSpan(out), &t).ok());
  EXPECT_EQ(t.a, x);  // already bf16 values
  int clamped = 0;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> y(2 * I), h(I);
    for (int64_t n = 0; n < 2 * I; ++n) {
      double exact = Bf16ToFloat(w->gate_up_bias[n]), abs_sum = std::abs(exact);
      for (int64_t k = 0; k < H; ++k) {
        const double p = static_cast<double>(x[r * H + k]) * w->gate_up.Value(n, k);
        exact += p;
        abs_sum += std::abs(p);
      }
      EXPECT_LE(std::abs(t.y[r * 2 * I + n] - exact), Gamma(H + 1) * abs_sum) << r << " " << n;
      y[n] = exact;
    }
    for (int64_t j = 0; j < I; ++j) {
      // The activation of the traced y, in fp64: within bf16 rounding (2^-9
      // relative) plus a few fp32 ulps of the inputs' scale.
      double g = t.y[r * 2 * I + 2 * j], u = t.y[r * 2 * I + 2 * j + 1];
      clamped += (g > limit || std::abs(u) > limit) ? 1 : 0;
      g = std::min<double>(g, limit);
      u = std::max<double>(-limit, std::min<double>(u, limit));
      const double want = (u + 1.0) * g / (1.0 + std::exp(-1.702 * g));
      EXPECT_NEAR(t.h[r * I + j], want, std::ldexp(std::abs(want), -8) + 1e-5 * (std::abs(g) + 1))
          << r << " " << j;
      h[j] = want;
    }
    for (int64_t n = 0; n < H; ++n) {
      double exact = Bf16ToFloat(w->down_bias[n]), abs_sum = std::abs(exact);
      for (int64_t j = 0; j < I; ++j) {
        const double p = static_cast<double>(t.h[r * I + j]) * w->down.Value(n, j);
        exact += p;
        abs_sum += std::abs(p);
      }
      EXPECT_LE(std::abs(out[r * H + n] - exact), Gamma(I + 1) * abs_sum) << r << " " << n;
    }
  }
  EXPECT_GT(clamped, 0) << "the inputs should exercise the clamp";
}

TEST(GptOssExpertForward, SmallExpertWithClamp) { CheckGptOssExpert(96, 64, 3, 7.0f); }

// Every (H, I) of the quantized configs in ../shared/data/models, by format.
std::set<std::pair<int64_t, int64_t>> RealShapes(ExpertWeightFormat format) {
  std::set<std::pair<int64_t, int64_t>> shapes;
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  const std::string dir =
      std::string(env != nullptr && *env != '\0' ? env : MOE_EP_DATA_DIR) + "/models";
  if (!std::filesystem::is_directory(dir)) return shapes;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    if (entry.path().extension() != ".json") continue;
    absl::StatusOr<ModelDescription> m = LoadModelConfig(entry.path().string());
    EXPECT_TRUE(m.ok()) << m.status();
    if (m.ok() && m->quantization.expert_format == format) {
      shapes.insert({m->hidden_size, m->moe_intermediate_size});
    }
  }
  return shapes;
}

TEST(Fp8SwiGluForward, EveryFp8ConfigAtRealSize) {
  const auto shapes = RealShapes(ExpertWeightFormat::kFp8Block128);
  if (shapes.empty()) GTEST_SKIP() << "no model configs (MOE_EP_DATA_DIR)";
  // DeepSeek-V3/R1 and Kimi-K2 (7168, 2048); MiniMax-M2.5 (3072, 1536).
  EXPECT_EQ(shapes, (std::set<std::pair<int64_t, int64_t>>{{3072, 1536}, {7168, 2048}}));
  for (const auto& [h, i] : shapes) CheckFp8Expert(h, i, 2);
}

TEST(GptOssExpertForward, EveryMxfp4ConfigAtRealSize) {
  const auto shapes = RealShapes(ExpertWeightFormat::kMxfp4);
  if (shapes.empty()) GTEST_SKIP() << "no model configs (MOE_EP_DATA_DIR)";
  // gpt-oss-20b and -120b share (2880, 2880).
  EXPECT_EQ(shapes, (std::set<std::pair<int64_t, int64_t>>{{2880, 2880}}));
  for (const auto& [h, i] : shapes) CheckGptOssExpert(h, i, 2, 7.0f);
}

TEST(GptOssExpertForward, RefusesAnOddGateUp) {
  absl::StatusOr<GptOssExpertWeights> w = GenerateGptOssExpert(1, 0, 0, 64, 32);
  ASSERT_TRUE(w.ok());
  w->gate_up_bias.pop_back();
  std::vector<float> x(64), out(64);
  const absl::Status s = GptOssExpertForward(*w, x, 1, {}, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("biases"), std::string::npos) << s;
}

}  // namespace
}  // namespace moe_ep::core::quant
