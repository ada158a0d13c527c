// Integration tests of ForwardLayers (proto/moe_ep/v1/worker.proto,
// server/layer_stack_runner.h): real moe-ep-worker processes on loopback
// (Gloo), driven by the fake coordinator, run a stack of dense and sparse
// decoder layers under DP attention + EP; every DP group's output is checked
// against core::ReferenceLayerStack computed in this process. Issue 4.

#include "core/layer_stack.h"

#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/grpc_status.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

// core/layer_stack.h: with sparse layers, |out - ref| <= 2^-7 (1 + |ref|)
// (fp32 reassociation plus at most a flipped bf16 rounding at the MoE
// boundary); dense-only stacks 1e-4 (1 + |ref|).
constexpr double kSparseTol = 1.0 / 128.0;
constexpr double kDenseTol = 1e-4;

constexpr int64_t kHidden = 32;
constexpr int64_t kDenseI = 64;
constexpr int64_t kMoeI = 32;
constexpr int kExperts = 8;
constexpr int kTopK = 3;
constexpr uint64_t kStackSeed = 7;
constexpr int64_t kStackCapacity = 64;

struct Layout {
  int tp;
  int attn_dp;
  int moe_dense_tp = 0;
  std::vector<bool> sparse = {false, true, true, false, true};
  bool a2a = true;
};

v1::ConfigureLayersRequest ConfigureRequest(const Layout& l) {
  v1::ConfigureLayersRequest request;
  request.mutable_layout()->set_tp_size(l.tp);
  request.mutable_layout()->set_attn_dp_size(l.attn_dp);
  request.mutable_layout()->set_moe_dense_tp_size(l.moe_dense_tp);
  request.set_a2a_enabled(l.a2a);
  v1::ModelDescription* m = request.mutable_model();
  m->set_name("stack-test");
  m->set_hidden_size(kHidden);
  m->set_num_layers(static_cast<int>(l.sparse.size()));
  m->set_num_experts(kExperts);
  m->set_top_k(kTopK);
  m->set_moe_intermediate_size(kMoeI);
  for (bool s : l.sparse) m->add_sparse_layers(s);
  return request;
}

// The same stack as the workers run, built here independently of the server.
core::LayerStackConfig ReferenceConfig(const Layout& l) {
  core::LayerStackConfig c;
  c.layout = core::ParallelLayout{l.tp, l.attn_dp, l.moe_dense_tp};
  c.sparse_layers = l.sparse;
  c.a2a_enabled = l.a2a;
  c.hidden = kHidden;
  c.dense_intermediate = kDenseI;
  c.moe_intermediate = kMoeI;
  c.num_experts = kExperts;
  c.top_k = kTopK;
  c.seed = kStackSeed;
  c.rms_eps = 1e-6f;
  c.capacity_tokens = kStackCapacity;
  return c;
}

v1::LayerStackSpec Spec() {
  v1::LayerStackSpec spec;  // hidden, experts, top_k, expert I from the model
  spec.set_dense_intermediate_size(kDenseI);
  spec.set_seed(kStackSeed);
  spec.set_capacity_tokens(kStackCapacity);
  return spec;
}

std::vector<float> GroupTokens(int g, int64_t n) {
  std::vector<float> x;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < kHidden; ++c) {
      x.push_back(static_cast<float>(std::sin(0.37 * (i + 1) + 0.11 * c + 1.3 * g) +
                                     0.1 * ((c * 7 + i) % 5)));
    }
  }
  return x;
}

// Rank r's request: its DP group's tokens.
std::vector<v1::ForwardLayersRequest> Requests(const Layout& l, const std::vector<int64_t>& counts,
                                               int64_t epoch) {
  const int attn_tp = l.tp / l.attn_dp;
  std::vector<v1::ForwardLayersRequest> requests(l.tp);
  for (int r = 0; r < l.tp; ++r) {
    const int g = r / attn_tp;
    requests[r].set_epoch(epoch);
    *requests[r].mutable_stack() = Spec();
    *requests[r].mutable_tokens() = Fp32Tensor(GroupTokens(g, counts[g]), counts[g], kHidden);
  }
  return requests;
}

// Runs one step and checks every rank's output against the reference.
void ExpectStackMatchesReference(FakeCoordinator& fake, const Layout& l,
                                 const std::vector<int64_t>& counts, int64_t epoch,
                                 const std::string& expected_padding) {
  SCOPED_TRACE(absl::StrCat("tp ", l.tp, " attn_dp ", l.attn_dp, " moe_dense_tp ", l.moe_dense_tp,
                            " epoch ", epoch));
  auto responses = fake.coordinator().ForwardLayers(Requests(l, counts, epoch));
  ASSERT_TRUE(responses.ok()) << responses.status();
  std::vector<std::vector<float>> inputs;
  inputs.reserve(l.attn_dp);
  for (int g = 0; g < l.attn_dp; ++g) inputs.push_back(GroupTokens(g, counts[g]));
  auto ref = core::ReferenceLayerStack(ReferenceConfig(l), inputs);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const bool any_sparse = std::find(l.sparse.begin(), l.sparse.end(), true) != l.sparse.end();
  const double tol = any_sparse ? kSparseTol : kDenseTol;
  const int attn_tp = l.tp / l.attn_dp;
  double ref_max = 0;
  for (float v : *ref) ref_max = std::max(ref_max, static_cast<double>(std::abs(v)));
  for (int r = 0; r < l.tp; ++r) {
    const v1::ForwardLayersResponse& resp = (*responses)[r];
    const int g = r / attn_tp;
    EXPECT_EQ(resp.dp_rank(), g) << "rank " << r;
    EXPECT_EQ(resp.attn_tp_rank(), r % attn_tp) << "rank " << r;
    EXPECT_EQ(resp.padding_mode(), expected_padding) << "rank " << r;
    EXPECT_EQ(resp.after_mlp_ops_size(), static_cast<int>(l.sparse.size()));
    ASSERT_EQ(resp.output().dtype(), v1::DTYPE_FP32);
    ASSERT_THAT(resp.output().shape(), ::testing::ElementsAre(counts[g], kHidden));
    const std::vector<float> got = FloatsOf(resp.output());
    // Ranks of one DP group return the same bits.
    if (r % attn_tp != 0) {
      EXPECT_EQ(got, FloatsOf((*responses)[r - r % attn_tp].output())) << "rank " << r;
    }
    int64_t offset = 0;
    for (int gg = 0; gg < g; ++gg) offset += counts[gg] * kHidden;
    for (size_t i = 0; i < got.size(); ++i) {
      const double want = (*ref)[offset + i];
      ASSERT_LE(std::abs(got[i] - want), tol * (1 + std::abs(want)))
          << "rank " << r << " element " << i << " got " << got[i] << " want " << want;
    }
  }
  if (!ref->empty()) {
    EXPECT_GT(ref_max, 0.5);  // the stack did real work
  }
}

// Two workers: (2,1) and (2,2), then the error cases.
class TwoWorkerStack : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    auto started = FakeCoordinator::Start(2);
    ASSERT_TRUE(started.ok()) << started.status();
    fake_ = started->release();
    ASSERT_TRUE(fake_->coordinator().FormGroup().ok());
  }
  static void TearDownTestSuite() {
    delete fake_;
    fake_ = nullptr;
  }
  static void Configure(const Layout& l) {
    auto configured = fake_->coordinator().ConfigureLayers(ConfigureRequest(l));
    ASSERT_TRUE(configured.ok()) << configured.status();
  }
  static FakeCoordinator* fake_;
};
FakeCoordinator* TwoWorkerStack::fake_ = nullptr;

TEST_F(TwoWorkerStack, Tp2AttnDp1MatchesReference) {
  const Layout l{2, 1};
  Configure(l);
  ExpectStackMatchesReference(*fake_, l, {5}, 1, "MAX_LEN");
  ExpectStackMatchesReference(*fake_, l, {0}, 2, "MAX_LEN");  // an empty batch
}

TEST_F(TwoWorkerStack, Tp2AttnDp2WithZeroTokenGroupMatchesReference) {
  const Layout l{2, 2};
  Configure(l);
  ExpectStackMatchesReference(*fake_, l, {3, 0}, 1, "MAX_LEN");
  ExpectStackMatchesReference(*fake_, l, {0, 4}, 2, "MAX_LEN");
  // Dense MLPs fully data-parallel (moe_dense_tp 1).
  const Layout dp_dense{2, 2, 1};
  Configure(dp_dense);
  ExpectStackMatchesReference(*fake_, dp_dense, {6, 2}, 3, "MAX_LEN");
}

TEST_F(TwoWorkerStack, SameRequestReusesTheStackAndGivesTheSameOutput) {
  const Layout l{2, 2};
  Configure(l);
  auto first = fake_->coordinator().ForwardLayers(Requests(l, {4, 1}, 1));
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_TRUE((*first)[0].rebuilt());  // first call after ConfigureLayers
  auto second = fake_->coordinator().ForwardLayers(Requests(l, {4, 1}, 1));
  ASSERT_TRUE(second.ok()) << second.status();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE((*second)[r].rebuilt()) << "rank " << r;
    EXPECT_EQ((*second)[r].timings().build_us(), 0);
    EXPECT_EQ(FloatsOf((*second)[r].output()), FloatsOf((*first)[r].output())) << "rank " << r;
  }
}

TEST_F(TwoWorkerStack, BadTokenWidthOnOneRankIsInvalidArgumentAndChangesNothing) {
  const Layout l{2, 2};
  Configure(l);
  auto before = fake_->coordinator().ForwardLayers(Requests(l, {4, 1}, 1));
  ASSERT_TRUE(before.ok()) << before.status();

  // Rank 0 sends rows of H + 1 values; rank 1 is fine.
  std::vector<v1::ForwardLayersRequest> bad = Requests(l, {4, 1}, 2);
  *bad[0].mutable_tokens() =
      Fp32Tensor(std::vector<float>(4 * (kHidden + 1), 0.5f), 4, kHidden + 1);
  std::vector<absl::Status> statuses = fake_->OnEachRank([&](int r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ForwardLayersResponse response;
    return client::ToAbslStatus(fake_->stub(r).ForwardLayers(&context, bad[r], &response));
  });
  EXPECT_EQ(statuses[0].code(), absl::StatusCode::kInvalidArgument) << statuses[0];
  EXPECT_THAT(statuses[0].message(), HasSubstr("tokens.shape[1]: expected 32"));
  EXPECT_EQ(statuses[1].code(), absl::StatusCode::kAborted) << statuses[1];
  EXPECT_THAT(
      statuses[1].message(),
      HasSubstr("rank 0 rejected its ForwardLayers request: INVALID_ARGUMENT: tokens.shape[1]"));

  // The group is not broken and the stack is the one built before.
  auto after = fake_->coordinator().ForwardLayers(Requests(l, {4, 1}, 1));
  ASSERT_TRUE(after.ok()) << after.status();
  for (int r = 0; r < 2; ++r) {
    EXPECT_FALSE((*after)[r].rebuilt()) << "rank " << r;
    EXPECT_EQ(FloatsOf((*after)[r].output()), FloatsOf((*before)[r].output())) << "rank " << r;
  }
}

TEST_F(TwoWorkerStack, BadTokenWidthOnEveryRankIsInvalidArgument) {
  const Layout l{2, 1};
  Configure(l);
  std::vector<v1::ForwardLayersRequest> bad = Requests(l, {3}, 1);
  for (auto& request : bad) {
    *request.mutable_tokens() = Fp32Tensor(std::vector<float>(3 * 31, 1.0f), 3, 31);
  }
  auto result = fake_->coordinator().ForwardLayers(bad);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("tokens.shape[1]: expected 32"));
  EXPECT_THAT(result.status().message(), HasSubstr("failed on 2 of 2 ranks"));
}

TEST_F(TwoWorkerStack, DifferentSpecsAcrossRanksAreAborted) {
  const Layout l{2, 2};
  Configure(l);
  std::vector<v1::ForwardLayersRequest> requests = Requests(l, {2, 2}, 1);
  requests[1].mutable_stack()->set_seed(kStackSeed + 1);
  auto result = fake_->coordinator().ForwardLayers(requests);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kAborted) << result.status();
  EXPECT_THAT(result.status().message(),
              HasSubstr("ForwardLayers: stack.seed differs across ranks: rank 0 = 7, rank 1 = 8"));
  // Different epochs too.
  requests = Requests(l, {2, 2}, 1);
  requests[0].set_epoch(2);
  result = fake_->coordinator().ForwardLayers(requests);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kAborted) << result.status();
  // The group still works.
  ExpectStackMatchesReference(*fake_, l, {2, 2}, 3, "MAX_LEN");
}

TEST_F(TwoWorkerStack, AttnTpRanksWithDifferentTokenCountsAreInvalidArgument) {
  const Layout l{2, 1};  // one DP group of two attention-TP ranks
  Configure(l);
  std::vector<v1::ForwardLayersRequest> requests = Requests(l, {3}, 1);
  *requests[1].mutable_tokens() = Fp32Tensor(GroupTokens(0, 4), 4, kHidden);
  auto result = fake_->coordinator().ForwardLayers(requests);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("DP group 0"));
  ExpectStackMatchesReference(*fake_, l, {3}, 2, "MAX_LEN");
}

TEST_F(TwoWorkerStack, MoreScatteredRowsThanCapacityIsResourceExhausted) {
  const Layout l{2, 2};
  Configure(l);
  std::vector<v1::ForwardLayersRequest> requests = Requests(l, {5, 1}, 1);
  for (auto& request : requests) request.mutable_stack()->set_capacity_tokens(2);
  auto result = fake_->coordinator().ForwardLayers(requests);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
}

TEST_F(TwoWorkerStack, InvalidSpecIsInvalidArgumentNamingTheField) {
  const Layout l{2, 1};
  Configure(l);
  std::vector<v1::ForwardLayersRequest> requests = Requests(l, {2}, 1);
  for (auto& request : requests) request.mutable_stack()->set_num_layers(6);  // 5 configured
  auto result = fake_->coordinator().ForwardLayers(requests);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("stack.num_layers: expected in [0, 5]"));
  requests = Requests(l, {2}, 1);
  for (auto& request : requests) request.mutable_stack()->set_dense_intermediate_size(63);
  result = fake_->coordinator().ForwardLayers(requests);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kInvalidArgument) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("dense_intermediate"));
}

// The first K configured layers run when stack.num_layers = K.
TEST_F(TwoWorkerStack, NumLayersRunsTheFirstConfiguredLayers) {
  const Layout l{2, 2};
  Configure(l);
  std::vector<v1::ForwardLayersRequest> requests = Requests(l, {3, 2}, 1);
  for (auto& request : requests) request.mutable_stack()->set_num_layers(2);
  auto result = fake_->coordinator().ForwardLayers(requests);
  ASSERT_TRUE(result.ok()) << result.status();
  Layout first_two = l;
  first_two.sparse = {false, true};
  auto ref =
      core::ReferenceLayerStack(ReferenceConfig(first_two), {GroupTokens(0, 3), GroupTokens(1, 2)});
  ASSERT_TRUE(ref.ok()) << ref.status();
  const std::vector<float> got = FloatsOf((*result)[1].output());  // DP group 1
  ASSERT_EQ(got.size(), 2 * kHidden);
  for (size_t i = 0; i < got.size(); ++i) {
    const double want = (*ref)[3 * kHidden + i];
    ASSERT_LE(std::abs(got[i] - want), kSparseTol * (1 + std::abs(want))) << i;
  }
}

TEST(LayerStackService, BeforeConfigureLayersIsFailedPrecondition) {
  auto fake = FakeCoordinator::Start(1);
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->coordinator().FormGroup().ok());
  const Layout l{1, 1};
  auto result = (*fake)->coordinator().ForwardLayers(Requests(l, {2}, 1));
  ASSERT_EQ(result.status().code(), absl::StatusCode::kFailedPrecondition) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("CONFIGURED"));
}

TEST(LayerStackService, StackBeyondTheMemoryCapIsResourceExhaustedAndChangesNothing) {
  // H 32: about 0.2 MB of weights for the 5 layers; H 512: 1 MiB of attention a layer.
  auto fake = FakeCoordinator::Start(1, {"--memory-cap-bytes=1000000"});
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->coordinator().FormGroup().ok());
  const Layout l{1, 1};
  v1::ConfigureLayersRequest configure = ConfigureRequest(l);
  configure.mutable_model()->set_hidden_size(0);  // the stack spec gives H
  ASSERT_TRUE((*fake)->coordinator().ConfigureLayers(configure).ok());
  std::vector<v1::ForwardLayersRequest> big = Requests(l, {2}, 1);
  big[0].mutable_stack()->set_hidden_size(512);
  *big[0].mutable_tokens() = Fp32Tensor(std::vector<float>(2 * 512, 1.0f), 2, 512);
  auto result = (*fake)->coordinator().ForwardLayers(big);
  ASSERT_EQ(result.status().code(), absl::StatusCode::kResourceExhausted) << result.status();
  // 1000000 less the Rendezvous store's budget (1/16 of the cap, server/main.cc).
  EXPECT_THAT(result.status().message(), HasSubstr("memory cap of 937500"));
  std::vector<v1::ForwardLayersRequest> small = Requests(l, {2}, 1);
  small[0].mutable_stack()->set_hidden_size(kHidden);
  auto ok = (*fake)->coordinator().ForwardLayers(small);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_TRUE((*ok)[0].rebuilt());
}

// Four workers: (4,2) in its variants, (4,1) and (4,4).
TEST(FourWorkerStack, LayoutsMatchReference) {
  auto fake = FakeCoordinator::Start(4);
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->coordinator().FormGroup().ok());
  struct Case {
    Layout layout;
    std::vector<int64_t> counts;
    std::string padding;
  };
  const std::vector<Case> cases = {
      {{4, 2}, {5, 0}, "MAX_LEN"},                                 // zero-token DP group
      {{4, 2}, {5, 2}, "MAX_LEN"},                                 // DESIGN §4 example counts
      {{4, 2, 1}, {3, 4}, "MAX_LEN"},                              // dense MLP fully DP
      {{4, 2, 2}, {5, 3}, "MAX_LEN"},                              // dense MLP in attn-TP (23996)
      {{4, 2, 0, {false, true, true}, false}, {5, 0}, "MAX_LEN"},  // a2a off: sparse FULL
      {{4, 4}, {7, 0, 3, 1}, "SUM_LEN"},
      {{4, 1}, {6}, "MAX_LEN"},
  };
  int64_t epoch = 0;
  for (const Case& c : cases) {
    auto configured = (*fake)->coordinator().ConfigureLayers(ConfigureRequest(c.layout));
    ASSERT_TRUE(configured.ok()) << configured.status();
    ExpectStackMatchesReference(**fake, c.layout, c.counts, ++epoch, c.padding);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace
}  // namespace moe_ep::testing
