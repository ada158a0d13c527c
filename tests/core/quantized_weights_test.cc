// Quantized expert weights (core/quantized_weights.h; issue 35 items 1-2):
// sizes against the issue's check values, quantization round trips, and the
// published checkpoint layouts written to files (DeepSeek-V3's per-expert
// F8_E4M3 + weight_scale_inv, gpt-oss's fused U8 blocks / scales + biases)
// and read back bit for bit; each malformed tensor is an error naming it.
#include "core/quantized_weights.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/expert_source.h"
#include "core/experts.h"
#include "core/fp8_e4m3.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core::quant {
namespace quantized_weights_test {
namespace {

using ::testing::HasSubstr;

constexpr char kDeepSeekPattern[] = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight";

std::string TempPath(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / name).string();
}

std::vector<bf16_t> Ramp(int64_t n, float step) {
  std::vector<bf16_t> w(n);
  for (int64_t i = 0; i < n; ++i) w[i] = FloatToBf16(step * static_cast<float>(i % 37 - 18));
  return w;
}

TEST(ExpertWeightBytes, IssueCheckValues) {
  // DeepSeek-V3: 3 * 2048 * 7168 = 44,040,192 weights an expert.
  EXPECT_EQ(ExpertWeightBytes(ExpertWeightFormat::kBf16, 7168, 2048), 88080384);
  EXPECT_EQ(ExpertWeightBytes(ExpertWeightFormat::kFp8Block128, 7168, 2048), 44040192 + 10752);
  // gpt-oss: gate_up [5760, 2880] + down [2880, 2880] at 17/32 + biases.
  EXPECT_EQ(ExpertWeightBytes(ExpertWeightFormat::kMxfp4, 2880, 2880), 13219200 + 17280);
  // Ragged fp8 blocks: [200, 300] has a 2 x 3 scale grid.
  EXPECT_EQ(MatrixBytes(ExpertWeightFormat::kFp8Block128, 200, 300), 60000 + 24);
  EXPECT_STREQ(ExpertWeightFormatName(ExpertWeightFormat::kFp8Block128), "fp8-block128");
}

TEST(QuantizeFp8Block, ScalePerBlockAndRoundTrip) {
  // [200, 300]: blocks (0,0) .. (1,2); block (1, 2) is rows 128..199, cols
  // 256..299. The ramp's amax in each block is 18 * step.
  const std::vector<bf16_t> w = Ramp(200 * 300, 0.01f);
  const Fp8BlockMatrix m = QuantizeFp8Block(w, 200, 300);
  ASSERT_TRUE(CheckFp8BlockMatrix(m, 200, 300, "m").ok());
  for (int64_t rb = 0; rb < 2; ++rb) {
    for (int64_t cb = 0; cb < 3; ++cb) {
      float amax = 0.0f;
      for (int64_t r = rb * 128; r < std::min<int64_t>(200, rb * 128 + 128); ++r) {
        for (int64_t c = cb * 128; c < std::min<int64_t>(300, cb * 128 + 128); ++c) {
          amax = std::max(amax, std::abs(Bf16ToFloat(w[r * 300 + c])));
        }
      }
      EXPECT_EQ(m.scale_inv[rb * 3 + cb], amax / 448.0f) << rb << " " << cb;
    }
  }
  // Each dequantized weight is within e4m3's half ulp (2^-4 relative) plus
  // the subnormal step of its block.
  for (int64_t i = 0; i < 200 * 300; ++i) {
    const int64_t r = i / 300, c = i % 300;
    const double v = Bf16ToFloat(w[i]);
    EXPECT_LE(std::abs(m.Value(r, c) - v),
              std::ldexp(std::abs(v), -4) + std::ldexp(m.ScaleInv(r, c), -10))
        << r << " " << c;
  }
}

TEST(QuantizeMxfp4, SharedExponentAndRoundTrip) {
  const std::vector<bf16_t> w = Ramp(3 * 64, 0.125f);
  const Mxfp4Matrix m = QuantizeMxfp4(w, 3, 64);
  ASSERT_TRUE(CheckMxfp4Matrix(m, 3, 64, "m").ok());
  for (int64_t b = 0; b < 6; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::abs(Bf16ToFloat(w[b * 32 + i])));
    EXPECT_EQ(m.scales[b], 127 + static_cast<int>(std::floor(std::log2(amax))) - 2) << b;
  }
  // Each value comes back within half a grid step (at most 1 at the top of
  // the grid) or, above 6, its saturation (< 2), times the scale; values on
  // the grid (multiples of 0.125 below 0.75 here) exactly.
  for (int64_t i = 0; i < 3 * 64; ++i) {
    const double v = Bf16ToFloat(w[i]);
    const double scale = E8m0ToFloat(m.scales[i / 32]);
    const double got = m.Value(i / 64, i % 64);
    EXPECT_LE(std::abs(got - v), 2 * scale) << i;
    if (std::abs(v) <= 0.75 && scale == 0.5) {
      EXPECT_NEAR(got, v, 0.125 + 1e-9) << i;
    }
    EXPECT_EQ(std::signbit(got), std::signbit(v)) << i;  // e2m1 keeps the sign of a zero
  }
}

// DeepSeek-V3's per-expert layout: F8_E4M3 weights and F32 weight_scale_inv.
std::vector<SafetensorsTensor> DeepSeekTensors(const ExpertSet& set, int layer) {
  std::vector<SafetensorsTensor> out;
  const SeededProjection projs[3] = {SeededProjection::kGate, SeededProjection::kUp,
                                     SeededProjection::kDown};
  for (int l = 0; l < set.num_experts(); ++l) {
    const Fp8SwiGluWeights& w = set.fp8_weights(l);
    const Fp8BlockMatrix* parts[3] = {&w.gate, &w.up, &w.down};
    for (int p = 0; p < 3; ++p) {
      const std::string name =
          ExpertTensorName(kDeepSeekPattern, layer, set.first_expert() + l, projs[p]);
      for (SafetensorsTensor& t : Fp8Tensors(*parts[p], name, name + "_scale_inv")) {
        out.push_back(std::move(t));
      }
    }
  }
  return out;
}

ExpertSource Fp8Source(const std::string& path, int first, int count, int64_t h, int64_t i) {
  ExpertSource s = ExpertSource::Safetensors(path, kDeepSeekPattern, 3, 8, first, count, h, i);
  s.weight_format = ExpertWeightFormat::kFp8Block128;
  return s;
}

TEST(ReadFp8BlockMatrix, DeepSeekLayoutBitForBit) {
  // H 256, I 200 (a ragged scale row), experts 2..3 of 8 in layer 3.
  absl::StatusOr<ExpertSet> seeded = ExpertSet::GenerateFp8SwiGlu(5, 3, 2, 2, 256, 200);
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  std::vector<SafetensorsTensor> tensors = DeepSeekTensors(*seeded, 3);
  // The published names, dtypes and shapes.
  EXPECT_EQ(tensors[0].name, "model.layers.3.mlp.experts.2.gate_proj.weight");
  EXPECT_EQ(tensors[0].dtype, SafetensorsDType::kF8E4M3);
  EXPECT_EQ(tensors[0].shape, (std::vector<int64_t>{200, 256}));
  EXPECT_EQ(tensors[1].name, "model.layers.3.mlp.experts.2.gate_proj.weight_scale_inv");
  EXPECT_EQ(tensors[1].dtype, SafetensorsDType::kF32);
  EXPECT_EQ(tensors[1].shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(tensors[5].name, "model.layers.3.mlp.experts.2.down_proj.weight_scale_inv");
  EXPECT_EQ(tensors[5].shape, (std::vector<int64_t>{2, 2}));
  const std::string path = TempPath("deepseek_fp8.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());

  absl::StatusOr<ExpertSet> loaded = MakeHostExperts(Fp8Source(path, 2, 2, 256, 200));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->kind(), ExpertKind::kFp8SwiGlu);
  EXPECT_EQ(loaded->weight_bytes(),
            2 * ExpertWeightBytes(ExpertWeightFormat::kFp8Block128, 256, 200));
  for (int l = 0; l < 2; ++l) {
    const Fp8SwiGluWeights& a = seeded->fp8_weights(l);
    const Fp8SwiGluWeights& b = loaded->fp8_weights(l);
    EXPECT_EQ(a.gate.codes, b.gate.codes);
    EXPECT_EQ(a.up.codes, b.up.codes);
    EXPECT_EQ(a.down.codes, b.down.codes);
    for (size_t i = 0; i < a.gate.scale_inv.size(); ++i) {
      EXPECT_EQ(fp8::FloatBits(a.gate.scale_inv[i]), fp8::FloatBits(b.gate.scale_inv[i]));
      EXPECT_EQ(fp8::FloatBits(a.down.scale_inv[i]), fp8::FloatBits(b.down.scale_inv[i]));
    }
    EXPECT_EQ(a.up.scale_inv, b.up.scale_inv);
  }
  // A bf16 load of the fp8 file names the tensor and its dtype.
  ExpertSource bf16 = Fp8Source(path, 2, 2, 256, 200);
  bf16.weight_format = ExpertWeightFormat::kBf16;
  const absl::Status s = MakeHostExperts(bf16).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("model.layers.3.mlp.experts.2.gate_proj.weight"));
  EXPECT_THAT(s.message(), HasSubstr("F8_E4M3"));
}

TEST(ReadFp8BlockMatrix, EachMalformedTensorIsNamed) {
  absl::StatusOr<ExpertSet> seeded = ExpertSet::GenerateFp8SwiGlu(5, 3, 0, 1, 256, 256);
  ASSERT_TRUE(seeded.ok());
  const std::string up = "model.layers.3.mlp.experts.0.up_proj.weight";
  struct Case {
    const char* what;
    std::function<void(std::vector<SafetensorsTensor>&)> mutate;
    absl::StatusCode code;
    std::vector<std::string> fragments;
  };
  const auto find = [](std::vector<SafetensorsTensor>& ts, const std::string& name) {
    for (SafetensorsTensor& t : ts) {
      if (t.name == name) return &t;
    }
    return static_cast<SafetensorsTensor*>(nullptr);
  };
  const std::vector<Case> cases = {
      {"missing scale",
       [&](std::vector<SafetensorsTensor>& ts) {
         ts.erase(std::find_if(ts.begin(), ts.end(), [&](const SafetensorsTensor& t) {
           return t.name == up + "_scale_inv";
         }));
       },
       absl::StatusCode::kNotFound,
       {up, "scale tensor", "_scale_inv\" is missing"}},
      {"scale grid that does not tile",
       [&](std::vector<SafetensorsTensor>& ts) {
         SafetensorsTensor* t = find(ts, up + "_scale_inv");
         t->shape = {2, 1};
         t->data.resize(8);
       },
       absl::StatusCode::kInvalidArgument,
       {up + "_scale_inv", "expected [2, 2]", "got [2, 1]", "tiling"}},
      {"wrong weight shape",
       [&](std::vector<SafetensorsTensor>& ts) {
         SafetensorsTensor* t = find(ts, up);
         t->shape = {128, 512};
       },
       absl::StatusCode::kInvalidArgument,
       {up, "expected [256, 256]", "got [128, 512]"}},
      {"bf16 weight under the fp8 kind",
       [&](std::vector<SafetensorsTensor>& ts) {
         SafetensorsTensor* t = find(ts, up);
         t->dtype = SafetensorsDType::kBF16;
         t->shape = {256, 128};
       },
       absl::StatusCode::kInvalidArgument,
       {up, "dtype: expected F8_E4M3, got BF16"}},
      {"f16 scales",
       [&](std::vector<SafetensorsTensor>& ts) {
         SafetensorsTensor* t = find(ts, up + "_scale_inv");
         t->dtype = SafetensorsDType::kF16;
         t->shape = {2, 4};
       },
       absl::StatusCode::kInvalidArgument,
       {up + "_scale_inv", "dtype: expected F32, got F16"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<SafetensorsTensor> tensors = DeepSeekTensors(*seeded, 3);
    c.mutate(tensors);
    const std::string path = TempPath("deepseek_fp8_bad.safetensors");
    ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
    const absl::Status s = MakeHostExperts(Fp8Source(path, 0, 1, 256, 256)).status();
    EXPECT_EQ(s.code(), c.code) << s;
    for (const std::string& f : c.fragments) EXPECT_THAT(s.message(), HasSubstr(f));
  }
}

ExpertSource GptOssSource(const std::string& path, std::vector<int> ids, int64_t h, int64_t i) {
  ExpertSource s =
      ExpertSource::Safetensors(path, "", 1, 4, ids.front(), static_cast<int>(ids.size()), h, i);
  s.weight_format = ExpertWeightFormat::kMxfp4;
  if (ids.back() - ids.front() + 1 != static_cast<int>(ids.size())) {
    s = s.WithExperts(std::move(ids));
  }
  return s;
}

TEST(ReadGptOssExperts, PublishedLayoutBitForBit) {
  // 4 experts of layer 1, H 64, I 96.
  std::vector<GptOssExpertWeights> all;
  for (int e = 0; e < 4; ++e) {
    absl::StatusOr<GptOssExpertWeights> w = GenerateGptOssExpert(9, 1, e, 64, 96);
    ASSERT_TRUE(w.ok()) << w.status();
    all.push_back(std::move(*w));
  }
  const std::vector<SafetensorsTensor> tensors = GptOssTensors(all, kGptOssExpertPrefix, 1);
  ASSERT_EQ(tensors.size(), 6u);
  const std::string p = "model.layers.1.mlp.experts.";
  EXPECT_EQ(tensors[0].name, p + "gate_up_proj_blocks");
  EXPECT_EQ(tensors[0].dtype, SafetensorsDType::kU8);
  EXPECT_EQ(tensors[0].shape, (std::vector<int64_t>{4, 192, 2, 16}));  // [E, 2I, H/32, 16]
  EXPECT_EQ(tensors[1].name, p + "gate_up_proj_scales");
  EXPECT_EQ(tensors[1].shape, (std::vector<int64_t>{4, 192, 2}));
  EXPECT_EQ(tensors[2].name, p + "gate_up_proj_bias");
  EXPECT_EQ(tensors[2].dtype, SafetensorsDType::kBF16);
  EXPECT_EQ(tensors[2].shape, (std::vector<int64_t>{4, 192}));
  EXPECT_EQ(tensors[3].name, p + "down_proj_blocks");
  EXPECT_EQ(tensors[3].shape, (std::vector<int64_t>{4, 64, 3, 16}));  // [E, H, I/32, 16]
  EXPECT_EQ(tensors[4].name, p + "down_proj_scales");
  EXPECT_EQ(tensors[4].shape, (std::vector<int64_t>{4, 64, 3}));
  EXPECT_EQ(tensors[5].name, p + "down_proj_bias");
  EXPECT_EQ(tensors[5].shape, (std::vector<int64_t>{4, 64}));
  const std::string path = TempPath("gpt_oss.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());

  // Experts {1, 3}: not a range (two runs, one Union).
  absl::StatusOr<ExpertSet> loaded = MakeHostExperts(GptOssSource(path, {1, 3}, 64, 96));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->kind(), ExpertKind::kGptOssMxfp4);
  EXPECT_EQ(loaded->expert_ids(), (std::vector<int>{1, 3}));
  for (int l = 0; l < 2; ++l) {
    const GptOssExpertWeights& a = all[l == 0 ? 1 : 3];
    const GptOssExpertWeights& b = loaded->gpt_oss_weights(l);
    EXPECT_EQ(a.gate_up.blocks, b.gate_up.blocks);
    EXPECT_EQ(a.gate_up.scales, b.gate_up.scales);
    EXPECT_EQ(a.gate_up_bias, b.gate_up_bias);
    EXPECT_EQ(a.down.blocks, b.down.blocks);
    EXPECT_EQ(a.down.scales, b.down.scales);
    EXPECT_EQ(a.down_bias, b.down_bias);
  }
  // The interleaving: gate_up row 2j is the seeded gate row j, 2j + 1 up.
  const std::vector<bf16_t> gate(
      ExpertSet::GenerateSwiGlu(9, 1, 1, 1, 64, 96)->swiglu_weights(0).gate);
  const Mxfp4Matrix gate_rows = QuantizeMxfp4(gate, 96, 64);
  for (int64_t j = 0; j < 96; ++j) {
    for (int64_t k = 0; k < 64; ++k) {
      EXPECT_EQ(all[1].gate_up.Value(2 * j, k), gate_rows.Value(j, k)) << j << " " << k;
    }
  }
}

TEST(ReadGptOssExperts, EachMalformedTensorIsNamed) {
  std::vector<GptOssExpertWeights> all;
  all.reserve(4);
  for (int e = 0; e < 4; ++e) all.push_back(*GenerateGptOssExpert(9, 1, e, 64, 96));
  const std::string p = "model.layers.1.mlp.experts.";
  struct Case {
    const char* what;
    std::string tensor;
    std::function<void(SafetensorsTensor&)> mutate;  // null: drop the tensor
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"missing scales", p + "gate_up_proj_scales", nullptr, {p + "gate_up_proj_scales"}},
      {"missing bias", p + "down_proj_bias", nullptr, {p + "down_proj_bias"}},
      {"scales that do not tile the blocks",
       p + "down_proj_scales",
       [](SafetensorsTensor& t) {
         t.shape = {4, 64, 1};
         t.data.resize(4 * 64);
       },
       {p + "down_proj_scales", "expected [4, 64, 3]", "got [4, 64, 1]"}},
      {"blocks of another H",
       p + "gate_up_proj_blocks",
       [](SafetensorsTensor& t) {
         t.shape = {4, 192, 1, 32};
       },
       {p + "gate_up_proj_blocks", "expected [4, 192, 2, 16]"}},
      {"F8 blocks",
       p + "gate_up_proj_blocks",
       [](SafetensorsTensor& t) { t.dtype = SafetensorsDType::kF8E4M3; },
       {p + "gate_up_proj_blocks", "dtype: expected U8, got F8_E4M3"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<SafetensorsTensor> tensors = GptOssTensors(all, kGptOssExpertPrefix, 1);
    auto it = std::find_if(tensors.begin(), tensors.end(),
                           [&](const SafetensorsTensor& t) { return t.name == c.tensor; });
    ASSERT_NE(it, tensors.end());
    if (c.mutate) {
      c.mutate(*it);
    } else {
      tensors.erase(it);
    }
    const std::string path = TempPath("gpt_oss_bad.safetensors");
    ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
    const absl::Status s = MakeHostExperts(GptOssSource(path, {0, 1}, 64, 96)).status();
    EXPECT_FALSE(s.ok());
    EXPECT_EQ(s.code(), c.mutate ? absl::StatusCode::kInvalidArgument : absl::StatusCode::kNotFound)
        << s;
    for (const std::string& f : c.fragments) EXPECT_THAT(s.message(), HasSubstr(f));
  }
}

TEST(Safetensors, ReadsF8E5M2AndU8ButNotAsBf16) {
  const std::string path = TempPath("f8_e5m2.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"a", SafetensorsDType::kF8E5M2, {2, 2}, {1, 2, 3, 4}},
                                      {"b", SafetensorsDType::kU8, {3}, {5, 6, 7}}})
                  .ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  absl::StatusOr<SafetensorsTensorView> a = file->Find("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dtype, SafetensorsDType::kF8E5M2);
  EXPECT_EQ(std::vector<uint8_t>(a->data.begin(), a->data.end()),
            (std::vector<uint8_t>{1, 2, 3, 4}));
  absl::StatusOr<SafetensorsTensorView> b = file->Find("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->dtype, SafetensorsDType::kU8);
  EXPECT_EQ(b->data.size(), 3u);
  std::vector<uint16_t> out(4);
  const absl::Status s = SafetensorsToBf16(*a, 0, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("F8_E5M2"));
}

}  // namespace
}  // namespace quantized_weights_test
}  // namespace moe_ep::core::quant
