#include "core/expert_source.h"

#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

constexpr char kPattern[] = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight";

std::string TempPath(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / name).string();
}

// The tensors of `set`'s experts under kPattern for `layer`, as BF16 or F32
// (F32 holds each bf16 value exactly, so it reads back to the same bits).
std::vector<SafetensorsTensor> Tensors(const ExpertSet& set, int layer, bool as_f32) {
  std::vector<SafetensorsTensor> out;
  for (int l = 0; l < set.num_experts(); ++l) {
    const SwiGluWeights& w = set.swiglu_weights(l);
    const std::vector<bf16_t>* parts[3] = {&w.gate, &w.up, &w.down};
    const SeededProjection projs[3] = {SeededProjection::kGate, SeededProjection::kUp,
                                       SeededProjection::kDown};
    for (int p = 0; p < 3; ++p) {
      SafetensorsTensor t;
      t.name = ExpertTensorName(kPattern, layer, set.first_expert() + l, projs[p]);
      t.shape = p == 2 ? std::vector<int64_t>{set.hidden(), set.intermediate()}
                       : std::vector<int64_t>{set.intermediate(), set.hidden()};
      t.dtype = as_f32 ? SafetensorsDType::kF32 : SafetensorsDType::kBF16;
      for (bf16_t b : *parts[p]) {
        if (as_f32) {
          const float f = Bf16ToFloat(b);
          uint8_t bytes[4];
          std::memcpy(bytes, &f, 4);
          t.data.insert(t.data.end(), bytes, bytes + 4);
        } else {
          t.data.push_back(static_cast<uint8_t>(b & 0xff));
          t.data.push_back(static_cast<uint8_t>(b >> 8));
        }
      }
      out.push_back(std::move(t));
    }
  }
  return out;
}

TEST(ExpertSource, WeightBytesAndTensorNames) {
  const ExpertSource s = ExpertSource::Seeded(1, 3, 256, 8, 4, 7168, 2048);
  EXPECT_EQ(s.weight_bytes(), 352321536);  // 4 * 3 * 2048 * 7168 * 2
  EXPECT_EQ(s.expert_kind(), ExpertKind::kSwiGlu);
  EXPECT_EQ(ExpertSource::Identity(3, 256, 8, 4, 7168).weight_bytes(), 0);
  EXPECT_EQ(ExpertSource::Identity(3, 256, 8, 4, 7168).expert_kind(), ExpertKind::kIdentity);
  const ExpertSource st = ExpertSource::Safetensors("/ckpt", kPattern, 3, 256, 8, 4, 7168, 2048);
  EXPECT_EQ(st.TensorName(7, SeededProjection::kUp), "model.layers.3.mlp.experts.7.up_proj.weight");
  EXPECT_EQ(st.Describe(), "layer 3 experts [8, 12) of 256, safetensors");
}

// Each field check names the field, what was expected and what came, after
// the source's description.
TEST(ValidateExpertSource, NamesTheFieldExpectedAndGot) {
  struct Bad {
    ExpertSource source;
    const char* fragment;
  };
  for (const Bad& bad : {
           Bad{ExpertSource::Seeded(1, -1, 8, 0, 4, 64, 16), "layer: expected >= 0, got -1"},
           Bad{ExpertSource::Seeded(1, 0, 0, 0, 0, 64, 16),
               "num_routed_experts: expected >= 1, got 0"},
           Bad{ExpertSource::Seeded(1, 0, 8, 6, 4, 64, 16),
               "expert range: expected [first_expert, first_expert + num_experts) inside [0, 8), "
               "got [6, 10)"},
           Bad{ExpertSource::Seeded(1, 0, 8, -1, 2, 64, 16), "got [-1, 1)"},
           Bad{ExpertSource::Seeded(1, 0, 8, 0, 4, 0, 16), "hidden: expected >= 1, got 0"},
           Bad{ExpertSource::Seeded(1, 0, 8, 0, 4, 64, 0),
               "intermediate: expected >= 1 for SwiGLU experts, got 0"},
           Bad{ExpertSource::Safetensors("relative/ckpt", kPattern, 0, 8, 0, 4, 64, 16),
               "checkpoint_path: expected an absolute path (resolved under --checkpoint-dir), "
               "got \"relative/ckpt\""},
           Bad{ExpertSource::Safetensors("/ckpt", "model.layers.{layer}.{proj}", 0, 8, 0, 4, 64,
                                         16),
               "name_pattern: expected {expert} and one of {proj} or {w}"},
       }) {
    const absl::Status status = ValidateExpertSource(bad.source);
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
    EXPECT_THAT(std::string(status.message()), HasSubstr(bad.fragment));
    EXPECT_THAT(std::string(status.message()),
                HasSubstr("expert source (" + bad.source.Describe() + "): "));
  }
  // Identity needs no intermediate size.
  EXPECT_TRUE(ValidateExpertSource(ExpertSource::Identity(0, 8, 0, 8, 64)).ok());
  EXPECT_TRUE(ValidateExpertSource(ExpertSource::Seeded(1, 0, 8, 4, 4, 64, 16)).ok());
}

// 10 experts on 4 ranks: [0, 3), [3, 6), [6, 8), [8, 10).
TEST(CheckExpertRange, IsTheRanksContiguousShare) {
  EXPECT_TRUE(CheckExpertRange(ExpertSource::Seeded(1, 0, 10, 3, 3, 8, 4), 1, 4).ok());
  EXPECT_TRUE(CheckExpertRange(ExpertSource::Seeded(1, 0, 10, 8, 2, 8, 4), 3, 4).ok());
  const absl::Status wrong = CheckExpertRange(ExpertSource::Seeded(1, 0, 10, 3, 3, 8, 4), 2, 4);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.message()),
              HasSubstr("expert range: expected [6, 8) for rank 2 of 4 (contiguous placement of "
                        "10 experts), got [3, 6)"));
}

// A rank's slots under a placement table (DESIGN §15).
TEST(CheckExpertSlots, IsTheRanksDistinctSlotExperts) {
  const PlacementTable table =
      PlacementTable::FromSlotExperts(6, {{5, 2, 0, 5}, {1, 3, 4, 2}}).value();
  EXPECT_EQ(DistinctSlotExperts(table, 0), (std::vector<int>{0, 2, 5}));
  const ExpertSource base = ExpertSource::Seeded(1, 0, 6, 0, 0, 8, 4);
  EXPECT_TRUE(CheckExpertSlots(base.WithExperts({0, 2, 5}), table, 0).ok());
  EXPECT_TRUE(CheckExpertSlots(base.WithExperts({1, 2, 3, 4}), table, 1).ok());
  const absl::Status wrong = CheckExpertSlots(base.WithExperts({0, 1, 2}), table, 0);
  EXPECT_EQ(wrong.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.message()), HasSubstr("experts: expected {0,2,5} for rank 0"));
  EXPECT_THAT(std::string(wrong.message()), HasSubstr("got [0, 3)"));
  EXPECT_EQ(CheckExpertSlots(base.WithExperts({0}), table, 2).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ExpertSource, WithExpertsIsValidatedAndMadeOncePerExpert) {
  const ExpertSource s = ExpertSource::Seeded(4, 2, 8, 0, 0, 8, 4).WithExperts({1, 2, 6});
  EXPECT_EQ(s.first_expert, 1);
  EXPECT_EQ(s.num_experts, 3);
  EXPECT_EQ(s.Describe(), "layer 2 experts {1,2,6} of 8, seeded");
  EXPECT_EQ(s.weight_bytes(), 3 * 3 * 8 * 4 * 2);
  auto set = MakeHostExperts(s);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->expert_ids(), (std::vector<int>{1, 2, 6}));
  const ExpertSet six = ExpertSet::GenerateSwiGlu(4, 2, 6, 1, 8, 4).value();
  EXPECT_EQ(set->swiglu_weights(2).up, six.swiglu_weights(0).up);
  ExpertSource unsorted = s;
  unsorted.expert_ids = {2, 1, 6};
  EXPECT_THAT(std::string(ValidateExpertSource(unsorted).message()),
              HasSubstr("expert_ids: expected ascending distinct ids in [0, 8), got 1 at "
                        "position 1"));
  ExpertSource inconsistent = s;
  inconsistent.num_experts = 2;
  EXPECT_EQ(ValidateExpertSource(inconsistent).code(), absl::StatusCode::kInvalidArgument);
}

TEST(OpenExpertCheckpoint, MissingPathTensorOrShapeIsNamed) {
  auto set = ExpertSet::GenerateSwiGlu(5, 1, 0, 2, 8, 4);
  ASSERT_TRUE(set.ok());
  const std::string path = TempPath("expert_source_open.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, Tensors(*set, 1, false)).ok());

  const auto missing_path =
      OpenExpertCheckpoint(ExpertSource::Safetensors(path + ".nope", kPattern, 1, 4, 0, 2, 8, 4));
  EXPECT_EQ(missing_path.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing_path.status().message()),
              HasSubstr("expert source (layer 1 experts [0, 2) of 4, safetensors): safetensors "
                        "checkpoint " +
                        path + ".nope: no such path"));

  // Experts [2, 4) are not in the file: the first missing one is named.
  const auto missing_tensor =
      OpenExpertCheckpoint(ExpertSource::Safetensors(path, kPattern, 1, 4, 2, 2, 8, 4));
  EXPECT_EQ(missing_tensor.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing_tensor.status().message()),
              HasSubstr("tensor \"model.layers.1.mlp.experts.2.gate_proj.weight\" not found"));

  // H and I swapped: gate is [4, 8] in the file, [8, 4] expected.
  const auto wrong_shape =
      OpenExpertCheckpoint(ExpertSource::Safetensors(path, kPattern, 1, 4, 0, 2, 4, 8));
  EXPECT_EQ(wrong_shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong_shape.status().message()),
              HasSubstr("gate_proj.weight\": shape: expected [8, 4], got [4, 8]"));

  EXPECT_TRUE(
      OpenExpertCheckpoint(ExpertSource::Safetensors(path, kPattern, 1, 4, 0, 2, 8, 4)).ok());
  std::filesystem::remove(path);
}

// The CPU plane's materialisation: the same bits as the ExpertSet makers.
TEST(MakeHostExperts, SeededAndCheckpointAndIdentity) {
  auto seeded = MakeHostExperts(ExpertSource::Seeded(9, 4, 12, 3, 5, 64, 16));
  ASSERT_TRUE(seeded.ok()) << seeded.status();
  auto generated = ExpertSet::GenerateSwiGlu(9, 4, 3, 5, 64, 16);
  ASSERT_TRUE(generated.ok());
  ASSERT_EQ(seeded->num_experts(), 5);
  for (int l = 0; l < 5; ++l) {
    EXPECT_EQ(seeded->swiglu_weights(l).gate, generated->swiglu_weights(l).gate);
    EXPECT_EQ(seeded->swiglu_weights(l).down, generated->swiglu_weights(l).down);
  }
  EXPECT_TRUE(seeded->seed_origin().has_value());

  auto all = ExpertSet::GenerateSwiGlu(5, 1, 0, 4, 8, 4);
  ASSERT_TRUE(all.ok());
  for (bool as_f32 : {false, true}) {
    const std::string path =
        TempPath(as_f32 ? "expert_source_f32.safetensors" : "expert_source_bf16.safetensors");
    ASSERT_TRUE(WriteSafetensors(path, Tensors(*all, 1, as_f32)).ok());
    // Rank 1 of 2: experts [2, 4).
    auto loaded = MakeHostExperts(ExpertSource::Safetensors(path, kPattern, 1, 4, 2, 2, 8, 4));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->first_expert(), 2);
    for (int l = 0; l < 2; ++l) {
      EXPECT_EQ(loaded->swiglu_weights(l).gate, all->swiglu_weights(2 + l).gate);
      EXPECT_EQ(loaded->swiglu_weights(l).up, all->swiglu_weights(2 + l).up);
      EXPECT_EQ(loaded->swiglu_weights(l).down, all->swiglu_weights(2 + l).down);
    }
    std::filesystem::remove(path);
  }

  auto identity = MakeHostExperts(ExpertSource::Identity(0, 8, 4, 4, 16));
  ASSERT_TRUE(identity.ok());
  EXPECT_EQ(identity->kind(), ExpertKind::kIdentity);
  EXPECT_EQ(identity->first_expert(), 4);
  EXPECT_EQ(identity->weight_bytes(), 0);

  const auto invalid = MakeHostExperts(ExpertSource::Seeded(1, 0, 8, 6, 4, 64, 16));
  EXPECT_EQ(invalid.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExpertSource, QuantizedFormatsAndInputScaling) {
  // issue 35: the kind follows the weight format; bytes are the format's.
  ExpertSource fp8 = ExpertSource::Seeded(1, 3, 256, 8, 4, 7168, 2048);
  fp8.weight_format = quant::ExpertWeightFormat::kFp8Block128;
  EXPECT_EQ(fp8.expert_kind(), ExpertKind::kFp8SwiGlu);
  EXPECT_EQ(fp8.weight_bytes(), 176203776);  // 4 * (44,040,192 + 10,752)
  ExpertSource small = ExpertSource::Seeded(1, 3, 16, 2, 2, 256, 128);
  small.weight_format = quant::ExpertWeightFormat::kFp8Block128;
  small.router_weight_use = RouterWeightUse::kScalesInput;
  absl::StatusOr<ExpertSet> made = MakeHostExperts(small);
  ASSERT_TRUE(made.ok()) << made.status();
  EXPECT_EQ(made->kind(), ExpertKind::kFp8SwiGlu);
  EXPECT_EQ(made->router_weight_use(), RouterWeightUse::kScalesInput);
  const ExpertSet direct = *ExpertSet::GenerateFp8SwiGlu(1, 3, 2, 2, 256, 128);
  EXPECT_EQ(made->fp8_weights(1).gate.codes, direct.fp8_weights(1).gate.codes);
  EXPECT_EQ(made->weight_bytes(), small.weight_bytes());

  ExpertSource oss = ExpertSource::Safetensors("/ckpt/gpt-oss", kPattern, 0, 32, 0, 4, 2880, 2880);
  oss.weight_format = quant::ExpertWeightFormat::kMxfp4;
  EXPECT_EQ(oss.expert_kind(), ExpertKind::kGptOssMxfp4);
  // gpt-oss's experts share one tensor a layer: the pattern is a prefix.
  absl::Status s = ValidateExpertSource(oss);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("a prefix with {layer}"));
  oss.name_pattern = "";
  EXPECT_TRUE(ValidateExpertSource(oss).ok());
  oss.hidden = 2880 + 16;
  EXPECT_THAT(ValidateExpertSource(oss).message(), HasSubstr("multiples of 32"));
}

}  // namespace
}  // namespace moe_ep::core
