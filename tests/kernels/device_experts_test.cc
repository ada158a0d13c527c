#include "kernels/device_experts.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <tuple>
#include <vector>

#include "core/expert_source.h"
#include "core/quantized_weights.h"
#include "core/safetensors.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

std::vector<uint16_t> Download(const uint16_t* dev, size_t count) {
  std::vector<uint16_t> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), dev, count * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  return host;
}

// The device copy of the set's slot ids [L].
std::vector<int32_t> DownloadIds(const DeviceExpertSet& dev) {
  std::vector<int32_t> host(dev.num_experts());
  if (!host.empty()) {
    EXPECT_EQ(
        cudaMemcpy(host.data(), dev.device_slot_ids(), host.size() * 4, cudaMemcpyDeviceToHost),
        cudaSuccess);
  }
  return host;
}

// Device layout: gate_up [L, 2I, H] (gate rows then up rows), down [L, H, I].
void ExpectSameWeights(const core::ExpertSet& host, const DeviceExpertSet& dev) {
  const int64_t h = host.hidden();
  const int64_t i = host.intermediate();
  ASSERT_EQ(dev.weight_bytes(), host.num_experts() * 3 * h * i * 2);
  const auto gate_up = Download(dev.gate_up(), host.num_experts() * 2 * i * h);
  const auto down = Download(dev.down(), host.num_experts() * h * i);
  for (int l = 0; l < host.num_experts(); ++l) {
    const auto& w = host.swiglu_weights(l);
    EXPECT_TRUE(std::equal(w.gate.begin(), w.gate.end(), gate_up.begin() + l * 2 * i * h));
    EXPECT_TRUE(std::equal(w.up.begin(), w.up.end(), gate_up.begin() + l * 2 * i * h + i * h));
    EXPECT_TRUE(std::equal(w.down.begin(), w.down.end(), down.begin() + l * h * i));
  }
}

TEST(DeviceExpertSet, UploadsSeededWeightsBitExact) {
  MOE_EP_REQUIRE_GPUS(1);
  auto host = core::ExpertSet::GenerateSwiGlu(9, 4, 3, 5, 64, 16);
  ASSERT_TRUE(host.ok()) << host.status();
  auto dev = DeviceExpertSet::Upload(*host);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ((*dev)->expert_ids(), (std::vector<int>{3, 4, 5, 6, 7}));
  EXPECT_EQ((*dev)->slot_ids(), (*dev)->expert_ids());
  EXPECT_EQ(DownloadIds(**dev), (std::vector<int32_t>{3, 4, 5, 6, 7}));
  EXPECT_EQ((*dev)->num_experts(), 5);
  ExpectSameWeights(*host, **dev);
}

// Seeded generation on the device equals Upload of the host generator's
// weights, bit for bit (kernels/seeded_weights.cuh does the work).
TEST(DeviceExpertSet, GeneratesSeededWeightsOnDeviceBitExact) {
  MOE_EP_REQUIRE_GPUS(1);
  for (const auto& [seed, layer, first, count, h, i] :
       std::vector<std::tuple<uint64_t, int, int, int, int64_t, int64_t>>{
           {9, 4, 3, 5, 64, 16}, {1234, 3, 0, 2, 7, 5}, {1, 59, 120, 8, 4096, 32}}) {
    auto host = core::ExpertSet::GenerateSwiGlu(seed, layer, first, count, h, i);
    ASSERT_TRUE(host.ok()) << host.status();
    auto dev = DeviceExpertSet::GenerateSwiGlu(seed, layer, first, count, h, i);
    ASSERT_TRUE(dev.ok()) << dev.status();
    EXPECT_EQ((*dev)->kind(), core::ExpertKind::kSwiGlu);
    EXPECT_EQ((*dev)->expert_ids(), host->expert_ids());
    EXPECT_EQ((*dev)->num_experts(), count);
    EXPECT_EQ((*dev)->hidden(), h);
    EXPECT_EQ((*dev)->intermediate(), i);
    ExpectSameWeights(*host, **dev);
  }
}

TEST(DeviceExpertSet, GenerateWithZeroExpertsHoldsNoWeights) {
  MOE_EP_REQUIRE_GPUS(1);
  auto dev = DeviceExpertSet::GenerateSwiGlu(1, 0, 4, 0, 64, 16);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ((*dev)->weight_bytes(), 0);
  EXPECT_EQ((*dev)->gate_up(), nullptr);
}

// Argument errors are found before any CUDA call (no GPU needed).
TEST(DeviceExpertSet, GenerateRejectsBadDimensions) {
  struct Bad {
    int first, count;
    int64_t h, i;
    const char* fragment;
  };
  for (const Bad& b : {Bad{0, 1, 0, 4, "hidden: expected >= 1, got 0"},
                       Bad{0, 1, 8, 0, "intermediate: expected >= 1, got 0"},
                       Bad{0, -1, 8, 4, "num_experts: expected >= 0, got -1"},
                       Bad{-2, 1, 8, 4, "first_expert: expected >= 0, got -2"}}) {
    auto dev = DeviceExpertSet::GenerateSwiGlu(1, 0, b.first, b.count, b.h, b.i);
    EXPECT_EQ(dev.status().code(), absl::StatusCode::kInvalidArgument) << dev.status();
    EXPECT_NE(dev.status().message().find(b.fragment), absl::string_view::npos) << dev.status();
  }
}

TEST(DeviceExpertSet, IdentityHoldsNoWeights) {
  MOE_EP_REQUIRE_GPUS(1);
  auto dev = DeviceExpertSet::Upload(core::ExpertSet::Identity(0, 4, 128));
  ASSERT_TRUE(dev.ok());
  EXPECT_EQ((*dev)->weight_bytes(), 0);
  EXPECT_EQ((*dev)->gate_up(), nullptr);
}

// Writes a small DeepSeek-layout checkpoint, loads experts 1..2 of layer 0 onto
// the GPU and compares with the bytes written.
TEST(DeviceExpertSet, LoadsSafetensorsOntoGpu) {
  MOE_EP_REQUIRE_GPUS(1);
  const int64_t h = 16;
  const int64_t i = 8;
  std::vector<core::SafetensorsTensor> tensors;
  std::vector<core::SwiGluWeights> expected;
  for (int e = 0; e < 3; ++e) {
    core::SwiGluWeights w;
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      core::SafetensorsTensor t;
      t.name = "model.layers.0.mlp.experts." + std::to_string(e) + "." + proj + ".weight";
      t.dtype = core::SafetensorsDType::kBF16;
      t.shape = std::string(proj) == "down_proj" ? std::vector<int64_t>{h, i}
                                                 : std::vector<int64_t>{i, h};
      std::vector<uint16_t> values(h * i);
      for (size_t j = 0; j < values.size(); ++j) {
        values[j] = core::FloatToBf16(0.01f * (e * 1000 + j) * (proj[0] == 'u' ? -1 : 1));
      }
      t.data.resize(values.size() * 2);
      std::memcpy(t.data.data(), values.data(), t.data.size());
      if (proj[0] == 'g') w.gate = values;
      if (proj[0] == 'u') w.up = values;
      if (proj[0] == 'd') w.down = values;
      tensors.push_back(std::move(t));
    }
    expected.push_back(std::move(w));
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / "moe_ep_device_experts_test.safetensors").string();
  ASSERT_TRUE(core::WriteSafetensors(path, tensors).ok());
  const char* pattern = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight";
  auto dev =
      DeviceExpertSet::Load(core::ExpertSource::Safetensors(path, pattern, 0, 3, 1, 2, h, i));
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto host = core::ExpertSet::FromWeights(1, {expected[1], expected[2]}, h, i);
  ASSERT_TRUE(host.ok());
  ExpectSameWeights(*host, **dev);
  auto missing =
      DeviceExpertSet::Load(core::ExpertSource::Safetensors(path, pattern, 0, 4, 2, 2, h, i));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  std::remove(path.c_str());
}

// Load from a source: seeded experts equal the host generator's bits;
// checkpoint tensors (BF16 and F32) streamed through a staging buffer far
// smaller than one tensor (16 bytes: 4 bf16 per slot, so each tensor is many
// pieces alternating between the two slots) equal the host loader's bits.
TEST(DeviceExpertSet, LoadFromSourceEqualsTheHostExperts) {
  MOE_EP_REQUIRE_GPUS(1);
  const core::ExpertSource seeded = core::ExpertSource::Seeded(9, 4, 16, 3, 5, 64, 16);
  auto dev = DeviceExpertSet::Load(seeded);
  ASSERT_TRUE(dev.ok()) << dev.status();
  auto host = core::MakeHostExperts(seeded);
  ASSERT_TRUE(host.ok());
  ExpectSameWeights(*host, **dev);

  const int64_t h = 12;
  const int64_t i = 6;
  auto all = core::ExpertSet::GenerateSwiGlu(3, 2, 0, 4, h, i);
  ASSERT_TRUE(all.ok());
  const char* pattern = "layers.{layer}.experts.{expert}.{w}";
  for (const core::SafetensorsDType dtype :
       {core::SafetensorsDType::kBF16, core::SafetensorsDType::kF32}) {
    std::vector<core::SafetensorsTensor> tensors;
    for (int e = 0; e < 4; ++e) {
      const core::SwiGluWeights& w = all->swiglu_weights(e);
      const std::vector<uint16_t>* parts[3] = {&w.gate, &w.up, &w.down};
      const core::SeededProjection projs[3] = {core::SeededProjection::kGate,
                                               core::SeededProjection::kUp,
                                               core::SeededProjection::kDown};
      for (int p = 0; p < 3; ++p) {
        core::SafetensorsTensor t;
        t.name = core::ExpertTensorName(pattern, 2, e, projs[p]);
        t.dtype = dtype;
        t.shape = p == 2 ? std::vector<int64_t>{h, i} : std::vector<int64_t>{i, h};
        for (uint16_t b : *parts[p]) {
          if (dtype == core::SafetensorsDType::kF32) {
            // An F32 value a little above the bf16 one: rounds back to it.
            const float f = core::Bf16ToFloat(b) * (1.0f + 1.0f / 1024);
            uint8_t bytes[4];
            std::memcpy(bytes, &f, 4);
            t.data.insert(t.data.end(), bytes, bytes + 4);
          } else {
            t.data.push_back(static_cast<uint8_t>(b & 0xff));
            t.data.push_back(static_cast<uint8_t>(b >> 8));
          }
        }
        tensors.push_back(std::move(t));
      }
    }
    const std::string path =
        (std::filesystem::temp_directory_path() /
         ("moe_ep_device_experts_source_" + core::SafetensorsDTypeName(dtype) + ".safetensors"))
            .string();
    ASSERT_TRUE(core::WriteSafetensors(path, tensors).ok());
    // Rank 1 of 2: experts [2, 4).
    const core::ExpertSource source =
        core::ExpertSource::Safetensors(path, pattern, 2, 4, 2, 2, h, i);
    auto streamed = DeviceExpertSet::Load(source, /*staging_bytes=*/16);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    auto expected = core::MakeHostExperts(source);
    ASSERT_TRUE(expected.ok()) << expected.status();
    ExpectSameWeights(*expected, **streamed);
    if (dtype == core::SafetensorsDType::kBF16) {
      for (int l = 0; l < 2; ++l) {
        EXPECT_EQ(expected->swiglu_weights(l).gate, all->swiglu_weights(2 + l).gate);
      }
    }
    std::remove(path.c_str());
  }

  auto identity = DeviceExpertSet::Load(core::ExpertSource::Identity(0, 8, 4, 4, 64));
  ASSERT_TRUE(identity.ok()) << identity.status();
  EXPECT_EQ((*identity)->kind(), core::ExpertKind::kIdentity);
  EXPECT_EQ((*identity)->expert_ids(), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ((*identity)->weight_bytes(), 0);
  EXPECT_EQ((*identity)->gate_up(), nullptr);
}

// The device fp8 weights of `dev` equal the host fp8 experts slot by slot:
// codes and scales in Fp8SwiGluExperts' layout, bit for bit.
void ExpectSameFp8Weights(const core::ExpertSet& host, const DeviceExpertSet& dev) {
  const Fp8SwiGluExperts view = dev.fp8();
  const int n = host.num_experts();
  ASSERT_EQ(view.num_experts, n);
  ASSERT_EQ(view.hidden, host.hidden());
  ASSERT_EQ(view.intermediate, host.intermediate());
  const int64_t ih = view.hidden * view.intermediate;
  const int64_t scales = ((view.intermediate + 127) / 128) * ((view.hidden + 127) / 128);
  std::vector<uint8_t> gate_up(n * 2 * ih), down(n * ih);
  std::vector<float> gate_up_scale(n * 2 * scales), down_scale(n * scales);
  ASSERT_EQ(cudaMemcpy(gate_up.data(), view.gate_up, gate_up.size(), cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(down.data(), view.down, down.size(), cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(gate_up_scale.data(), view.gate_up_scale, gate_up_scale.size() * 4,
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(down_scale.data(), view.down_scale, down_scale.size() * 4, cudaMemcpyDeviceToHost),
      cudaSuccess);
  for (int l = 0; l < n; ++l) {
    const core::quant::Fp8SwiGluWeights& w = host.fp8_weights(l);
    EXPECT_TRUE(std::equal(w.gate.codes.begin(), w.gate.codes.end(), gate_up.begin() + l * 2 * ih))
        << "slot " << l;
    EXPECT_TRUE(std::equal(w.up.codes.begin(), w.up.codes.end(), gate_up.begin() + l * 2 * ih + ih))
        << "slot " << l;
    EXPECT_TRUE(std::equal(w.down.codes.begin(), w.down.codes.end(), down.begin() + l * ih))
        << "slot " << l;
    EXPECT_TRUE(std::equal(w.gate.scale_inv.begin(), w.gate.scale_inv.end(),
                           gate_up_scale.begin() + l * 2 * scales))
        << "slot " << l;
    EXPECT_TRUE(std::equal(w.up.scale_inv.begin(), w.up.scale_inv.end(),
                           gate_up_scale.begin() + l * 2 * scales + scales))
        << "slot " << l;
    EXPECT_TRUE(std::equal(w.down.scale_inv.begin(), w.down.scale_inv.end(),
                           down_scale.begin() + l * scales))
        << "slot " << l;
  }
}

// fp8 block-scaled experts (issue 35 item 3): the seeded source is made on
// the device (bf16 generated and quantized there) with the bits of the host
// experts of the same source (core::quant::GenerateFp8SwiGlu per expert),
// codes and scales in Fp8SwiGluExperts' layout, on slots that are not one
// range; Upload of the host set gives the same bits; bytes are the format's.
TEST(DeviceExpertSet, Fp8SeededAndUploadedEqualTheHostFp8Experts) {
  MOE_EP_REQUIRE_GPUS(1);
  const int64_t h = 256;
  const int64_t i = 384;
  core::ExpertSource source =
      core::ExpertSource::Seeded(11, 2, 16, 0, 1, h, i).WithExperts({1, 4, 5});
  source.weight_format = core::quant::ExpertWeightFormat::kFp8Block128;
  auto host = core::MakeHostExperts(source);
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_EQ(host->kind(), core::ExpertKind::kFp8SwiGlu);
  auto seeded = DeviceExpertSet::Load(source);
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  auto uploaded = DeviceExpertSet::Upload(*host);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  const int64_t ih = h * i;
  const int64_t scales = (i / 128) * (h / 128);  // 3 x 2 blocks a matrix
  for (const DeviceExpertSet* dev : {seeded->get(), uploaded->get()}) {
    EXPECT_EQ(dev->kind(), core::ExpertKind::kFp8SwiGlu);
    EXPECT_EQ(dev->expert_ids(), (std::vector<int>{1, 4, 5}));
    EXPECT_EQ(DownloadIds(*dev), (std::vector<int32_t>{1, 4, 5}));
    // 3 experts x (3 I H code bytes + 3 matrices x 6 blocks x 4 bytes).
    EXPECT_EQ(dev->weight_bytes(), 3 * (3 * ih + 3 * scales * 4));
    EXPECT_EQ(dev->weight_bytes(), source.weight_bytes());
    EXPECT_EQ(dev->gate_up(), nullptr);
    ExpectSameFp8Weights(*host, *dev);
  }
}

// An fp8 checkpoint in DeepSeek-V3's layout (issue 35 item 2): the
// F8_E4M3 codes and F32 weight_scale_inv stream to the device as stored,
// through 64-byte pinned pieces, bit for bit the host loader's experts
// (core::MakeHostExperts) and the seeded experts written; a missing scale is
// an error naming the tensor, before any device memory is taken.
TEST(DeviceExpertSet, Fp8CheckpointStreamsAsStored) {
  MOE_EP_REQUIRE_GPUS(1);
  const int64_t h = 256;
  const int64_t i = 384;
  const char* pattern = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight";
  auto all = core::ExpertSet::GenerateFp8SwiGlu(13, 3, 0, 4, h, i);
  ASSERT_TRUE(all.ok()) << all.status();
  std::vector<core::SafetensorsTensor> tensors;
  const core::SeededProjection projs[3] = {
      core::SeededProjection::kGate, core::SeededProjection::kUp, core::SeededProjection::kDown};
  for (int e = 0; e < 4; ++e) {
    const core::quant::Fp8SwiGluWeights& w = all->fp8_weights(e);
    const core::quant::Fp8BlockMatrix* parts[3] = {&w.gate, &w.up, &w.down};
    for (int p = 0; p < 3; ++p) {
      const std::string name = core::ExpertTensorName(pattern, 3, e, projs[p]);
      for (core::SafetensorsTensor& t :
           core::quant::Fp8Tensors(*parts[p], name, name + "_scale_inv")) {
        tensors.push_back(std::move(t));
      }
    }
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / "moe_ep_device_experts_fp8.safetensors").string();
  ASSERT_TRUE(core::WriteSafetensors(path, tensors).ok());
  // Rank 1 of 2: experts [2, 4).
  core::ExpertSource source = core::ExpertSource::Safetensors(path, pattern, 3, 4, 2, 2, h, i);
  source.weight_format = core::quant::ExpertWeightFormat::kFp8Block128;
  auto streamed = DeviceExpertSet::Load(source, /*staging_bytes=*/128);
  ASSERT_TRUE(streamed.ok()) << streamed.status();
  EXPECT_EQ((*streamed)->kind(), core::ExpertKind::kFp8SwiGlu);
  EXPECT_EQ((*streamed)->expert_ids(), (std::vector<int>{2, 3}));
  EXPECT_EQ((*streamed)->weight_bytes(), source.weight_bytes());
  auto host = core::MakeHostExperts(source);
  ASSERT_TRUE(host.ok()) << host.status();
  ExpectSameFp8Weights(*host, **streamed);
  for (int l = 0; l < 2; ++l) {
    EXPECT_EQ(host->fp8_weights(l).down.codes, all->fp8_weights(2 + l).down.codes);
  }
  // Without expert 3's down scale: NOT_FOUND naming both tensors.
  const std::string missing = core::ExpertTensorName(pattern, 3, 3, projs[2]) + "_scale_inv";
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [&](const core::SafetensorsTensor& t) { return t.name == missing; }),
                tensors.end());
  ASSERT_TRUE(core::WriteSafetensors(path, tensors).ok());
  auto refused = DeviceExpertSet::Load(source, 128);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kNotFound) << refused.status();
  EXPECT_NE(refused.status().message().find(missing), std::string::npos) << refused.status();
  EXPECT_NE(refused.status().message().find("expert source ("), std::string::npos);
  std::remove(path.c_str());
}

// Any set of ids (DESIGN §17; issue 34 item 2): slot l holds expert
// Ids()[l], seeded on the device run by run ({1} {4, 5} {9}), bit-identical
// to the host experts of the same source (core::MakeHostExperts, a Union of
// the runs), and an identity set of the same ids.
TEST(DeviceExpertSet, LoadsAnySetOfIds) {
  MOE_EP_REQUIRE_GPUS(1);
  const std::vector<int> ids = {1, 4, 5, 9};
  const core::ExpertSource seeded =
      core::ExpertSource::Seeded(9, 4, 16, 0, 0, 64, 16).WithExperts(ids);
  auto dev = DeviceExpertSet::Load(seeded);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_EQ((*dev)->expert_ids(), ids);
  EXPECT_EQ(DownloadIds(**dev), std::vector<int32_t>(ids.begin(), ids.end()));
  auto host = core::MakeHostExperts(seeded);
  ASSERT_TRUE(host.ok()) << host.status();
  ASSERT_EQ(host->expert_ids(), ids);
  ExpectSameWeights(*host, **dev);
  // Slot 1 is expert 4: the host generator's expert 4 alone.
  auto four = core::ExpertSet::GenerateSwiGlu(9, 4, 4, 1, 64, 16);
  ASSERT_TRUE(four.ok());
  EXPECT_EQ(host->swiglu_weights(1).down, four->swiglu_weights(0).down);
  // Upload of the host union keeps its ids.
  auto uploaded = DeviceExpertSet::Upload(*host);
  ASSERT_TRUE(uploaded.ok()) << uploaded.status();
  EXPECT_EQ((*uploaded)->expert_ids(), ids);
  ExpectSameWeights(*host, **uploaded);
  auto identity =
      DeviceExpertSet::Load(core::ExpertSource::Identity(0, 16, 0, 0, 64).WithExperts({0, 15}));
  ASSERT_TRUE(identity.ok()) << identity.status();
  EXPECT_EQ((*identity)->expert_ids(), (std::vector<int>{0, 15}));
  EXPECT_EQ(DownloadIds(**identity), (std::vector<int32_t>{0, 15}));
}

// Renumber: the slots answer to new ids (the device copy follows on the
// given stream), the weights and expert_ids() stay; bad ids change nothing.
TEST(DeviceExpertSet, RenumberMovesTheSlotIdsOnly) {
  MOE_EP_REQUIRE_GPUS(1);
  auto dev = DeviceExpertSet::Load(
      core::ExpertSource::Seeded(3, 0, 16, 0, 0, 32, 8).WithExperts({2, 7, 11}));
  ASSERT_TRUE(dev.ok()) << dev.status();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  absl::Status s = (*dev)->Renumber({40, 41, 42}, stream);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ((*dev)->slot_ids(), (std::vector<int>{40, 41, 42}));
  EXPECT_EQ((*dev)->expert_ids(), (std::vector<int>{2, 7, 11}));
  EXPECT_EQ(DownloadIds(**dev), (std::vector<int32_t>{40, 41, 42}));
  auto host = core::MakeHostExperts(
      core::ExpertSource::Seeded(3, 0, 16, 0, 0, 32, 8).WithExperts({2, 7, 11}));
  ASSERT_TRUE(host.ok());
  ExpectSameWeights(*host, **dev);
  absl::Status count = (*dev)->Renumber({1, 2}, stream);
  EXPECT_EQ(count.code(), absl::StatusCode::kInvalidArgument) << count;
  EXPECT_NE(count.message().find("expected 3 (one a slot), got 2"), absl::string_view::npos)
      << count;
  absl::Status order = (*dev)->Renumber({5, 5, 6}, stream);
  EXPECT_EQ(order.code(), absl::StatusCode::kInvalidArgument) << order;
  EXPECT_NE(order.message().find("expected ascending distinct ids >= 0, got 5 at slot 1"),
            absl::string_view::npos)
      << order;
  EXPECT_EQ(DownloadIds(**dev), (std::vector<int32_t>{40, 41, 42}));
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

// The source is validated before any CUDA call (no GPU needed).
TEST(DeviceExpertSet, LoadRejectsAnInvalidSourceBeforeTouchingTheDevice) {
  auto range = DeviceExpertSet::Load(core::ExpertSource::Seeded(1, 0, 8, 6, 4, 64, 16));
  EXPECT_EQ(range.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(range.status().message().find("inside [0, 8), got [6, 10)"), absl::string_view::npos)
      << range.status();
  auto path = DeviceExpertSet::Load(core::ExpertSource::Safetensors(
      "/nonexistent/moe_ep.safetensors", "e.{expert}.{proj}", 0, 8, 0, 4, 64, 16));
  EXPECT_EQ(path.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(path.status().message().find("/nonexistent/moe_ep.safetensors: no such path"),
            absl::string_view::npos)
      << path.status();
  auto staging = DeviceExpertSet::Load(core::ExpertSource::Seeded(1, 0, 8, 0, 4, 64, 16), 2);
  EXPECT_EQ(staging.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::kernels
