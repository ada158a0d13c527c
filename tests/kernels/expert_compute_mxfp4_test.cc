// gpt-oss's mxfp4 experts on the GPU (issue 35 item 3):
// - the grouped kernels of kernels/mxfp4_grouped_gemm.cuh against the fp64
//   sum of the dequantized weights (core::quant::Mxfp4Value), on every token
//   tile width, ring depth and activation ring choice, with scales on both
//   of the dequantizer's paths (E8M0 above and below 128), a tail tile of
//   weight rows, an empty expert and rows past the experts left unwritten;
//   every configuration gives the same bits (one fixed-order sum per
//   output); the device order of the codes a permutation within each word;
// - DeviceExpertSet holding mxfp4 experts as stored: seeded (ids not a
//   range) and sliced from gpt-oss's fused checkpoint tensors, bit for bit
//   the host's once the device order is undone, a missing tensor an error naming it;
// - ExpertCompute::Run over received rows against the CPU reference
//   core::quant::GptOssExpertForward summed with the router weights in fp64,
//   Llama-style input scaling included, at gpt-oss-120b's H = I = 2880 for a
//   few tokens, and the step replayed from a CUDA graph with the same bits.
//
// Tolerances. A GEMM output against its exact value E = sum_k a w + bias:
//   |got - E| <= 2^-14 (sum_k |a w| + |bias|)
// (fp32 accumulation over K <= 2880 terms is within K 2^-24 of the sum of
// |terms| for any order, 2^-12.8 at K 2880; 2^-14 holds at K 128, where a
// single wrong weight moves E by about 2^-7 of the sum.) The expert output
// y against the reference: the intermediate h is bf16 on both sides and can
// differ by one bf16 ulp (2^-8 of itself) where the GEMM orders differ, so
//   |y_gpu - y_ref| <= 2^-8 S + 2^-12 S,  S = sum_i |h_i d_ji| + |bias_j|,
// and the weighted sum's bf16 output adds |W| / 256.

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/expert_source.h"
#include "core/experts.h"
#include "core/quantized_expert_compute.h"
#include "core/quantized_formats.h"
#include "core/quantized_weights.h"
#include "core/safetensors.h"
#include "kernels/device_experts.h"
#include "kernels/expert_compute.h"
#include "kernels/mxfp4_grouped_gemm.cuh"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace expert_compute_mxfp4_test {
namespace {

using core::bf16_t;
using core::quant::GptOssExpertWeights;
using core::quant::Mxfp4Matrix;
using testing::DeviceBuffer;

std::vector<bf16_t> RandomBf16(std::mt19937_64& rng, int64_t n, float scale) {
  std::uniform_real_distribution<float> v(-scale, scale);
  std::vector<bf16_t> out(n);
  for (bf16_t& x : out) x = core::FloatToBf16(v(rng));
  return out;
}

// L experts of `b_rows` x `k` mxfp4 weights (QuantizeMxfp4 of random bf16)
// with a few scales moved onto both dequantizer paths: 135 (values * 2^8,
// above 128) and 100 (values * 2^-27), the codes unchanged.
std::vector<Mxfp4Matrix> MakeWeights(std::mt19937_64& rng, int num, int64_t b_rows, int64_t k) {
  std::vector<Mxfp4Matrix> out;
  for (int l = 0; l < num; ++l) {
    Mxfp4Matrix m = core::quant::QuantizeMxfp4(RandomBf16(rng, b_rows * k, 0.5f), b_rows, k);
    for (size_t b = 0; b < m.scales.size(); b += 7) m.scales[b] = (b % 2 == 0) ? 135 : 100;
    out.push_back(std::move(m));
  }
  return out;
}

// The experts' blocks (in the kernels' device order) or scales, back to back.
std::vector<uint8_t> Concat(const std::vector<Mxfp4Matrix>& ms, bool blocks) {
  std::vector<uint8_t> out;
  for (const Mxfp4Matrix& m : ms) {
    const std::vector<uint8_t>& v = blocks ? m.blocks : m.scales;
    out.insert(out.end(), v.begin(), v.end());
  }
  if (blocks) Mxfp4BlocksToDeviceOrder(out.data(), static_cast<int64_t>(out.size()));
  return out;
}

struct GemmCase {
  std::vector<int32_t> offsets;  // [L+1]
  int64_t max_rows = 0;
  int64_t k = 0;
  int64_t b_rows = 0;
  std::vector<bf16_t> a;     // [max_rows, k]
  std::vector<bf16_t> bias;  // [L, b_rows]
  std::vector<Mxfp4Matrix> w;
};

GemmCase MakeCase(uint64_t seed, int64_t b_rows, int64_t k) {
  std::mt19937_64 rng(seed);
  GemmCase c;
  c.offsets = {0, 5, 5, 26};  // expert 1 has no rows; 3 rows past the experts
  c.max_rows = 29;
  c.k = k;
  c.b_rows = b_rows;
  c.a = RandomBf16(rng, c.max_rows * k, 1.0f);
  c.bias = RandomBf16(rng, 3 * b_rows, 0.25f);
  c.w = MakeWeights(rng, 3, b_rows, k);
  return c;
}

// The exact GEMM output of row i (expert l) and weight row n, and the sum
// of |terms| it is bounded by.
void Exact(const GemmCase& c, int l, int64_t i, int64_t n, double* value, double* magnitude) {
  double s = 0;
  double m = 0;
  for (int64_t kk = 0; kk < c.k; ++kk) {
    const double t =
        static_cast<double>(core::Bf16ToFloat(c.a[i * c.k + kk])) * c.w[l].Value(n, kk);
    s += t;
    m += std::abs(t);
  }
  const double b = core::Bf16ToFloat(c.bias[l * c.b_rows + n]);
  *value = s + b;
  *magnitude = m + std::abs(b);
}

int ExpertOf(const GemmCase& c, int64_t i) {
  for (int l = 0; l + 1 < static_cast<int>(c.offsets.size()); ++l) {
    if (i >= c.offsets[l] && i < c.offsets[l + 1]) return l;
  }
  return -1;
}

// A case's operands on the device and the launch parameters over them
// (n is the caller's: b_rows for the plain GEMM, the features for the GLU).
struct OnDevice {
  DeviceBuffer<bf16_t> a;
  DeviceBuffer<uint8_t> blocks;
  DeviceBuffer<uint8_t> scales;
  DeviceBuffer<bf16_t> bias;
  DeviceBuffer<int32_t> offsets;
  Mxfp4GemmParams params;
  explicit OnDevice(const GemmCase& c)
      : a(c.a),
        blocks(Concat(c.w, true)),
        scales(Concat(c.w, false)),
        bias(c.bias),
        offsets(c.offsets) {
    params.a = a.get();
    params.max_rows = c.max_rows;
    params.blocks = blocks.get();
    params.scales = scales.get();
    params.bias = bias.get();
    params.offsets = offsets.get();
    params.num_local_experts = static_cast<int>(c.offsets.size()) - 1;
    params.k = c.k;
  }
};

TEST(Mxfp4GroupedGemm, MatchesTheExactSumOnEveryTileWidthAndRing) {
  MOE_EP_REQUIRE_GPUS(1);
  // K 128: two steps, fewer than any ring; K 640: ten, through the ring's
  // steady loop and its tail for every depth.
  for (const int64_t k : {128, 640}) {
    const GemmCase c = MakeCase(3, /*b_rows=*/80, k);  // 80: a tail tile of 16 rows
    OnDevice d(c);
    Mxfp4GemmParams& p = d.params;
    p.n = c.b_rows;
    std::vector<float> first;
    for (const int tiles : {1, 2, 4, 8}) {
      for (const int depth : {0, 3, 4, 5, 6}) {
        for (const int ring : {0, -1}) {
          // Register caps; 8-token chunks with and without 16-row passes
          // (expert 2's 21 rows: one of 16 and one of 5, or three).
          for (const auto& [min_ctas, pairs] : {std::pair{0, 0}, std::pair{4, 0}, std::pair{5, 0},
                                                std::pair{0, -1}, std::pair{4, -1}}) {
            SCOPED_TRACE(::testing::Message()
                         << "K " << k << " tile_tokens " << tiles << " prefetch " << depth
                         << " ring " << ring << " min_ctas " << min_ctas << " pair_chunks "
                         << pairs);
            p.tile_tokens = tiles;
            p.prefetch_steps = depth;
            p.ring_activations = ring;
            p.min_ctas_per_sm = min_ctas;
            p.pair_chunks = pairs;
            const std::vector<float> sentinel(c.max_rows * c.b_rows, -12345.0f);
            DeviceBuffer<float> y(sentinel);
            ASSERT_TRUE(LaunchMxfp4GroupedGemm(p, y.get(), nullptr).ok());
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            const std::vector<float> got = y.Download(sentinel.size());
            int64_t bad = 0;
            for (int64_t i = 0; i < c.max_rows; ++i) {
              const int l = ExpertOf(c, i);
              for (int64_t n = 0; n < c.b_rows; ++n) {
                const float g = got[i * c.b_rows + n];
                if (l < 0) {
                  bad += g != -12345.0f;
                  continue;
                }
                double want = 0;
                double mag = 0;
                Exact(c, l, i, n, &want, &mag);
                if (!(std::abs(g - want) <= mag / 16384) && ++bad <= 5) {
                  ADD_FAILURE() << "y[" << i << ", " << n << "] got " << g << " want " << want;
                }
              }
            }
            EXPECT_EQ(bad, 0);
            if (first.empty()) {
              first = got;
            } else {
              EXPECT_TRUE(got == first) << "a tile width or ring changed the bits";
            }
          }
        }
      }
    }
  }
}

TEST(Mxfp4GroupedGemm, DeviceOrderPermutesTheCodesOfEachWord) {
  // Host code: runs without a GPU.
  std::mt19937_64 rng(9);
  std::vector<uint8_t> blocks(4096);
  for (uint8_t& b : blocks) b = static_cast<uint8_t>(rng());
  std::vector<uint8_t> device = blocks;
  Mxfp4BlocksToDeviceOrder(device.data(), static_cast<int64_t>(device.size()));
  EXPECT_NE(device, blocks);
  for (size_t w = 0; w < blocks.size(); w += 4) {
    // The same word's bits, moved: as many ones.
    int ones_in = 0;
    int ones_out = 0;
    for (size_t b = w; b < w + 4; ++b) {
      ones_in += __builtin_popcount(blocks[b]);
      ones_out += __builtin_popcount(device[b]);
    }
    ASSERT_EQ(ones_in, ones_out) << "word " << w / 4;
  }
  Mxfp4BlocksFromDeviceOrder(device.data(), static_cast<int64_t>(device.size()));
  EXPECT_EQ(device, blocks);
}

TEST(Mxfp4GroupedGemm, GptOssGluOfTheExactGateAndUp) {
  MOE_EP_REQUIRE_GPUS(1);
  const int64_t features = 40;  // b_rows 80: rows 2j gate, 2j + 1 up
  const GemmCase c = MakeCase(4, 2 * features, 128);
  OnDevice d(c);
  Mxfp4GemmParams& p = d.params;
  p.n = features;
  // A limit low enough that some gates and ups clamp.
  const float alpha = core::quant::kGptOssAlpha;
  const float limit = 2.0f;
  // Tile widths: picked (16 tokens a chunk), and 8 with and without 16-row
  // passes (expert 2's 21 rows: one of 16 and one of 5, or three).
  for (const auto& [tiles, pairs] : {std::pair{0, 0}, std::pair{1, 0}, std::pair{1, -1}}) {
    SCOPED_TRACE(::testing::Message() << "tile_tokens " << tiles << " pair_chunks " << pairs);
    p.tile_tokens = tiles;
    p.pair_chunks = pairs;
    DeviceBuffer<bf16_t> act(std::vector<bf16_t>(c.max_rows * features, 0xffff));
    ASSERT_TRUE(LaunchMxfp4GroupedGptOssGlu(p, alpha, limit, act.get(), nullptr).ok());
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<bf16_t> got = act.Download(c.max_rows * features);
    int64_t bad = 0;
    int64_t clamped = 0;
    for (int64_t i = 0; i < c.max_rows; ++i) {
      const int l = ExpertOf(c, i);
      for (int64_t j = 0; j < features; ++j) {
        const bf16_t g = got[i * features + j];
        if (l < 0) {
          bad += g != 0xffff;
          continue;
        }
        double gate = 0;
        double gate_mag = 0;
        double up = 0;
        double up_mag = 0;
        Exact(c, l, i, 2 * j, &gate, &gate_mag);
        Exact(c, l, i, 2 * j + 1, &up, &up_mag);
        clamped += gate > limit || std::abs(up) > limit;
        const double h =
            core::quant::GptOssGlu(static_cast<float>(gate), static_cast<float>(up), alpha, limit);
        // GEMM errors e_g, e_u (2^-14 of their magnitudes) move h by at most
        // (|u| + 2)(1 + |g|) e_g + (|g| + 1) e_u; bf16 adds |h| / 256.
        const double tol = std::abs(h) / 128 +
                           (std::abs(up) + 2) * (1 + std::abs(gate)) * gate_mag / 16384 +
                           (std::abs(gate) + 1) * up_mag / 16384 + 1e-30;
        if (!(std::abs(core::Bf16ToFloat(g) - h) <= tol) && ++bad <= 5) {
          ADD_FAILURE() << "act[" << i << ", " << j << "] got " << core::Bf16ToFloat(g) << " want "
                        << h;
        }
      }
    }
    EXPECT_EQ(bad, 0);
    EXPECT_GT(clamped, 0) << "the case must reach the clamp";
  }
}

TEST(Mxfp4GroupedGemm, RefusesAKOffTheStep) {
  // Checked before anything touches the (host) pointers: runs without a GPU.
  alignas(16) static float y[4] = {};
  Mxfp4GemmParams p;
  p.a = reinterpret_cast<const uint16_t*>(y);
  p.blocks = reinterpret_cast<const uint8_t*>(y);
  p.scales = p.blocks;
  p.offsets = reinterpret_cast<const int32_t*>(y);
  p.num_local_experts = 1;
  p.max_rows = 1;
  p.n = 64;
  p.k = 96;  // a multiple of the mxfp4 block, not of the kernels' step
  const absl::Status s = LaunchMxfp4GroupedGemm(p, y, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("got 96"), std::string::npos) << s;
}

// Downloads slot `slot`'s six arrays of `set` (kind kGptOssMxfp4), the
// blocks back in the checkpoint's nibble order.
GptOssExpertWeights DownloadMxfp4(const DeviceExpertSet& set, int slot) {
  const Mxfp4Experts v = set.mxfp4();
  const int64_t h = v.hidden;
  const int64_t i = v.intermediate;
  GptOssExpertWeights w;
  w.gate_up.rows = 2 * i;
  w.gate_up.cols = h;
  w.down.rows = h;
  w.down.cols = i;
  auto get = [](auto* dst, const auto* src, int64_t count, int64_t slot_index) {
    dst->resize(count);
    EXPECT_EQ(cudaMemcpy(dst->data(), src + slot_index * count, count * sizeof((*dst)[0]),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
  };
  get(&w.gate_up.blocks, v.gate_up_blocks, 2 * i * h / 2, slot);
  get(&w.gate_up.scales, v.gate_up_scales, 2 * i * h / 32, slot);
  get(&w.gate_up_bias, v.gate_up_bias, 2 * i, slot);
  get(&w.down.blocks, v.down_blocks, h * i / 2, slot);
  get(&w.down.scales, v.down_scales, h * i / 32, slot);
  get(&w.down_bias, v.down_bias, h, slot);
  Mxfp4BlocksFromDeviceOrder(w.gate_up.blocks.data(),
                             static_cast<int64_t>(w.gate_up.blocks.size()));
  Mxfp4BlocksFromDeviceOrder(w.down.blocks.data(), static_cast<int64_t>(w.down.blocks.size()));
  return w;
}

void ExpectSame(const GptOssExpertWeights& got, const GptOssExpertWeights& want) {
  EXPECT_EQ(got.gate_up.blocks, want.gate_up.blocks);
  EXPECT_EQ(got.gate_up.scales, want.gate_up.scales);
  EXPECT_EQ(got.gate_up_bias, want.gate_up_bias);
  EXPECT_EQ(got.down.blocks, want.down.blocks);
  EXPECT_EQ(got.down.scales, want.down.scales);
  EXPECT_EQ(got.down_bias, want.down_bias);
}

TEST(DeviceExpertSetMxfp4, SeededAndCheckpointExpertsAsStored) {
  MOE_EP_REQUIRE_GPUS(1);
  const int64_t h = 64;
  const int64_t i = 128;
  std::vector<GptOssExpertWeights> all;
  for (int e = 0; e < 4; ++e) {
    auto w = core::quant::GenerateGptOssExpert(21, 2, e, h, i);
    ASSERT_TRUE(w.ok()) << w.status();
    all.push_back(*std::move(w));
  }
  // Seeded, slots {1, 3}: the host generator's bits.
  core::ExpertSource seeded = core::ExpertSource::Seeded(21, 2, 4, 0, 0, h, i).WithExperts({1, 3});
  seeded.weight_format = core::quant::ExpertWeightFormat::kMxfp4;
  seeded.gpt_oss_activation.limit = 5.0f;
  auto dev = DeviceExpertSet::Load(seeded);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ((*dev)->kind(), core::ExpertKind::kGptOssMxfp4);
  EXPECT_EQ((*dev)->expert_ids(), (std::vector<int>{1, 3}));
  EXPECT_EQ((*dev)->weight_bytes(), seeded.weight_bytes());
  EXPECT_EQ((*dev)->mxfp4().activation.limit, 5.0f);
  ExpectSame(DownloadMxfp4(**dev, 0), all[1]);
  ExpectSame(DownloadMxfp4(**dev, 1), all[3]);
  EXPECT_EQ(DeviceExpertSet::Load(core::ExpertSource::Seeded(21, 2, 4, 0, 0, h, i))
                .value()
                ->mxfp4()
                .gate_up_blocks,
            nullptr)
      << "a bf16 set has no mxfp4 view";

  // The published fused tensors, rank 1 of 2: experts [2, 4).
  std::vector<core::SafetensorsTensor> tensors =
      core::quant::GptOssTensors(all, core::quant::kGptOssExpertPrefix, 2);
  const std::string path =
      (std::filesystem::temp_directory_path() / "moe_ep_device_experts_mxfp4.safetensors").string();
  ASSERT_TRUE(core::WriteSafetensors(path, tensors).ok());
  core::ExpertSource ckpt = core::ExpertSource::Safetensors(path, "", 2, 4, 2, 2, h, i);
  ckpt.weight_format = core::quant::ExpertWeightFormat::kMxfp4;
  auto loaded = DeviceExpertSet::Load(ckpt);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ((*loaded)->expert_ids(), (std::vector<int>{2, 3}));
  ExpectSame(DownloadMxfp4(**loaded, 0), all[2]);
  ExpectSame(DownloadMxfp4(**loaded, 1), all[3]);
  // Upload of the host experts of the same source: the same bits.
  auto host = core::MakeHostExperts(ckpt);
  ASSERT_TRUE(host.ok()) << host.status();
  auto uploaded = DeviceExpertSet::Upload(*host);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  ExpectSame(DownloadMxfp4(**uploaded, 1), all[3]);

  // Without the down scales: NOT_FOUND naming the tensor and the source.
  const std::string missing = "model.layers.2.mlp.experts.down_proj_scales";
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [&](const core::SafetensorsTensor& t) { return t.name == missing; }),
                tensors.end());
  ASSERT_TRUE(core::WriteSafetensors(path, tensors).ok());
  auto refused = DeviceExpertSet::Load(ckpt);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
  EXPECT_NE(refused.status().message().find(missing), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("expert source ("), std::string::npos);
  std::remove(path.c_str());
}

struct Layer {
  int64_t hidden = 0;
  int64_t inter = 0;
  int num_experts = 0;   // global experts the rows route to
  std::vector<int> ids;  // the rank's slots (ascending)
  uint64_t seed = 0;
};

// The rank's experts loaded on the device from a seeded source, the step
// run and replayed from a graph, every output against the reference.
void RunLayer(const Layer& c, int64_t rows, int top_k, bool scale_input) {
  SCOPED_TRACE(::testing::Message() << "H " << c.hidden << " I " << c.inter << " rows " << rows
                                    << " top-" << top_k << (scale_input ? " e(w x)" : ""));
  core::ExpertSource source =
      core::ExpertSource::Seeded(c.seed, 1, c.num_experts, 0, 0, c.hidden, c.inter)
          .WithExperts(c.ids);
  source.weight_format = core::quant::ExpertWeightFormat::kMxfp4;
  if (scale_input) source.router_weight_use = core::RouterWeightUse::kScalesInput;
  auto dev = DeviceExpertSet::Load(source);
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto host = core::MakeHostExperts(source);
  ASSERT_TRUE(host.ok()) << host.status();
  const testing::MoeInputs in =
      testing::MakeInputs(c.seed + 1, rows, c.hidden, top_k, c.num_experts, 0.1);
  auto compute =
      ExpertCompute::Create(rows, top_k, c.hidden, c.inter, static_cast<int>(c.ids.size()));
  ASSERT_TRUE(compute.ok()) << compute.status();
  DeviceBuffer<uint8_t> recv(testing::PackRows(in, rows, c.hidden, top_k));
  DeviceBuffer<bf16_t> out(std::vector<bf16_t>(rows * c.hidden, 0xffff));
  ASSERT_TRUE((*compute)->Run(recv.get(), rows, **dev, out.get(), nullptr).ok());
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<bf16_t> got = out.Download(rows * c.hidden);

  DeviceBuffer<bf16_t> out2(std::vector<bf16_t>(rows * c.hidden, 0xffff));
  const absl::Status replayed = testing::ReplayFromGraph([&](cudaStream_t stream) {
    return (*compute)->Run(recv.get(), rows, **dev, out2.get(), stream);
  });
  ASSERT_TRUE(replayed.ok()) << replayed;
  EXPECT_TRUE(out2.Download(rows * c.hidden) == got) << "graph replay differs from the eager run";

  int64_t bad = 0;
  int64_t local_rows = 0;
  double worst = 0;
  std::vector<float> x(c.hidden);
  std::vector<float> xk(c.hidden);
  std::vector<float> y(c.hidden);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < c.hidden; ++j) x[j] = core::Bf16ToFloat(in.hidden[r * c.hidden + j]);
    std::vector<double> want(c.hidden, 0.0);
    std::vector<double> tol(c.hidden, 0.0);
    bool local = false;
    for (int k = 0; k < top_k; ++k) {
      const int32_t id = in.ids[r * top_k + k];
      const auto it = std::find(c.ids.begin(), c.ids.end(), id);
      if (it == c.ids.end()) continue;
      local = true;
      const GptOssExpertWeights& w = host->gpt_oss_weights(static_cast<int>(it - c.ids.begin()));
      const float weight = in.weights[r * top_k + k];
      // e(w x): the CPU computes w x in fp32 and the expert reads bf16 of it.
      for (int64_t j = 0; j < c.hidden; ++j) xk[j] = scale_input ? weight * x[j] : x[j];
      core::quant::GptOssTrace trace;
      ASSERT_TRUE(core::quant::GptOssExpertForward(w, xk, 1, host->gpt_oss_activation(),
                                                   absl::MakeSpan(y), &trace)
                      .ok());
      const double wk = scale_input ? 1.0 : weight;
      for (int64_t j = 0; j < c.hidden; ++j) {
        double s = std::abs(core::Bf16ToFloat(w.down_bias[j]));
        for (int64_t i = 0; i < c.inter; ++i) s += std::abs(trace.h[i] * w.down.Value(j, i));
        want[j] += wk * y[j];
        tol[j] += wk * (s / 256 + s / 4096);
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
  std::printf("[          ] largest |error| / tolerance: %.3g\n", worst);
}

TEST(ExpertComputeMxfp4, SmallLayerOnSlotsThatAreNotARangeEqualsTheReference) {
  MOE_EP_REQUIRE_GPUS(1);
  Layer c;
  c.hidden = 256;
  c.inter = 192;
  c.num_experts = 12;
  c.ids = {1, 4, 5, 9};
  c.seed = 5;
  RunLayer(c, 80, 4, /*scale_input=*/false);
  RunLayer(c, 80, 1, /*scale_input=*/true);
}

TEST(ExpertComputeMxfp4, GptOss120bShapeForAFewTokens) {
  MOE_EP_REQUIRE_GPUS(1);
  Layer c;
  c.hidden = 2880;
  c.inter = 2880;
  c.num_experts = 8;
  c.ids = {0, 2, 5};
  c.seed = 11;
  RunLayer(c, 6, 4, /*scale_input=*/false);
}

TEST(ExpertComputeMxfp4, RejectsAnIntermediateOffTheStep) {
  MOE_EP_REQUIRE_GPUS(1);
  auto compute = ExpertCompute::Create(4, 2, 256, 512, 2);
  ASSERT_TRUE(compute.ok()) << compute.status();
  Mxfp4Experts e;
  e.hidden = 256;
  e.intermediate = 160;
  e.num_experts = 1;
  const absl::Status s = (*compute)->RunMxfp4(nullptr, 4, e, nullptr, nullptr);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("got intermediate 160, hidden 256"), std::string::npos) << s;
}

}  // namespace
}  // namespace expert_compute_mxfp4_test
}  // namespace moe_ep::kernels
