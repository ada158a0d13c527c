#include "core/experts.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/agreement.h"
#include "core/safetensors.h"
#include "core/seeded_stream.h"
#include "core/stop_check.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

std::vector<bf16_t> ToBf16(const std::vector<float>& v) {
  std::vector<bf16_t> out;
  out.reserve(v.size());
  for (float f : v) out.push_back(FloatToBf16(f));
  return out;
}

SwiGluWeights RandomWeights(std::mt19937& rng, int64_t h, int64_t i) {
  std::uniform_real_distribution<float> u(-0.5f, 0.5f);
  SwiGluWeights w;
  for (int64_t j = 0; j < h * i; ++j) w.gate.push_back(FloatToBf16(u(rng)));
  for (int64_t j = 0; j < h * i; ++j) w.up.push_back(FloatToBf16(u(rng)));
  for (int64_t j = 0; j < h * i; ++j) w.down.push_back(FloatToBf16(u(rng)));
  return w;
}

// Naive double-precision SwiGLU of one row; also returns sum_j |down * act|
// per output element in `scale` (for the error bound).
std::vector<double> NaiveSwiGlu(const SwiGluWeights& w, const float* x, int64_t h, int64_t in,
                                std::vector<double>* scale) {
  std::vector<double> act(in);
  for (int64_t j = 0; j < in; ++j) {
    double g = 0, u = 0;
    for (int64_t c = 0; c < h; ++c) {
      g += double{Bf16ToFloat(w.gate[j * h + c])} * x[c];
      u += double{Bf16ToFloat(w.up[j * h + c])} * x[c];
    }
    act[j] = g / (1.0 + std::exp(-g)) * u;
  }
  std::vector<double> out(h, 0.0);
  scale->assign(h, 0.0);
  for (int64_t r = 0; r < h; ++r) {
    for (int64_t j = 0; j < in; ++j) {
      out[r] += double{Bf16ToFloat(w.down[r * in + j])} * act[j];
      (*scale)[r] += std::abs(double{Bf16ToFloat(w.down[r * in + j])} * act[j]);
    }
  }
  return out;
}

TEST(ExpertSet, HandComputedTwoByTwo) {
  // H = 2, I = 2. gate = I, up = [[1,1],[0,2]], down = [[1,0],[1,1]], x = [2,1]:
  // g = [2, 1], u = [3, 2], act = [3 silu(2), 2 silu(1)],
  // out = [act0, act0 + act1].
  SwiGluWeights w{ToBf16({1, 0, 0, 1}), ToBf16({1, 1, 0, 2}), ToBf16({1, 0, 1, 1})};
  auto set = ExpertSet::FromWeights(7, {w}, 2, 2);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->kind(), ExpertKind::kSwiGlu);
  EXPECT_EQ(set->weight_bytes(), 3 * 2 * 2 * 2);
  const std::vector<float> x = {2, 1};
  std::vector<float> out(2);
  ASSERT_TRUE(set->Apply(7, x, 1, absl::MakeSpan(out)).ok());
  const double act0 = 3.0 * 2.0 / (1.0 + std::exp(-2.0));  // 5.2847824...
  const double act1 = 2.0 * 1.0 / (1.0 + std::exp(-1.0));  // 1.4621171...
  EXPECT_NEAR(out[0], act0, 1e-5);
  EXPECT_NEAR(out[1], act0 + act1, 1e-5);
  EXPECT_NEAR(out[0], 5.2847824, 1e-5);
  EXPECT_NEAR(out[1], 6.7468996, 1e-5);
}

TEST(ExpertSet, SwiGluMatchesNaiveDouble) {
  // Tolerance: fp32 accumulation over H and I terms; per element
  // |blas - naive| <= 1e-5 * sum_j |down_rj * act_j| + 1e-6.
  constexpr int64_t kH = 64, kI = 48, kRows = 5;
  std::mt19937 rng(42);
  SwiGluWeights w = RandomWeights(rng, kH, kI);
  auto set = ExpertSet::FromWeights(0, {w}, kH, kI);
  ASSERT_TRUE(set.ok());
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(kRows * kH);
  for (float& v : x) v = n(rng);
  std::vector<float> out(kRows * kH);
  ASSERT_TRUE(set->Apply(0, x, kRows, absl::MakeSpan(out)).ok());
  for (int64_t r = 0; r < kRows; ++r) {
    std::vector<double> scale;
    const std::vector<double> ref = NaiveSwiGlu(w, x.data() + r * kH, kH, kI, &scale);
    for (int64_t c = 0; c < kH; ++c) {
      EXPECT_NEAR(out[r * kH + c], ref[c], 1e-5 * scale[c] + 1e-6) << "row " << r << " col " << c;
    }
  }
}

TEST(ExpertSet, IdentityReturnsInput) {
  ExpertSet set = ExpertSet::Identity(4, 4, 3);
  EXPECT_EQ(set.kind(), ExpertKind::kIdentity);
  EXPECT_EQ(set.weight_bytes(), 0);
  const std::vector<float> x = {1, -2, 3.5f, 0, 7, -8};
  std::vector<float> out(6, 99.0f);
  ASSERT_TRUE(set.Apply(5, x, 2, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, x);
}

// The tree's fingerprint over the little-endian bytes of a bf16 tensor.
uint64_t Fingerprint(const std::vector<bf16_t>& v) {
  std::string bytes;
  bytes.reserve(v.size() * 2);
  for (bf16_t x : v) {
    bytes.push_back(static_cast<char>(x & 0xffu));
    bytes.push_back(static_cast<char>(x >> 8));
  }
  return Fingerprint64(bytes);
}

// Seeded weights are part of the wire contract (workers and the reference
// regenerate them independently; kernels/seeded_weights.cuh makes them on
// the GPU), so their bits are pinned: fingerprints of the generator's bits
// as recorded at commit 981f0ae (before its stream moved to
// core/seeded_stream.h), re-expressed in FNV-1a's published offset basis when
// the tree's fingerprints became one (the first and last values, checked
// directly, are unchanged). Odd I * H (5 x 3) covers the half-pair tail.
TEST(ExpertSet, SeededWeightBitsArePinned) {
  struct Case {
    uint64_t seed;
    int layer;
    int expert;
    int64_t hidden, intermediate;
    uint64_t gate, up, down;
    bf16_t gate_first, down_last;
  };
  const Case cases[] = {
      {1, 0, 0, 64, 16, 0x6bb51e6799826434ull, 0x99363bcedd1d7521ull, 0x9093bc7c052e9d7eull, 0xbdf8,
       0xbdd3},
      {9, 4, 7, 5, 3, 0x9eb49d80d4a8e5b6ull, 0x1eae39f64fe3bb46ull, 0x7c6b25cd569c0202ull, 0x3e57,
       0xbe21},
      {0xdeadbeefull, 60, 255, 7168, 8, 0x2c8242552e56eca4ull, 0xbaf2683f18b8ab3cull,
       0x74cc91eabf1a2615ull, 0xbb54, 0x3e9a},
  };
  for (const Case& c : cases) {
    auto set = ExpertSet::GenerateSwiGlu(c.seed, c.layer, c.expert, 1, c.hidden, c.intermediate);
    ASSERT_TRUE(set.ok()) << set.status();
    const SwiGluWeights& w = set->swiglu_weights(0);
    EXPECT_EQ(Fingerprint(w.gate), c.gate) << "seed " << c.seed;
    EXPECT_EQ(Fingerprint(w.up), c.up) << "seed " << c.seed;
    EXPECT_EQ(Fingerprint(w.down), c.down) << "seed " << c.seed;
    EXPECT_EQ(w.gate.front(), c.gate_first);
    EXPECT_EQ(w.down.back(), c.down_last);
  }
}

// Sets large enough to be generated on several threads (2.4 M stream pairs;
// odd I * H so ranges end inside a tensor and at its half pair) hold exactly
// the stream's elements.
TEST(ExpertSet, LargeSeededSetEqualsStreamElementByElement) {
  constexpr int64_t kH = 1023, kI = 517;
  auto set = ExpertSet::GenerateSwiGlu(77, 2, 10, 3, kH, kI);
  ASSERT_TRUE(set.ok()) << set.status();
  const SeededUniform in = SeededUniformFor(kH), down = SeededUniformFor(kI);
  for (int l = 0; l < 3; ++l) {
    const SwiGluWeights& w = set->swiglu_weights(l);
    ASSERT_EQ(w.gate.size(), static_cast<size_t>(kH * kI));
    const uint64_t kg = SeededTensorKey(77, 2, 10 + l, SeededProjection::kGate);
    const uint64_t ku = SeededTensorKey(77, 2, 10 + l, SeededProjection::kUp);
    const uint64_t kd = SeededTensorKey(77, 2, 10 + l, SeededProjection::kDown);
    for (int64_t i = 0; i < kH * kI; ++i) {
      ASSERT_EQ(w.gate[i], SeededElement(kg, i, in)) << "expert " << 10 + l << " gate " << i;
      ASSERT_EQ(w.up[i], SeededElement(ku, i, in)) << "expert " << 10 + l << " up " << i;
      ASSERT_EQ(w.down[i], SeededElement(kd, i, down)) << "expert " << 10 + l << " down " << i;
    }
  }
}

// Apply widens large experts on several threads; ComputeWeightedSum widens
// on one. With weight 1 both run the same sgemm calls on the same fp32
// weights, so their outputs are equal bit for bit.
TEST(ExpertSet, ApplyOfLargeExpertEqualsComputeWeightedSum) {
  constexpr int64_t kH = 1024, kI = 384, kRows = 5;  // 3 * I * H = 1.2 M elements
  auto set = ExpertSet::GenerateSwiGlu(3, 1, 0, 2, kH, kI);
  ASSERT_TRUE(set.ok());
  std::mt19937 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(kRows * kH);
  for (float& v : x) v = u(rng);
  std::vector<float> applied(kRows * kH), summed(kRows * kH);
  ASSERT_TRUE(set->Apply(1, x, kRows, absl::MakeSpan(applied)).ok());
  const std::vector<int32_t> ids(kRows, 1);
  const std::vector<float> ones(kRows, 1.0f);
  ASSERT_TRUE(set->ComputeWeightedSum(x, ids, ones, kRows, 1, absl::MakeSpan(summed)).ok());
  EXPECT_EQ(applied, summed);
  // The scratch overload: same bits; scratch grown once, then reused.
  std::vector<float> scratch, with_scratch(kRows * kH);
  ASSERT_TRUE(set->Apply(1, x, kRows, absl::MakeSpan(with_scratch), scratch).ok());
  EXPECT_EQ(with_scratch, applied);
  EXPECT_EQ(scratch.size(), static_cast<size_t>(3 * kI * kH + kRows * 2 * kI));
  std::vector<float> again(kRows * kH);
  ASSERT_TRUE(set->Apply(0, x, kRows, absl::MakeSpan(again), scratch).ok());  // other expert
  ASSERT_TRUE(set->Apply(1, x, kRows, absl::MakeSpan(again), scratch).ok());
  EXPECT_EQ(again, applied);
  EXPECT_EQ(scratch.size(), static_cast<size_t>(3 * kI * kH + kRows * 2 * kI));
  float max_abs = 0;
  for (float v : applied) max_abs = std::max(max_abs, std::abs(v));
  EXPECT_GT(max_abs, 0.0f);
}

TEST(ExpertSet, SeedOriginOnlyForGeneratedSets) {
  auto seeded = ExpertSet::GenerateSwiGlu(42, 5, 0, 2, 8, 4);
  ASSERT_TRUE(seeded.ok());
  ASSERT_TRUE(seeded->seed_origin().has_value());
  EXPECT_EQ(seeded->seed_origin()->seed, 42u);
  EXPECT_EQ(seeded->seed_origin()->layer, 5);
  EXPECT_FALSE(ExpertSet::Identity(0, 2, 8).seed_origin().has_value());
  auto given = ExpertSet::FromWeights(0, {seeded->swiglu_weights(0)}, 8, 4);
  ASSERT_TRUE(given.ok());
  EXPECT_FALSE(given->seed_origin().has_value());
}

TEST(ExpertSet, SeededWeightsArePureFunctionOfSeedLayerExpert) {
  constexpr int64_t kH = 32, kI = 16;
  auto a = ExpertSet::GenerateSwiGlu(7, 3, 0, 4, kH, kI);
  auto b = ExpertSet::GenerateSwiGlu(7, 3, 2, 1, kH, kI);  // expert 2 alone
  auto other_seed = ExpertSet::GenerateSwiGlu(8, 3, 2, 1, kH, kI);
  auto other_layer = ExpertSet::GenerateSwiGlu(7, 4, 2, 1, kH, kI);
  ASSERT_TRUE(a.ok() && b.ok() && other_seed.ok() && other_layer.ok());
  EXPECT_EQ(a->weight_bytes(), 4 * 3 * kH * kI * 2);

  const SwiGluWeights& w2 = a->swiglu_weights(2);
  const SwiGluWeights& w2_alone = b->swiglu_weights(0);
  EXPECT_EQ(w2.gate, w2_alone.gate);
  EXPECT_EQ(w2.up, w2_alone.up);
  EXPECT_EQ(w2.down, w2_alone.down);
  EXPECT_NE(w2.gate, a->swiglu_weights(1).gate);  // different expert
  EXPECT_NE(w2.gate, w2.up);                      // different projection
  EXPECT_NE(w2.gate, other_seed->swiglu_weights(0).gate);
  EXPECT_NE(w2.gate, other_layer->swiglu_weights(0).gate);

  // Values are uniform in [-s, s], s = 1/sqrt(fan_in): bounded, mean ~ 0,
  // variance ~ s^2 / 3.
  auto check = [](const std::vector<bf16_t>& v, double s) {
    double sum = 0, sq = 0, max_abs = 0;
    for (bf16_t b : v) {
      const double f = Bf16ToFloat(b);
      sum += f;
      sq += f * f;
      max_abs = std::max(max_abs, std::abs(f));
    }
    const double n = static_cast<double>(v.size());
    EXPECT_LE(max_abs, s * (1 + 1.0 / 128));  // bf16 rounding may reach just past s
    EXPECT_NEAR(sum / n, 0.0, 0.1 * s);
    EXPECT_NEAR(sq / n, s * s / 3, 0.15 * s * s / 3);
  };
  check(w2.gate, 1 / std::sqrt(32.0));
  check(w2.down, 1 / std::sqrt(16.0));

  // Same seed -> identical outputs.
  std::vector<float> x(kH, 0.5f), y1(kH), y2(kH);
  ASSERT_TRUE(a->Apply(2, x, 1, absl::MakeSpan(y1)).ok());
  ASSERT_TRUE(b->Apply(2, x, 1, absl::MakeSpan(y2)).ok());
  EXPECT_EQ(y1, y2);
}

TEST(ExpertSet, GenerateRejectsBadSizes) {
  auto h = ExpertSet::GenerateSwiGlu(1, 0, 0, 1, 0, 4);
  EXPECT_EQ(h.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(h.status().message(), HasSubstr("hidden"));
  auto i = ExpertSet::GenerateSwiGlu(1, 0, 0, 1, 4, 0);
  EXPECT_EQ(i.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(i.status().message(), HasSubstr("intermediate"));
  auto n = ExpertSet::GenerateSwiGlu(1, 0, 0, -1, 4, 4);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(n.status().message(), HasSubstr("num_experts"));
  auto f = ExpertSet::FromWeights(0, {SwiGluWeights{}}, 4, 4);
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(f.status().message(), HasSubstr("weights[0]"));
}

TEST(ExpertSet, ApplyRejectsForeignExpertAndShortSpans) {
  auto set = ExpertSet::GenerateSwiGlu(1, 0, 4, 4, 8, 4);
  ASSERT_TRUE(set.ok());
  std::vector<float> x(16), out(16);
  auto foreign = set->Apply(3, x, 1, absl::MakeSpan(out));
  EXPECT_EQ(foreign.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(foreign.message(), HasSubstr("got 3"));
  auto shortspan = set->Apply(4, x, 3, absl::MakeSpan(out));
  EXPECT_EQ(shortspan.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(shortspan.message(), HasSubstr("rows * H"));
}

TEST(ExpertSet, ComputeWeightedSumMixedLocalAndForeignIds) {
  // The set owns experts [4, 8) of 16. K = 3.
  constexpr int64_t kH = 16, kI = 8, kRows = 5;
  constexpr int kK = 3;
  auto set = ExpertSet::GenerateSwiGlu(11, 2, 4, 4, kH, kI);
  ASSERT_TRUE(set.ok());
  const std::vector<int32_t> ids = {
      5,  2,  7,   // two local
      -1, 16, 1,   // none local: zeros
      6,  6,  4,   // duplicate local id counts twice
      4,  12, -1,  // one local
      7,  5,  6,   // all local
  };
  const std::vector<float> w = {0.5f, 0.3f, 0.2f, 0.4f, 0.4f, 0.2f, 0.25f, 0.25f,
                                0.5f, 0.9f, 0.1f, 0.0f, 0.1f, 0.2f, 0.7f};
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0.0f, 1.0f);
  std::vector<float> x(kRows * kH);
  for (float& v : x) v = n(rng);
  std::vector<float> out(kRows * kH, 123.0f);
  ASSERT_TRUE(set->ComputeWeightedSum(x, ids, w, kRows, kK, absl::MakeSpan(out)).ok());

  // Reference: per (row, k) single-row Apply, summed in double.
  for (int64_t r = 0; r < kRows; ++r) {
    std::vector<double> ref(kH, 0.0);
    for (int k = 0; k < kK; ++k) {
      const int32_t id = ids[r * kK + k];
      if (!set->Owns(id)) continue;
      std::vector<float> y(kH);
      ASSERT_TRUE(
          set->Apply(id, absl::MakeConstSpan(x).subspan(r * kH, kH), 1, absl::MakeSpan(y)).ok());
      for (int64_t c = 0; c < kH; ++c) ref[c] += double{w[r * kK + k]} * y[c];
    }
    for (int64_t c = 0; c < kH; ++c) {
      if (r == 1) {
        EXPECT_EQ(out[r * kH + c], 0.0f);
      } else {
        EXPECT_NEAR(out[r * kH + c], ref[c], 1e-5 * (1 + std::abs(ref[c]))) << r << "," << c;
      }
    }
  }
}

// Issue 13 item 6 (fuzz-long run 5): the expert loop polls its StopCheck
// before each expert with rows and, once it answers true, returns the
// LocalStop at once: here rows hit all 4 experts, the check answers true
// on its 3rd poll, so exactly 2 experts ran and no 4th poll was made.
// Without a stop (and with one that never fires) the sum is the same.
TEST(ExpertSet, ComputeWeightedSumStopsBetweenExperts) {
  constexpr int64_t kH = 16, kI = 8, kRows = 4;
  auto set = ExpertSet::GenerateSwiGlu(11, 2, 0, 4, kH, kI);
  ASSERT_TRUE(set.ok());
  const std::vector<int32_t> ids = {0, 1, 1, 2, 2, 3, 3, 0};
  const std::vector<float> w(kRows * 2, 0.5f);
  std::vector<float> x(kRows * kH);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.7 * i));
  std::vector<float> plain(kRows * kH), never(kRows * kH), stopped(kRows * kH);
  ASSERT_TRUE(set->ComputeWeightedSum(x, ids, w, kRows, 2, absl::MakeSpan(plain)).ok());
  int polls = 0;
  ASSERT_TRUE(set->ComputeWeightedSum(x, ids, w, kRows, 2, absl::MakeSpan(never),
                                      [&] {
                                        ++polls;
                                        return false;
                                      })
                  .ok());
  EXPECT_EQ(polls, 4);  // one per expert with rows
  EXPECT_EQ(never, plain);
  polls = 0;
  const absl::Status s = set->ComputeWeightedSum(x, ids, w, kRows, 2, absl::MakeSpan(stopped),
                                                 [&] { return ++polls >= 3; });
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_TRUE(IsLocalStop(s));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("expert compute: after 2 of 4 experts with rows"));
  EXPECT_EQ(polls, 3);
}

// GenerateSwiGlu polls before each kGenerateStopChunk weights: a set of
// 3 * 2 * kGenerateStopChunk weights stops on the poll that answers true
// (the 4th: after 3 chunks), and with a check that never fires makes the
// same bits as without one.
TEST(ExpertSet, GenerateSwiGluStopsBetweenWeightChunks) {
  constexpr int64_t kH = 1024;
  const int64_t kI = 2 * kGenerateStopChunk / kH;  // 2 chunks per tensor, 6 in all
  int polls = 0;
  const auto stopped = ExpertSet::GenerateSwiGlu(5, 1, 0, 1, kH, kI, [&] { return ++polls >= 4; });
  EXPECT_EQ(stopped.status().code(), absl::StatusCode::kCancelled) << stopped.status();
  EXPECT_TRUE(IsLocalStop(stopped.status()));
  EXPECT_THAT(
      std::string(stopped.status().message()),
      HasSubstr(absl::StrCat("weight generation (layer 1, experts 0-0): after ",
                             3 * kGenerateStopChunk, " of ", 6 * kGenerateStopChunk, " weights")));
  EXPECT_EQ(polls, 4);
  polls = 0;
  const auto checked = ExpertSet::GenerateSwiGlu(5, 1, 0, 1, kH, kI, [&] {
    ++polls;
    return false;
  });
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_EQ(polls, 6);
  const auto plain = ExpertSet::GenerateSwiGlu(5, 1, 0, 1, kH, kI);
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(checked->swiglu_weights(0).gate, plain->swiglu_weights(0).gate);
  EXPECT_EQ(checked->swiglu_weights(0).up, plain->swiglu_weights(0).up);
  EXPECT_EQ(checked->swiglu_weights(0).down, plain->swiglu_weights(0).down);
}

TEST(ExpertSet, ComputeWeightedSumIdentity) {
  // Identity experts: out = (sum of local weights) * x.
  ExpertSet set = ExpertSet::Identity(0, 2, 2);
  const std::vector<float> x = {1, 2, 3, 4};
  const std::vector<int32_t> ids = {0, 1, 2, 1};  // row 1: expert 2 is not local
  const std::vector<float> w = {0.25f, 0.5f, 0.75f, 0.125f};
  std::vector<float> out(4);
  ASSERT_TRUE(set.ComputeWeightedSum(x, ids, w, 2, 2, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, (std::vector<float>{0.75f, 1.5f, 0.375f, 0.5f}));
}

TEST(ExpertSet, ComputeWeightedSumRejectsShortSpans) {
  ExpertSet set = ExpertSet::Identity(0, 2, 2);
  std::vector<float> x(4), out(4), w(3);
  std::vector<int32_t> ids(4);
  auto s = set.ComputeWeightedSum(x, ids, w, 2, 2, absl::MakeSpan(out));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("ids/weights"));
  auto k = set.ComputeWeightedSum(x, ids, w, 2, 0, absl::MakeSpan(out));
  EXPECT_EQ(k.code(), absl::StatusCode::kInvalidArgument);
}

// Writes the experts of `set` as a checkpoint with Hugging Face names.
std::vector<SafetensorsTensor> ExpertTensors(const ExpertSet& set, const std::string& pattern,
                                             int layer, bool as_f32) {
  std::vector<SafetensorsTensor> out;
  const char* projs[3] = {"gate_proj", "up_proj", "down_proj"};
  for (int i = 0; i < set.num_experts(); ++i) {
    const SwiGluWeights& w = set.swiglu_weights(i);
    const std::vector<bf16_t>* mats[3] = {&w.gate, &w.up, &w.down};
    for (int p = 0; p < 3; ++p) {
      SafetensorsTensor t;
      t.name = absl::StrReplaceAll(pattern, {{"{layer}", std::to_string(layer)},
                                             {"{expert}", std::to_string(set.first_expert() + i)},
                                             {"{proj}", projs[p]}});
      t.shape = p < 2 ? std::vector<int64_t>{set.intermediate(), set.hidden()}
                      : std::vector<int64_t>{set.hidden(), set.intermediate()};
      if (as_f32) {
        t.dtype = SafetensorsDType::kF32;
        for (bf16_t b : *mats[p]) {
          const float f = Bf16ToFloat(b);
          uint8_t bytes[4];
          std::memcpy(bytes, &f, 4);
          t.data.insert(t.data.end(), bytes, bytes + 4);
        }
      } else {
        t.dtype = SafetensorsDType::kBF16;
        for (bf16_t b : *mats[p]) {
          t.data.push_back(static_cast<uint8_t>(b & 0xff));
          t.data.push_back(static_cast<uint8_t>(b >> 8));
        }
      }
      out.push_back(std::move(t));
    }
  }
  return out;
}

TEST(ExpertSet, LoadSafetensorsRoundTrip) {
  constexpr int64_t kH = 8, kI = 4;
  const std::string pattern = "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight";
  auto src = ExpertSet::GenerateSwiGlu(5, 1, 0, 4, kH, kI);
  ASSERT_TRUE(src.ok());
  for (bool as_f32 : {false, true}) {
    const std::string path = (std::filesystem::path(::testing::TempDir()) /
                              (as_f32 ? "experts_f32.safetensors" : "experts_bf16.safetensors"))
                                 .string();
    ASSERT_TRUE(WriteSafetensors(path, ExpertTensors(*src, pattern, 1, as_f32)).ok());
    // Load experts 2..3 only, as rank 1 of 2 would.
    auto loaded = ExpertSet::LoadSafetensors(path, pattern, 1, 2, 2, kH, kI);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ(loaded->first_expert(), 2);
    EXPECT_EQ(loaded->num_experts(), 2);
    for (int i = 0; i < 2; ++i) {
      EXPECT_EQ(loaded->swiglu_weights(i).gate, src->swiglu_weights(2 + i).gate);
      EXPECT_EQ(loaded->swiglu_weights(i).up, src->swiglu_weights(2 + i).up);
      EXPECT_EQ(loaded->swiglu_weights(i).down, src->swiglu_weights(2 + i).down);
    }
  }
}

TEST(ExpertSet, LoadSafetensorsMixtralNames) {
  constexpr int64_t kH = 4, kI = 2;
  auto src = ExpertSet::GenerateSwiGlu(9, 0, 0, 1, kH, kI);
  ASSERT_TRUE(src.ok());
  // Mixtral: w1 = gate, w3 = up, w2 = down.
  std::vector<SafetensorsTensor> tensors = ExpertTensors(
      *src, "model.layers.{layer}.block_sparse_moe.experts.{expert}.{proj}.weight", 0, false);
  for (auto& t : tensors) {
    t.name =
        absl::StrReplaceAll(t.name, {{"gate_proj", "w1"}, {"up_proj", "w3"}, {"down_proj", "w2"}});
  }
  const std::string path =
      (std::filesystem::path(::testing::TempDir()) / "mixtral.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(path, tensors).ok());
  auto loaded = ExpertSet::LoadSafetensors(
      path, "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight", 0, 0, 1, kH, kI);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(loaded->swiglu_weights(0).up, src->swiglu_weights(0).up);
  EXPECT_EQ(loaded->swiglu_weights(0).down, src->swiglu_weights(0).down);
}

TEST(ExpertSet, LoadSafetensorsErrors) {
  constexpr int64_t kH = 8, kI = 4;
  const std::string pattern = "layers.{layer}.experts.{expert}.{proj}.weight";
  auto src = ExpertSet::GenerateSwiGlu(5, 0, 0, 2, kH, kI);
  ASSERT_TRUE(src.ok());
  const std::string path =
      (std::filesystem::path(::testing::TempDir()) / "experts_err.safetensors").string();
  ASSERT_TRUE(WriteSafetensors(path, ExpertTensors(*src, pattern, 0, false)).ok());

  auto missing_file = ExpertSet::LoadSafetensors(path + ".nope", pattern, 0, 0, 2, kH, kI);
  EXPECT_EQ(missing_file.status().code(), absl::StatusCode::kNotFound);
  auto missing_tensor = ExpertSet::LoadSafetensors(path, pattern, 0, 1, 2, kH, kI);
  EXPECT_EQ(missing_tensor.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing_tensor.status().message(), HasSubstr("layers.0.experts.2.gate_proj"));
  auto wrong_layer = ExpertSet::LoadSafetensors(path, pattern, 1, 0, 1, kH, kI);
  EXPECT_EQ(wrong_layer.status().code(), absl::StatusCode::kNotFound);
  auto wrong_shape = ExpertSet::LoadSafetensors(path, pattern, 0, 0, 1, kI, kH);
  EXPECT_EQ(wrong_shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(wrong_shape.status().message(), HasSubstr("expected [8, 4], got [4, 8]"));
  auto bad_pattern = ExpertSet::LoadSafetensors(path, "layers.{layer}.gate", 0, 0, 1, kH, kI);
  EXPECT_EQ(bad_pattern.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad_pattern.status().message(), HasSubstr("name_pattern"));
}

TEST(CheckSwiGluDims, NamesEachFieldAndValue) {
  EXPECT_TRUE(CheckSwiGluDims(0, 0, 1, 1).ok());
  EXPECT_TRUE(CheckSwiGluDims(3, 2, 64, 128).ok());
  const struct {
    int first, count;
    int64_t hidden, intermediate;
    const char* message;
  } cases[] = {
      {0, 1, 0, 8, "hidden: expected >= 1, got 0"},
      {0, 1, 8, -2, "intermediate: expected >= 1, got -2"},
      {0, -1, 8, 8, "num_experts: expected >= 0, got -1"},
      {-3, 1, 8, 8, "first_expert: expected >= 0, got -3"},
      // The checks run in this order: hidden is named first.
      {-1, -1, 0, 0, "hidden: expected >= 1, got 0"},
  };
  for (const auto& c : cases) {
    const absl::Status s = CheckSwiGluDims(c.first, c.count, c.hidden, c.intermediate);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(s.message(), c.message);
  }
}

// --- Union: the slots of a rank under a placement table (DESIGN §15) -------

TEST(ExpertSetUnion, HoldsTheIdsOfItsPartsWithTheirBits) {
  auto five = ExpertSet::GenerateSwiGlu(3, 1, 5, 1, 8, 4).value();
  auto one_two = ExpertSet::GenerateSwiGlu(3, 1, 1, 2, 8, 4).value();
  auto set = ExpertSet::Union({std::move(five), std::move(one_two)});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->expert_ids(), (std::vector<int>{1, 2, 5}));
  EXPECT_FALSE(set->contiguous());
  EXPECT_EQ(set->first_expert(), 1);
  EXPECT_EQ(set->num_experts(), 3);
  EXPECT_TRUE(set->Owns(5));
  EXPECT_FALSE(set->Owns(3));
  EXPECT_EQ(set->LocalIndex(5), 2);
  EXPECT_EQ(set->LocalIndex(0), -1);
  EXPECT_EQ(set->weight_bytes(), 3 * 3 * 8 * 4 * 2);
  // Expert 5's weights are those a one-expert set generates.
  const auto alone = ExpertSet::GenerateSwiGlu(3, 1, 5, 1, 8, 4).value();
  EXPECT_EQ(set->swiglu_weights(2).gate, alone.swiglu_weights(0).gate);
  EXPECT_EQ(set->swiglu_weights(2).down, alone.swiglu_weights(0).down);
  std::vector<float> x(8, 0.5f), a(8), b(8);
  ASSERT_TRUE(set->Apply(5, x, 1, absl::MakeSpan(a)).ok());
  ASSERT_TRUE(alone.Apply(5, x, 1, absl::MakeSpan(b)).ok());
  EXPECT_EQ(a, b);
  EXPECT_EQ(set->Apply(3, x, 1, absl::MakeSpan(a)).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ExpertSetUnion, ARangeIsTheRangesSet) {
  auto set = ExpertSet::Union({ExpertSet::Identity(2, 1, 4), ExpertSet::Identity(0, 2, 4)});
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_TRUE(set->contiguous());
  EXPECT_EQ(set->first_expert(), 0);
  EXPECT_EQ(set->num_experts(), 3);
}

TEST(ExpertSetUnion, RejectsOverlapMixedKindsAndNothing) {
  EXPECT_EQ(ExpertSet::Union({}).status().code(), absl::StatusCode::kInvalidArgument);
  auto overlap = ExpertSet::Union({ExpertSet::Identity(0, 2, 4), ExpertSet::Identity(1, 1, 4)});
  EXPECT_EQ(overlap.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(overlap.status().message(), HasSubstr("expert 1 is held by parts 0 and 1"));
  auto mixed = ExpertSet::Union(
      {ExpertSet::Identity(0, 1, 8), ExpertSet::GenerateSwiGlu(1, 0, 1, 1, 8, 4).value()});
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
}

// --- quantized kinds and Llama-4's input scaling (issue 35) --------------

// out[r] = sum over local k, ascending expert, of term(e, r, w) where term is
// w * Apply(e, x_r) (output scaling) or Apply(e, w * x_r) (input scaling).
std::vector<float> WeightedSumOfApply(const ExpertSet& set, const std::vector<float>& x,
                                      const std::vector<int32_t>& ids,
                                      const std::vector<float>& weights, int64_t rows, int top_k,
                                      bool scale_input) {
  const int64_t h = set.hidden();
  std::vector<float> out(rows * h, 0.0f), xr(h), yr(h);
  for (int e : set.expert_ids()) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int k = 0; k < top_k; ++k) {
        if (ids[r * top_k + k] != e) continue;
        const float w = weights[r * top_k + k];
        for (int64_t c = 0; c < h; ++c) xr[c] = scale_input ? w * x[r * h + c] : x[r * h + c];
        EXPECT_TRUE(set.Apply(e, xr, 1, absl::MakeSpan(yr)).ok());
        for (int64_t c = 0; c < h; ++c) out[r * h + c] += (scale_input ? 1.0f : w) * yr[c];
      }
    }
  }
  return out;
}

struct Routed {
  std::vector<float> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// 5 rows, top-2, over experts 0..7 (some foreign to a set holding 4..6).
Routed SomeRows(int64_t h) {
  std::mt19937 rng(17);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  Routed r;
  for (int64_t i = 0; i < 5 * h; ++i) r.x.push_back(Bf16ToFloat(FloatToBf16(u(rng))));
  r.ids = {4, 6, 5, 1, 0, 7, 6, 4, 5, -1};
  r.weights = {0.7f, 0.3f, 0.6f, 0.4f, 0.5f, 0.5f, 0.9f, 0.1f, 1.0f, 0.0f};
  return r;
}

TEST(ExpertSet, Fp8ComputeWeightedSumIsTheSumOfApply) {
  absl::StatusOr<ExpertSet> set = ExpertSet::GenerateFp8SwiGlu(3, 2, 4, 3, 256, 128);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->kind(), ExpertKind::kFp8SwiGlu);
  EXPECT_EQ(set->weight_bytes(),
            3 * quant::ExpertWeightBytes(quant::ExpertWeightFormat::kFp8Block128, 256, 128));
  ASSERT_TRUE(set->seed_origin().has_value());
  // The seeded fp8 weights are the seeded bf16 weights, quantized.
  const ExpertSet bf16 = *ExpertSet::GenerateSwiGlu(3, 2, 5, 1, 256, 128);
  EXPECT_EQ(set->fp8_weights(1).up.codes,
            quant::QuantizeFp8Block(bf16.swiglu_weights(0).up, 128, 256).codes);
  const Routed r = SomeRows(256);
  std::vector<float> out(5 * 256);
  ASSERT_TRUE(set->ComputeWeightedSum(r.x, r.ids, r.weights, 5, 2, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, WeightedSumOfApply(*set, r.x, r.ids, r.weights, 5, 2, false));
  // Row 2 (experts 0, 7) has no local expert.
  EXPECT_TRUE(
      std::all_of(out.begin() + 2 * 256, out.begin() + 3 * 256, [](float v) { return v == 0.0f; }));
}

TEST(ExpertSet, GptOssComputeWeightedSumIsTheSumOfApply) {
  quant::GptOssActivation act;
  act.limit = 3.0f;
  absl::StatusOr<ExpertSet> set = ExpertSet::GenerateGptOss(3, 2, 4, 3, 64, 96, act);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ(set->kind(), ExpertKind::kGptOssMxfp4);
  EXPECT_EQ(set->gpt_oss_activation().limit, 3.0f);
  EXPECT_EQ(set->weight_bytes(),
            3 * quant::ExpertWeightBytes(quant::ExpertWeightFormat::kMxfp4, 64, 96));
  const Routed r = SomeRows(64);
  std::vector<float> out(5 * 64);
  ASSERT_TRUE(set->ComputeWeightedSum(r.x, r.ids, r.weights, 5, 2, absl::MakeSpan(out)).ok());
  EXPECT_EQ(out, WeightedSumOfApply(*set, r.x, r.ids, r.weights, 5, 2, false));
  // Apply is the reference's expert function with the set's activation.
  std::vector<float> y(64), want(64);
  ASSERT_TRUE(set->Apply(5, absl::MakeConstSpan(r.x.data(), 64), 1, absl::MakeSpan(y)).ok());
  ASSERT_TRUE(quant::GptOssExpertForward(set->gpt_oss_weights(1),
                                         absl::MakeConstSpan(r.x.data(), 64), 1, act,
                                         absl::MakeSpan(want))
                  .ok());
  EXPECT_EQ(y, want);
}

TEST(ExpertSet, InputScalingComputesExpertOfScaledInput) {
  // Llama-4: e(w * x). For SwiGLU e(w x) != w e(x), so the two uses differ.
  ExpertSet set = *ExpertSet::GenerateSwiGlu(8, 1, 4, 3, 64, 32);
  set.set_router_weight_use(RouterWeightUse::kScalesInput);
  const Routed r = SomeRows(64);
  std::vector<float> out(5 * 64);
  ASSERT_TRUE(set.ComputeWeightedSum(r.x, r.ids, r.weights, 5, 2, absl::MakeSpan(out)).ok());
  const std::vector<float> input = WeightedSumOfApply(set, r.x, r.ids, r.weights, 5, 2, true);
  const std::vector<float> output = WeightedSumOfApply(set, r.x, r.ids, r.weights, 5, 2, false);
  for (size_t i = 0; i < out.size(); ++i) {
    // Same arithmetic up to the grouping of rows in one sgemm.
    EXPECT_NEAR(out[i], input[i], 1e-5f * (std::abs(input[i]) + 1e-3f)) << i;
  }
  double differ = 0.0;
  for (size_t i = 0; i < out.size(); ++i)
    differ = std::max<double>(differ, std::abs(out[i] - output[i]));
  EXPECT_GT(differ, 1e-3);
  // Identity experts: w x either way.
  ExpertSet id = ExpertSet::Identity(4, 3, 64);
  id.set_router_weight_use(RouterWeightUse::kScalesInput);
  std::vector<float> id_out(5 * 64);
  ASSERT_TRUE(id.ComputeWeightedSum(r.x, r.ids, r.weights, 5, 2, absl::MakeSpan(id_out)).ok());
  EXPECT_FLOAT_EQ(id_out[0], (0.7f + 0.3f) * r.x[0]);
}

TEST(ExpertSetUnion, QuantizedPartsKeepTheirBitsAndKind) {
  ExpertSet a = *ExpertSet::GenerateFp8SwiGlu(3, 2, 0, 1, 128, 128);
  ExpertSet b = *ExpertSet::GenerateFp8SwiGlu(3, 2, 5, 2, 128, 128);
  const std::vector<uint8_t> codes = b.fp8_weights(1).down.codes;
  absl::StatusOr<ExpertSet> u = ExpertSet::Union({std::move(b), std::move(a)});
  ASSERT_TRUE(u.ok()) << u.status();
  EXPECT_EQ(u->kind(), ExpertKind::kFp8SwiGlu);
  EXPECT_EQ(u->expert_ids(), (std::vector<int>{0, 5, 6}));
  EXPECT_EQ(u->fp8_weights(2).down.codes, codes);
  auto mixed = ExpertSet::Union({*ExpertSet::GenerateFp8SwiGlu(3, 2, 0, 1, 128, 128),
                                 *ExpertSet::GenerateSwiGlu(3, 2, 1, 1, 128, 128)});
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(mixed.status().message(), HasSubstr("fp8-swiglu"));
}

TEST(ExpertSet, QuantizedFactoriesNameTheBadTensor) {
  std::vector<quant::Fp8SwiGluWeights> w = {*quant::GenerateFp8SwiGlu(1, 0, 0, 128, 64)};
  w[0].down.scale_inv.pop_back();
  const absl::Status s = ExpertSet::FromFp8Weights(7, std::move(w), 128, 64).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("expert 7 down_proj: scale_inv"));
  EXPECT_EQ(ExpertSet::GenerateGptOss(1, 0, 0, 1, 64, 48).status().code(),
            absl::StatusCode::kInvalidArgument);  // I not a multiple of 32
}

}  // namespace
}  // namespace moe_ep::core
