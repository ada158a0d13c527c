#include "core/quantized_expert_compute.h"

#include <algorithm>
#include <array>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/fp8_e4m3.h"
#include "core/parallel_for.h"
#include "core/status_macros.h"

// Compiled with -ffp-contract=off (core/CMakeLists.txt): every multiply and
// add below rounds on its own, as core/quantized_formats.h defines.

namespace moe_ep::core::quant {
namespace {

// Output rows of one weight tile; the inner loops run over a whole tile
// (padded with zeros) so the compiler vectorizes them across outputs while
// each output keeps its sequential order in k.
constexpr int64_t kTileRows = 128;

// Tiles a thread takes at least: about 4 M multiply-adds (a millisecond), so
// small GEMMs stay on the calling thread.
int64_t MinTilesPerThread(int64_t rows, int64_t k) {
  const int64_t per_tile = kTileRows * k * (rows + 1);
  return std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(per_tile, 1));
}

const std::array<float, 256>& E4m3Table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int c = 0; c < 256; ++c) t[c] = fp8::E4m3ToFloat(static_cast<uint8_t>(c));
    return t;
  }();
  return table;
}

// p[n] = p[n] + a * w[n] for n in [0, kTileRows).
inline void AxpyTile(float a, const float* __restrict w, float* __restrict p) {
  for (int64_t n = 0; n < kTileRows; ++n) p[n] = p[n] + a * w[n];
}

absl::Status CheckSpan(const char* what, size_t got, int64_t need) {
  if (static_cast<int64_t>(got) < need) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: expected at least %d elements, got %d", what, need, got));
  }
  return absl::OkStatus();
}

}  // namespace

Fp8Activations Fp8QuantizeActivations(absl::Span<const float> x, int64_t rows, int64_t cols) {
  Fp8Activations a;
  a.rows = rows;
  a.cols = cols;
  a.codes.resize(rows * cols);
  a.scales.resize(rows * Fp8ScaleBlocks(cols));
  for (int64_t r = 0; r < rows; ++r) {
    Fp8QuantizeActivationRow(x.data() + r * cols, cols, a.codes.data() + r * cols,
                             a.scales.data() + r * Fp8ScaleBlocks(cols));
  }
  return a;
}

absl::Status Fp8BlockGemm(const Fp8Activations& a, const Fp8BlockMatrix& w, absl::Span<float> out) {
  if (a.cols != w.cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Fp8BlockGemm: activations have %d channels, the weight [%d, %d] expects %d", a.cols,
        w.rows, w.cols, w.cols));
  }
  RETURN_IF_ERROR(CheckSpan("Fp8BlockGemm: out", out.size(), a.rows * w.rows));
  const int64_t M = a.rows, N = w.rows, K = w.cols;
  const int64_t nkb = Fp8ScaleBlocks(K);
  std::fill(out.begin(), out.begin() + M * N, 0.0f);
  if (M == 0 || N == 0) return absl::OkStatus();
  const std::array<float, 256>& lut = E4m3Table();
  ParallelFor(Fp8ScaleBlocks(N), MinTilesPerThread(M, K), [&](int64_t nb_begin, int64_t nb_end) {
    std::vector<float> tile(kFp8Block * kTileRows);  // [k, n]
    std::vector<float> p(kTileRows);
    for (int64_t nb = nb_begin; nb < nb_end; ++nb) {
      const int64_t n0 = nb * kTileRows, nlen = std::min(kTileRows, N - n0);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * kFp8Block, klen = std::min<int64_t>(kFp8Block, K - k0);
        std::fill(tile.begin(), tile.end(), 0.0f);
        for (int64_t n = 0; n < nlen; ++n) {
          const uint8_t* row = w.codes.data() + (n0 + n) * K + k0;
          for (int64_t k = 0; k < klen; ++k) tile[k * kTileRows + n] = lut[row[k]];
        }
        const float w_scale = w.scale_inv[nb * nkb + kb];
        for (int64_t m = 0; m < M; ++m) {
          std::fill(p.begin(), p.end(), 0.0f);
          const uint8_t* arow = a.codes.data() + m * K + k0;
          for (int64_t k = 0; k < klen; ++k)
            AxpyTile(lut[arow[k]], tile.data() + k * kTileRows, p.data());
          const float a_scale = a.scales[m * nkb + kb];
          float* dst = out.data() + m * N + n0;
          for (int64_t n = 0; n < nlen; ++n)
            dst[n] = Fp8PromoteBlock(dst[n], p[n], a_scale, w_scale);
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status Mxfp4Gemm(absl::Span<const float> a, int64_t rows, const Mxfp4Matrix& w,
                       absl::Span<const bf16_t> bias, absl::Span<float> out) {
  const int64_t M = rows, N = w.rows, K = w.cols;
  RETURN_IF_ERROR(CheckMxfp4Matrix(w, N, K, "Mxfp4Gemm: weight"));
  RETURN_IF_ERROR(CheckSpan("Mxfp4Gemm: a", a.size(), M * K));
  RETURN_IF_ERROR(CheckSpan("Mxfp4Gemm: out", out.size(), M * N));
  if (!bias.empty() && static_cast<int64_t>(bias.size()) != N) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Mxfp4Gemm: bias: expected %d values (the weight's rows) or none, got %d", N, bias.size()));
  }
  if (M == 0 || N == 0) return absl::OkStatus();
  const int64_t nkb = K / kMxfp4Block;
  std::array<float, 16> e2m1{};
  for (int c = 0; c < 16; ++c) e2m1[c] = E2m1ToFloat(static_cast<uint8_t>(c));
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  ParallelFor(num_tiles, MinTilesPerThread(M, K), [&](int64_t t_begin, int64_t t_end) {
    std::vector<float> tile(kMxfp4Block * kTileRows);  // [k, n]
    std::vector<float> acc(M * kTileRows);
    for (int64_t t = t_begin; t < t_end; ++t) {
      const int64_t n0 = t * kTileRows, nlen = std::min(kTileRows, N - n0);
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(tile.begin(), tile.end(), 0.0f);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        for (int64_t n = 0; n < nlen; ++n) {
          const int64_t b = (n0 + n) * nkb + kb;
          const float scale = E8m0ToFloat(w.scales[b]);
          const uint8_t* bytes = w.blocks.data() + b * kMxfp4BlockBytes;
          for (int k = 0; k < kMxfp4Block; ++k) {
            tile[k * kTileRows + n] = fp8::MulRn(e2m1[Mxfp4Nibble(bytes, k)], scale);
          }
        }
        const int64_t k0 = kb * kMxfp4Block;
        for (int64_t m = 0; m < M; ++m) {
          const float* arow = a.data() + m * K + k0;
          float* p = acc.data() + m * kTileRows;
          for (int k = 0; k < kMxfp4Block; ++k) AxpyTile(arow[k], tile.data() + k * kTileRows, p);
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        float* dst = out.data() + m * N + n0;
        const float* p = acc.data() + m * kTileRows;
        for (int64_t n = 0; n < nlen; ++n) {
          dst[n] = bias.empty() ? p[n] : AddRn(p[n], Bf16ToFloat(bias[n0 + n]));
        }
      }
    }
  });
  return absl::OkStatus();
}

absl::Status Fp8SwiGluForward(const Fp8SwiGluWeights& w, absl::Span<const float> x, int64_t rows,
                              absl::Span<float> out, Fp8SwiGluTrace* trace) {
  const int64_t I = w.gate.rows, H = w.gate.cols;
  RETURN_IF_ERROR(CheckFp8BlockMatrix(w.gate, I, H, "fp8 SwiGLU gate"));
  RETURN_IF_ERROR(CheckFp8BlockMatrix(w.up, I, H, "fp8 SwiGLU up"));
  RETURN_IF_ERROR(CheckFp8BlockMatrix(w.down, H, I, "fp8 SwiGLU down"));
  if (rows < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("rows: expected >= 0, got %d", rows));
  }
  RETURN_IF_ERROR(CheckSpan("Fp8SwiGluForward: x", x.size(), rows * H));
  RETURN_IF_ERROR(CheckSpan("Fp8SwiGluForward: out", out.size(), rows * H));
  Fp8SwiGluTrace local;
  Fp8SwiGluTrace& t = trace != nullptr ? *trace : local;
  t.x_q = Fp8QuantizeActivations(x, rows, H);
  t.g.assign(rows * I, 0.0f);
  t.u.assign(rows * I, 0.0f);
  RETURN_IF_ERROR(Fp8BlockGemm(t.x_q, w.gate, absl::MakeSpan(t.g)));
  RETURN_IF_ERROR(Fp8BlockGemm(t.x_q, w.up, absl::MakeSpan(t.u)));
  t.h.resize(rows * I);
  for (int64_t i = 0; i < rows * I; ++i) t.h[i] = SwiGluSilu(t.g[i]) * t.u[i];
  t.h_q = Fp8QuantizeActivations(t.h, rows, I);
  return Fp8BlockGemm(t.h_q, w.down, out);
}

absl::Status GptOssExpertForward(const GptOssExpertWeights& w, absl::Span<const float> x,
                                 int64_t rows, const GptOssActivation& act, absl::Span<float> out,
                                 GptOssTrace* trace) {
  const int64_t I2 = w.gate_up.rows, H = w.gate_up.cols, I = I2 / 2;
  if (I2 % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "gpt-oss gate_up: rows: expected 2 * intermediate (interleaved gate/up), got %d", I2));
  }
  RETURN_IF_ERROR(CheckMxfp4Matrix(w.gate_up, I2, H, "gpt-oss gate_up"));
  RETURN_IF_ERROR(CheckMxfp4Matrix(w.down, H, I, "gpt-oss down"));
  if (static_cast<int64_t>(w.gate_up_bias.size()) != I2 ||
      static_cast<int64_t>(w.down_bias.size()) != H) {
    return absl::InvalidArgumentError(
        absl::StrFormat("gpt-oss biases: expected gate_up [%d] and down [%d], got [%d] and [%d]",
                        I2, H, w.gate_up_bias.size(), w.down_bias.size()));
  }
  if (rows < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("rows: expected >= 0, got %d", rows));
  }
  RETURN_IF_ERROR(CheckSpan("GptOssExpertForward: x", x.size(), rows * H));
  RETURN_IF_ERROR(CheckSpan("GptOssExpertForward: out", out.size(), rows * H));
  GptOssTrace local;
  GptOssTrace& t = trace != nullptr ? *trace : local;
  t.a.resize(rows * H);
  for (int64_t i = 0; i < rows * H; ++i) t.a[i] = Bf16ToFloat(FloatToBf16(x[i]));
  t.y.assign(rows * I2, 0.0f);
  RETURN_IF_ERROR(Mxfp4Gemm(t.a, rows, w.gate_up, w.gate_up_bias, absl::MakeSpan(t.y)));
  t.h.resize(rows * I);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < I; ++j) {
      const float h = GptOssGlu(t.y[r * I2 + 2 * j], t.y[r * I2 + 2 * j + 1], act.alpha, act.limit);
      t.h[r * I + j] = Bf16ToFloat(FloatToBf16(h));
    }
  }
  return Mxfp4Gemm(t.h, rows, w.down, w.down_bias, out);
}

}  // namespace moe_ep::core::quant
