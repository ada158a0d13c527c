#include "core/quantized_weights.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/fp8_e4m3.h"
#include "core/parallel_for.h"
#include "core/seeded_stream.h"
#include "core/status_macros.h"

namespace moe_ep::core::quant {
namespace {

// Rows of 128 per thread at least (a 128 x 7168 stripe is ~1 ms of work).
constexpr int64_t kMinStripesPerThread = 1;

std::string ShapeText(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// The view of `name`, of dtype one of `dtypes` and shape `shape`.
absl::StatusOr<SafetensorsTensorView> FindTensor(SafetensorsCheckpoint& ckpt,
                                                 const std::string& name,
                                                 const std::vector<SafetensorsDType>& dtypes,
                                                 const std::vector<int64_t>& shape,
                                                 const std::string& what) {
  ASSIGN_OR_RETURN(SafetensorsTensorView view, ckpt.Find(name));
  if (std::find(dtypes.begin(), dtypes.end(), view.dtype) == dtypes.end()) {
    std::vector<std::string> names;
    names.reserve(dtypes.size());
    for (SafetensorsDType d : dtypes) names.push_back(SafetensorsDTypeName(d));
    return absl::InvalidArgumentError(
        absl::StrCat("tensor \"", name, "\" (", what, "): dtype: expected ",
                     absl::StrJoin(names, " or "), ", got ", SafetensorsDTypeName(view.dtype)));
  }
  if (view.shape != shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", name, "\" (", what,
                                                   "): shape: expected ", ShapeText(shape),
                                                   ", got ", ShapeText(view.shape)));
  }
  return view;
}

float LoadF32(const uint8_t* p) {
  uint32_t bits = static_cast<uint32_t>(p[0]) | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) |
                  (uint32_t{p[3]} << 24);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

std::vector<uint8_t> F32Bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t bits = fp8::FloatBits(v[i]);
    for (int b = 0; b < 4; ++b) out[4 * i + b] = static_cast<uint8_t>(bits >> (8 * b));
  }
  return out;
}

std::vector<uint8_t> Bf16Bytes(const std::vector<bf16_t>& v) {
  std::vector<uint8_t> out(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    out[2 * i] = static_cast<uint8_t>(v[i]);
    out[2 * i + 1] = static_cast<uint8_t>(v[i] >> 8);
  }
  return out;
}

// Seeded bf16 tensor `proj` of (seed, layer, expert) with n elements and the
// uniform range of `fan_in`: the bits ExpertSet::GenerateSwiGlu makes.
std::vector<bf16_t> SeededTensor(uint64_t seed, int layer, int expert, SeededProjection proj,
                                 int64_t n, int64_t fan_in) {
  const uint64_t key = SeededTensorKey(seed, layer, expert, proj);
  const SeededUniform range = SeededUniformFor(fan_in);
  std::vector<bf16_t> out(n);
  const int64_t pairs = (n + 1) / 2;
  ParallelFor(pairs, int64_t{1} << 18, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      if (2 * c + 1 < n) {
        const SeededBf16Pair pair = SeededPair(key, c, range);
        out[2 * c] = pair.first;
        out[2 * c + 1] = pair.second;
      } else {
        out[2 * c] = SeededElement(key, 2 * c, range);
      }
    }
  });
  return out;
}

absl::Status CheckDims(int64_t hidden, int64_t intermediate, bool mxfp4) {
  if (hidden < 1 || (mxfp4 && hidden % kMxfp4Block != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden: expected >= 1",
                     mxfp4 ? " and a multiple of 32 (the mxfp4 block)" : "", ", got ", hidden));
  }
  if (intermediate < 1 || (mxfp4 && intermediate % kMxfp4Block != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "intermediate: expected >= 1", mxfp4 ? " and a multiple of 32 (the mxfp4 block)" : "",
        ", got ", intermediate));
  }
  return absl::OkStatus();
}

}  // namespace

const char* ExpertWeightFormatName(ExpertWeightFormat format) {
  switch (format) {
    case ExpertWeightFormat::kBf16:
      return "bf16";
    case ExpertWeightFormat::kFp8Block128:
      return "fp8-block128";
    case ExpertWeightFormat::kMxfp4:
      return "mxfp4";
  }
  return "?";
}

double Fp8BlockMatrix::Value(int64_t n, int64_t k) const {
  return static_cast<double>(fp8::E4m3ToFloat(codes[n * cols + k])) *
         static_cast<double>(ScaleInv(n, k));
}

int64_t Fp8BlockMatrix::bytes() const {
  return static_cast<int64_t>(codes.size() + 4 * scale_inv.size());
}

int64_t Mxfp4Matrix::bytes() const { return static_cast<int64_t>(blocks.size() + scales.size()); }

int64_t MatrixBytes(ExpertWeightFormat format, int64_t rows, int64_t cols) {
  switch (format) {
    case ExpertWeightFormat::kBf16:
      return 2 * rows * cols;
    case ExpertWeightFormat::kFp8Block128:
      return rows * cols + 4 * Fp8ScaleBlocks(rows) * Fp8ScaleBlocks(cols);
    case ExpertWeightFormat::kMxfp4:
      return rows * (cols / kMxfp4Block) * (kMxfp4BlockBytes + 1);
  }
  return 0;
}

int64_t ExpertWeightBytes(ExpertWeightFormat format, int64_t hidden, int64_t intermediate) {
  if (format == ExpertWeightFormat::kMxfp4) {
    return MatrixBytes(format, 2 * intermediate, hidden) +
           MatrixBytes(format, hidden, intermediate) + 2 * (2 * intermediate + hidden);
  }
  return 2 * MatrixBytes(format, intermediate, hidden) + MatrixBytes(format, hidden, intermediate);
}

absl::Status CheckFp8BlockMatrix(const Fp8BlockMatrix& m, int64_t rows, int64_t cols,
                                 const std::string& name) {
  if (m.rows != rows || m.cols != cols) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: shape: expected [%d, %d], got [%d, %d]",
                                                      name, rows, cols, m.rows, m.cols));
  }
  if (static_cast<int64_t>(m.codes.size()) != rows * cols) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: codes: expected rows * cols = %d bytes, got %d", name, rows * cols, m.codes.size()));
  }
  if (static_cast<int64_t>(m.scale_inv.size()) != m.scale_rows() * m.scale_cols()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: scale_inv: expected [ceil(%d/128), ceil(%d/128)] = [%d, %d] = %d values (one per "
        "128 x 128 block), got %d",
        name, rows, cols, m.scale_rows(), m.scale_cols(), m.scale_rows() * m.scale_cols(),
        m.scale_inv.size()));
  }
  return absl::OkStatus();
}

absl::Status CheckMxfp4Matrix(const Mxfp4Matrix& m, int64_t rows, int64_t cols,
                              const std::string& name) {
  if (m.rows != rows || m.cols != cols) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: shape: expected [%d, %d], got [%d, %d]",
                                                      name, rows, cols, m.rows, m.cols));
  }
  if (cols % kMxfp4Block != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: cols: expected a multiple of 32 (the mxfp4 block), got %d", name, cols));
  }
  const int64_t nblocks = rows * (cols / kMxfp4Block);
  if (static_cast<int64_t>(m.blocks.size()) != nblocks * kMxfp4BlockBytes) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: blocks: expected [%d, %d, 16] = %d bytes, got %d", name, rows,
                        cols / kMxfp4Block, nblocks * kMxfp4BlockBytes, m.blocks.size()));
  }
  if (static_cast<int64_t>(m.scales.size()) != nblocks) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: scales: expected [%d, %d] = %d bytes (one per 32 values), got %d",
                        name, rows, cols / kMxfp4Block, nblocks, m.scales.size()));
  }
  return absl::OkStatus();
}

Fp8BlockMatrix QuantizeFp8Block(const std::vector<bf16_t>& w, int64_t rows, int64_t cols) {
  Fp8BlockMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.codes.resize(rows * cols);
  m.scale_inv.resize(m.scale_rows() * m.scale_cols());
  const int64_t scale_cols = m.scale_cols();
  ParallelFor(m.scale_rows(), kMinStripesPerThread, [&](int64_t begin, int64_t end) {
    for (int64_t rb = begin; rb < end; ++rb) {
      const int64_t r0 = rb * kFp8Block, r1 = std::min(rows, r0 + kFp8Block);
      for (int64_t cb = 0; cb < scale_cols; ++cb) {
        const int64_t c0 = cb * kFp8Block, c1 = std::min(cols, c0 + kFp8Block);
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, fp8::Bf16Abs(w[r * cols + c]));
        }
        const float scale = fp8::BlockScale(amax);
        m.scale_inv[rb * scale_cols + cb] = scale;
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c = c0; c < c1; ++c) {
            m.codes[r * cols + c] = fp8::QuantizeValue(w[r * cols + c], scale);
          }
        }
      }
    }
  });
  return m;
}

Mxfp4Matrix QuantizeMxfp4(const std::vector<bf16_t>& w, int64_t rows, int64_t cols) {
  Mxfp4Matrix m;
  m.rows = rows;
  m.cols = cols;
  const int64_t per_row = cols / kMxfp4Block;
  m.blocks.assign(rows * per_row * kMxfp4BlockBytes, 0);
  m.scales.resize(rows * per_row);
  ParallelFor(rows * per_row, int64_t{1} << 14, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const bf16_t* src = w.data() + b * kMxfp4Block;
      float amax = 0.0f;
      for (int i = 0; i < kMxfp4Block; ++i) amax = std::max(amax, fp8::Bf16Abs(src[i]));
      const uint8_t scale_byte = Mxfp4ScaleFor(amax);
      m.scales[b] = scale_byte;
      const float scale = E8m0ToFloat(scale_byte);
      uint8_t* dst = m.blocks.data() + b * kMxfp4BlockBytes;
      for (int i = 0; i < kMxfp4Block; ++i) {
        // Division by a power of two: exact unless it underflows.
        const uint8_t code = E2m1FromFloat(fp8::DivRn(fp8::Bf16Value(src[i]), scale));
        dst[i / 2] |= static_cast<uint8_t>(i % 2 == 0 ? code : code << 4);
      }
    }
  });
  return m;
}

absl::StatusOr<Fp8SwiGluWeights> GenerateFp8SwiGlu(uint64_t seed, int layer, int expert,
                                                   int64_t hidden, int64_t intermediate) {
  RETURN_IF_ERROR(CheckDims(hidden, intermediate, false));
  const int64_t n = hidden * intermediate;
  Fp8SwiGluWeights w;
  w.gate = QuantizeFp8Block(SeededTensor(seed, layer, expert, SeededProjection::kGate, n, hidden),
                            intermediate, hidden);
  w.up = QuantizeFp8Block(SeededTensor(seed, layer, expert, SeededProjection::kUp, n, hidden),
                          intermediate, hidden);
  w.down =
      QuantizeFp8Block(SeededTensor(seed, layer, expert, SeededProjection::kDown, n, intermediate),
                       hidden, intermediate);
  return w;
}

absl::StatusOr<GptOssExpertWeights> GenerateGptOssExpert(uint64_t seed, int layer, int expert,
                                                         int64_t hidden, int64_t intermediate) {
  RETURN_IF_ERROR(CheckDims(hidden, intermediate, true));
  const int64_t n = hidden * intermediate;
  const std::vector<bf16_t> gate =
      SeededTensor(seed, layer, expert, SeededProjection::kGate, n, hidden);
  const std::vector<bf16_t> up =
      SeededTensor(seed, layer, expert, SeededProjection::kUp, n, hidden);
  std::vector<bf16_t> gate_up(2 * n);
  for (int64_t j = 0; j < intermediate; ++j) {
    std::copy_n(gate.begin() + j * hidden, hidden, gate_up.begin() + (2 * j) * hidden);
    std::copy_n(up.begin() + j * hidden, hidden, gate_up.begin() + (2 * j + 1) * hidden);
  }
  GptOssExpertWeights w;
  w.gate_up = QuantizeMxfp4(gate_up, 2 * intermediate, hidden);
  w.down =
      QuantizeMxfp4(SeededTensor(seed, layer, expert, SeededProjection::kDown, n, intermediate),
                    hidden, intermediate);
  w.gate_up_bias =
      SeededTensor(seed, layer, expert, SeededProjection::kGateUpBias, 2 * intermediate, hidden);
  w.down_bias =
      SeededTensor(seed, layer, expert, SeededProjection::kDownBias, hidden, intermediate);
  return w;
}

absl::StatusOr<Fp8BlockTensorViews> FindFp8BlockMatrix(SafetensorsCheckpoint& ckpt,
                                                       const std::string& weight_name,
                                                       const std::string& scale_name, int64_t rows,
                                                       int64_t cols) {
  ASSIGN_OR_RETURN(SafetensorsTensorView weight,
                   FindTensor(ckpt, weight_name, {SafetensorsDType::kF8E4M3}, {rows, cols},
                              "fp8 e4m3 block-scaled weight"));
  absl::StatusOr<SafetensorsTensorView> found = ckpt.Find(scale_name);
  if (!found.ok()) {
    if (absl::IsNotFound(found.status())) {
      return absl::NotFoundError(absl::StrCat("tensor \"", weight_name, "\": its scale tensor \"",
                                              scale_name, "\" is missing (",
                                              found.status().message(), ")"));
    }
    return found.status();
  }
  const std::vector<int64_t> grid = {Fp8ScaleBlocks(rows), Fp8ScaleBlocks(cols)};
  if (found->dtype != SafetensorsDType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("tensor \"", scale_name, "\" (scale_inv of \"",
                                                   weight_name, "\"): dtype: expected F32, got ",
                                                   SafetensorsDTypeName(found->dtype)));
  }
  if (found->shape != grid) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor \"", scale_name, "\" (scale_inv of \"", weight_name, "\" ", ShapeText({rows, cols}),
        "): shape: expected ", ShapeText(grid),
        " (one scale per 128 x 128 block, tiling the weight), got ", ShapeText(found->shape)));
  }
  return Fp8BlockTensorViews{std::move(weight), *std::move(found)};
}

absl::StatusOr<Fp8BlockMatrix> ReadFp8BlockMatrix(SafetensorsCheckpoint& ckpt,
                                                  const std::string& weight_name,
                                                  const std::string& scale_name, int64_t rows,
                                                  int64_t cols) {
  ASSIGN_OR_RETURN(const Fp8BlockTensorViews views,
                   FindFp8BlockMatrix(ckpt, weight_name, scale_name, rows, cols));
  Fp8BlockMatrix m;
  m.rows = rows;
  m.cols = cols;
  m.codes.assign(views.weight.data.begin(), views.weight.data.end());
  m.scale_inv.resize(Fp8ScaleBlocks(rows) * Fp8ScaleBlocks(cols));
  for (size_t i = 0; i < m.scale_inv.size(); ++i) {
    m.scale_inv[i] = LoadF32(views.scale_inv.data.data() + 4 * i);
  }
  return m;
}

absl::StatusOr<std::vector<GptOssExpertWeights>> ReadGptOssExperts(
    SafetensorsCheckpoint& ckpt, const std::string& prefix, int layer, int num_experts,
    const std::vector<int>& expert_ids, int64_t hidden, int64_t intermediate) {
  RETURN_IF_ERROR(CheckDims(hidden, intermediate, true));
  for (int e : expert_ids) {
    if (e < 0 || e >= num_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("expert_ids: expected ids in [0, ", num_experts, "), got ", e));
    }
  }
  const std::string base = absl::StrReplaceAll(prefix, {{"{layer}", absl::StrCat(layer)}});
  const int64_t E = num_experts, I2 = 2 * intermediate, H = hidden, I = intermediate;
  const std::vector<SafetensorsDType> u8 = {SafetensorsDType::kU8};
  const std::vector<SafetensorsDType> floats = {SafetensorsDType::kBF16, SafetensorsDType::kF16,
                                                SafetensorsDType::kF32};
  ASSIGN_OR_RETURN(SafetensorsTensorView gu_blocks,
                   FindTensor(ckpt, base + "gate_up_proj_blocks", u8, {E, I2, H / 32, 16},
                              "mxfp4 blocks [experts, 2 * intermediate, hidden / 32, 16]"));
  ASSIGN_OR_RETURN(SafetensorsTensorView gu_scales,
                   FindTensor(ckpt, base + "gate_up_proj_scales", u8, {E, I2, H / 32},
                              "E8M0 scales [experts, 2 * intermediate, hidden / 32]"));
  ASSIGN_OR_RETURN(SafetensorsTensorView gu_bias,
                   FindTensor(ckpt, base + "gate_up_proj_bias", floats, {E, I2},
                              "bias [experts, 2 * intermediate]"));
  ASSIGN_OR_RETURN(SafetensorsTensorView d_blocks,
                   FindTensor(ckpt, base + "down_proj_blocks", u8, {E, H, I / 32, 16},
                              "mxfp4 blocks [experts, hidden, intermediate / 32, 16]"));
  ASSIGN_OR_RETURN(SafetensorsTensorView d_scales,
                   FindTensor(ckpt, base + "down_proj_scales", u8, {E, H, I / 32},
                              "E8M0 scales [experts, hidden, intermediate / 32]"));
  ASSIGN_OR_RETURN(SafetensorsTensorView d_bias, FindTensor(ckpt, base + "down_proj_bias", floats,
                                                            {E, H}, "bias [experts, hidden]"));
  std::vector<GptOssExpertWeights> out(expert_ids.size());
  const auto slice = [](const SafetensorsTensorView& v, int64_t e, int64_t per_expert) {
    const uint8_t* p = v.data.data() + e * per_expert;
    return std::vector<uint8_t>(p, p + per_expert);
  };
  for (size_t i = 0; i < expert_ids.size(); ++i) {
    const int64_t e = expert_ids[i];
    GptOssExpertWeights& w = out[i];
    w.gate_up.rows = I2;
    w.gate_up.cols = H;
    w.gate_up.blocks = slice(gu_blocks, e, I2 * (H / 32) * 16);
    w.gate_up.scales = slice(gu_scales, e, I2 * (H / 32));
    w.down.rows = H;
    w.down.cols = I;
    w.down.blocks = slice(d_blocks, e, H * (I / 32) * 16);
    w.down.scales = slice(d_scales, e, H * (I / 32));
    w.gate_up_bias.resize(I2);
    w.down_bias.resize(H);
    RETURN_IF_ERROR(SafetensorsToBf16(gu_bias, e * I2, absl::MakeSpan(w.gate_up_bias)));
    RETURN_IF_ERROR(SafetensorsToBf16(d_bias, e * H, absl::MakeSpan(w.down_bias)));
  }
  return out;
}

std::vector<SafetensorsTensor> GptOssTensors(const std::vector<GptOssExpertWeights>& experts,
                                             const std::string& prefix, int layer) {
  const std::string base = absl::StrReplaceAll(prefix, {{"{layer}", absl::StrCat(layer)}});
  const int64_t E = static_cast<int64_t>(experts.size());
  const int64_t I2 = experts.empty() ? 0 : experts[0].gate_up.rows;
  const int64_t H = experts.empty() ? 0 : experts[0].gate_up.cols;
  const int64_t I = I2 / 2;
  SafetensorsTensor gu_blocks{
      base + "gate_up_proj_blocks", SafetensorsDType::kU8, {E, I2, H / 32, 16}, {}};
  SafetensorsTensor gu_scales{
      base + "gate_up_proj_scales", SafetensorsDType::kU8, {E, I2, H / 32}, {}};
  SafetensorsTensor gu_bias{base + "gate_up_proj_bias", SafetensorsDType::kBF16, {E, I2}, {}};
  SafetensorsTensor d_blocks{
      base + "down_proj_blocks", SafetensorsDType::kU8, {E, H, I / 32, 16}, {}};
  SafetensorsTensor d_scales{base + "down_proj_scales", SafetensorsDType::kU8, {E, H, I / 32}, {}};
  SafetensorsTensor d_bias{base + "down_proj_bias", SafetensorsDType::kBF16, {E, H}, {}};
  for (const GptOssExpertWeights& w : experts) {
    const auto append = [](std::vector<uint8_t>& dst, const std::vector<uint8_t>& src) {
      dst.insert(dst.end(), src.begin(), src.end());
    };
    append(gu_blocks.data, w.gate_up.blocks);
    append(gu_scales.data, w.gate_up.scales);
    append(gu_bias.data, Bf16Bytes(w.gate_up_bias));
    append(d_blocks.data, w.down.blocks);
    append(d_scales.data, w.down.scales);
    append(d_bias.data, Bf16Bytes(w.down_bias));
  }
  return {std::move(gu_blocks), std::move(gu_scales), std::move(gu_bias),
          std::move(d_blocks),  std::move(d_scales),  std::move(d_bias)};
}

std::vector<SafetensorsTensor> Fp8Tensors(const Fp8BlockMatrix& m, const std::string& weight_name,
                                          const std::string& scale_name) {
  return {{weight_name, SafetensorsDType::kF8E4M3, {m.rows, m.cols}, m.codes},
          {scale_name,
           SafetensorsDType::kF32,
           {m.scale_rows(), m.scale_cols()},
           F32Bytes(m.scale_inv)}};
}

}  // namespace moe_ep::core::quant
