#include "server/layer_stack_runner.h"

#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "core/gloo_collective.h"
#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tensor_codec.h"

namespace moe_ep::server {
namespace layer_stack_runner_test {
namespace {

using ::testing::HasSubstr;

v1::ModelDescription Model() {
  v1::ModelDescription m;
  m.set_name("m");
  m.set_hidden_size(32);
  m.set_num_layers(3);
  m.set_num_experts(8);
  m.set_top_k(2);
  m.set_moe_intermediate_size(16);
  return m;
}

const core::ParallelLayout kLayout{2, 2, 0};
const std::vector<bool> kSparse = {false, true, true};

// The ForwardLayers cases below: Model() with H 16 and 4 experts, layers
// dense, sparse, dense; a stack of dense I 32 and capacity 16; 3 tokens.
const std::vector<bool> kRunSparse = {false, true, false};
constexpr int64_t kRunTokens = 3;

v1::ModelDescription RunModel() {
  v1::ModelDescription model = Model();
  model.set_hidden_size(16);
  model.set_num_experts(4);
  return model;
}

// A ForwardLayers request (epoch 1) of `tokens` [kRunTokens, 16] fp32 for
// the stack of `seed`.
v1::ForwardLayersRequest RunRequest(const std::vector<float>& tokens, uint64_t seed) {
  v1::ForwardLayersRequest request;
  request.set_epoch(1);
  request.mutable_stack()->set_dense_intermediate_size(32);
  request.mutable_stack()->set_seed(seed);
  request.mutable_stack()->set_capacity_tokens(16);
  *request.mutable_tokens() = EncodeFloat32(tokens, std::vector<int64_t>{kRunTokens, 16});
  return request;
}

// A ballot that passes this rank's own status on (no peers to hear).
absl::Status LocalVote(absl::Status local, const std::vector<core::BallotField>&) { return local; }

// What a call cancelled by rank 0's client says after its stop point.
const std::string kStoppedByRank0 =
    ": stopped on every rank: the client cancelled the call on rank(s) [0]";

// core::ReferenceLayerStack of RunRequest's stack on `layout`, built here
// independently of the runner.
absl::StatusOr<std::vector<float>> RunReference(const core::ParallelLayout& layout, uint64_t seed,
                                                const std::vector<float>& tokens) {
  core::LayerStackConfig config;
  config.layout = layout;
  config.sparse_layers = kRunSparse;
  config.hidden = 16;
  config.dense_intermediate = 32;
  config.moe_intermediate = 16;
  config.num_experts = 4;
  config.top_k = 2;
  config.seed = seed;
  config.rms_eps = 1e-6f;
  config.capacity_tokens = 16;
  return core::ReferenceLayerStack(config, {tokens});
}

// That `response`'s fp32 output is `ref` within the bf16 tolerance;
// `what` prefixes the element in a failure.
void ExpectReferenceOutput(const v1::ForwardLayersResponse& response, const std::vector<float>& ref,
                           const std::string& what) {
  std::vector<float> got(response.output().data().size() / 4);
  std::memcpy(got.data(), response.output().data().data(), got.size() * 4);
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::abs(got[i] - ref[i]), (1.0 / 128.0) * (1 + std::abs(ref[i])))
        << what << "element " << i;
  }
}

TEST(ResolveLayerStackConfig, ZeroFieldsTakeTheModelsAndDefaults) {
  v1::LayerStackSpec spec;
  spec.set_dense_intermediate_size(64);
  spec.set_seed(9);
  auto c = ResolveLayerStackConfig(spec, kLayout, kSparse, true, Model());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden, 32);
  EXPECT_EQ(c->moe_intermediate, 16);
  EXPECT_EQ(c->dense_intermediate, 64);
  EXPECT_EQ(c->num_experts, 8);
  EXPECT_EQ(c->top_k, 2);
  EXPECT_EQ(c->seed, 9u);
  EXPECT_FLOAT_EQ(c->rms_eps, 1e-6f);
  EXPECT_EQ(c->capacity_tokens, kDefaultStackCapacityTokens);
  EXPECT_EQ(c->sparse_layers, kSparse);
  EXPECT_TRUE(c->a2a_enabled);
  EXPECT_EQ(c->layout.attn_dp_size, 2);
}

TEST(ResolveLayerStackConfig, NumLayersTakesTheFirstConfiguredLayers) {
  v1::LayerStackSpec spec;
  spec.set_num_layers(2);
  spec.set_dense_intermediate_size(64);
  auto c = ResolveLayerStackConfig(spec, kLayout, kSparse, false, Model());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sparse_layers, (std::vector<bool>{false, true}));
  EXPECT_FALSE(c->a2a_enabled);
}

TEST(ResolveLayerStackConfig, AllSparseNeedsNoDenseSize) {
  v1::LayerStackSpec spec;
  auto c = ResolveLayerStackConfig(spec, kLayout, {true, true}, true, Model());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->dense_intermediate, 2);  // tp_size, unused
}

TEST(ResolveLayerStackConfig, ErrorsNameTheField) {
  struct Case {
    std::function<void(v1::LayerStackSpec&, v1::ModelDescription&)> mutate;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {[](auto& s, auto&) { s.set_num_layers(4); },
       "stack.num_layers: expected in [0, 3] (0 = all configured layers), got 4"},
      {[](auto& s, auto&) { s.set_hidden_size(48); },
       "stack.hidden_size: expected 32 (the configured model.hidden_size) or 0, got 48"},
      {[](auto&, auto& m) { m.set_hidden_size(0); },
       "stack.hidden_size: required (the configured model has no hidden_size)"},
      {[](auto& s, auto&) { s.set_dense_intermediate_size(0); },
       "stack.dense_intermediate_size: required"},
      {[](auto& s, auto&) { s.set_dense_intermediate_size(63); }, "dense_intermediate"},
      {[](auto& s, auto& m) {
         m.set_num_experts(0);
         s.set_num_experts(1);
       },
       "num_experts"},  // fewer experts than ranks
      {[](auto& s, auto&) { s.set_top_k(-1); }, "stack.top_k: expected in [0, 65536], got -1"},
      {[](auto& s, auto&) { s.set_rms_eps(-1.0f); }, "stack.rms_eps: expected >= 0"},
      {[](auto& s, auto&) { s.set_capacity_tokens(-2); }, "stack.capacity_tokens"},
      {[](auto& s, auto&) { s.set_hidden_size(int64_t{1} << 21); }, "stack.hidden_size"},
  };
  for (const Case& c : cases) {
    v1::LayerStackSpec spec;
    spec.set_dense_intermediate_size(64);
    v1::ModelDescription model = Model();
    c.mutate(spec, model);
    auto r = ResolveLayerStackConfig(spec, kLayout, kSparse, true, model);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.fragment;
    EXPECT_THAT(r.status().message(), HasSubstr(c.fragment));
  }
}

TEST(LayerStackRunner, RunBeforeConfigureIsFailedPrecondition) {
  LayerStackRunner runner;
  EXPECT_FALSE(runner.configured());
  // A collective that fails every call: Run must not reach it.
  class NoCollective final : public core::ControlCollective {
   public:
    int rank() const override { return 0; }
    int size() const override { return 1; }
    std::string backend() const override { return "none"; }
    absl::Status AllToAllV(const void*, absl::Span<const int64_t>, void*,
                           absl::Span<const int64_t>) override {
      return absl::InternalError("unexpected");
    }
    absl::Status AllGather(const void*, int64_t, void*) override {
      return absl::InternalError("unexpected");
    }
    absl::Status AllReduceSum(float*, int64_t) override {
      return absl::InternalError("unexpected");
    }
    absl::Status Barrier() override { return absl::InternalError("unexpected"); }
    void SetCallDeadline(absl::Time) override {}
    absl::StatusOr<std::unique_ptr<core::ControlCollective>> Split(absl::Span<const int>,
                                                                   const std::string&) override {
      return absl::InternalError("unexpected");
    }
  } world;
  v1::ForwardLayersResponse response;
  absl::Status s = runner.Run(
      world, 1, CallBound{},
      [](const absl::Status&, const std::vector<core::BallotField>&) {
        return absl::InternalError("unexpected");
      },
      v1::ForwardLayersRequest(), 0, 0, &response);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), HasSubstr("ConfigureLayers first"));
  runner.Configure(kLayout, kSparse, true, Model());
  EXPECT_TRUE(runner.configured());
  runner.Reset();
  EXPECT_FALSE(runner.configured());
  EXPECT_EQ(runner.held_bytes(), 0);
}

// Issue 13 item 6: ForwardLayers passes call gates before and after a
// build and before each layer >= 1. A client that cancels at gate check k
// stops the call at a known point; every later call on the same world
// works and matches core::ReferenceLayerStack.
TEST(LayerStackRunner, StopsAtEachGateAndTheNextRunMatchesTheReference) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  auto world = core::GlooCollective::Create(store, "stack", 0, 1, "127.0.0.1", absl::Seconds(5));
  ASSERT_TRUE(world.ok()) << world.status();
  LayerStackRunner runner;
  runner.Configure(core::ParallelLayout{1, 1, 0}, kRunSparse, true, RunModel());
  std::vector<float> tokens;
  for (int64_t i = 0; i < kRunTokens * 16; ++i) {
    tokens.push_back(static_cast<float>(std::sin(0.3 * i)));
  }
  const v1::ForwardLayersRequest request = RunRequest(tokens, 5);
  const LayerStackRunner::VoteFn vote = LocalVote;
  // Cancelled from gate check `at` on (1 = the first gate).
  auto cancel_at = [](int at) {
    auto checks = std::make_shared<int>(0);
    return CallBound{absl::InfiniteFuture(), [at, checks] { return ++*checks >= at; }};
  };
  v1::ForwardLayersResponse response;
  auto run = [&](const CallBound& call) {
    response.Clear();
    return runner.Run(**world, 1, call, vote, request, 0, 0, &response);
  };
  const std::string& stopped = kStoppedByRank0;

  absl::Status s = run(cancel_at(1));
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("ForwardLayers: before the layer-stack build" + stopped));
  EXPECT_EQ(runner.held_bytes(), 0);
  // The checks of a build, in order: 1 the gate before it; per layer l a
  // poll before its attention weights and one before its MLP weights (one
  // chunk each here), and for l >= 1 the gate before it (4, 7); 10 the gate
  // after the build. A poll that fires stops that layer's build on this
  // rank, and the next gate stops the call (issue 13 item 6).
  s = run(cancel_at(2));  // inside layer 0's build: the gate before layer 1
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("ForwardLayers: building layer 1 of 3" + stopped));
  EXPECT_EQ(runner.held_bytes(), 0);
  s = run(cancel_at(4));  // that gate itself
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("ForwardLayers: building layer 1 of 3" + stopped));
  s = run(cancel_at(6));  // inside layer 1's experts: the gate before layer 2
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("ForwardLayers: building layer 2 of 3" + stopped));
  for (int at : {9, 10}) {  // inside the last layer's build, and the gate after it
    s = run(cancel_at(at));
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("ForwardLayers: after the layer-stack build, before layer 0 "
                          "of 3" +
                          stopped))
        << "cancelled at check " << at;
    EXPECT_EQ(runner.held_bytes(), 0);  // the stack just built was dropped
    EXPECT_FALSE(response.has_output());
  }

  absl::StatusOr<std::vector<float>> ref = RunReference(core::ParallelLayout{1, 1, 0}, 5, tokens);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ASSERT_TRUE(run(CallBound{}).ok());
  EXPECT_TRUE(response.rebuilt());
  ExpectReferenceOutput(response, *ref, "");
  const int64_t held = runner.held_bytes();
  EXPECT_GT(held, 0);

  // No build this time: the gates are before layers 1 and 2.
  s = run(cancel_at(2));
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("ForwardLayers: before layer 2 of 3 (layers 0-1 ran)" + stopped));
  EXPECT_FALSE(response.has_output());
  EXPECT_EQ(runner.held_bytes(), held);
  // A deadline that passed: the first gate stops it.
  s = run(CallBound{absl::Now() - absl::Seconds(1), nullptr});
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("ForwardLayers: before layer 1 of 3 (layers 0-0 ran): "
                        "stopped on every rank: the call's deadline passed on "
                        "rank(s) [0]"));
  ASSERT_TRUE(run(CallBound{}).ok());
  EXPECT_FALSE(response.rebuilt());
  ExpectReferenceOutput(response, *ref, "");
}

// Issue 13 item 6 (fuzz-long run 5: one layer's weight build outlasted the
// call): two ranks, rank 0's client cancels inside a layer's weight build
// (the check count `at`; see the test above: 2 inside layer 0, 9 inside the
// last layer), rank 1's never. Rank 0 stops its build there, meets rank 1
// at the next gate, and both stop there naming rank 0; neither keeps a
// stack; then both run to the reference on the same world.
TEST(LayerStackRunner, TwoRanksStopTogetherWhenOneStopsInsideALayerBuild) {
  constexpr int kRanks = 2;
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::unique_ptr<core::GlooCollective>> world(kRanks);
  {
    std::vector<std::thread> threads;
    threads.reserve(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        auto w = core::GlooCollective::Create(store, "stack2", r, kRanks, "127.0.0.1",
                                              absl::Seconds(20));
        ASSERT_TRUE(w.ok()) << w.status();
        world[r] = std::move(*w);
      });
    }
    for (std::thread& t : threads) t.join();
  }
  for (const auto& w : world) ASSERT_NE(w, nullptr);
  const core::ParallelLayout layout{kRanks, 1, 0};
  std::vector<LayerStackRunner> runners(kRanks);
  for (LayerStackRunner& runner : runners) runner.Configure(layout, kRunSparse, true, RunModel());
  std::vector<float> tokens;
  for (int64_t i = 0; i < kRunTokens * 16; ++i) {
    tokens.push_back(static_cast<float>(std::cos(0.2 * i)));
  }
  const v1::ForwardLayersRequest request = RunRequest(tokens, 7);
  const LayerStackRunner::VoteFn vote = LocalVote;
  std::vector<v1::ForwardLayersResponse> response(kRanks);
  std::vector<absl::Status> got(kRanks);
  // Rank 0 cancelled from its check `at` on (0: never); rank 1 never.
  auto run = [&](int at) {
    std::vector<std::thread> threads;
    threads.reserve(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      threads.emplace_back([&, r] {
        auto checks = std::make_shared<int>(0);
        const CallBound call =
            r == 0 && at > 0
                ? CallBound{absl::InfiniteFuture(), [at, checks] { return ++*checks >= at; }}
                : CallBound{};
        response[r].Clear();
        got[r] = runners[r].Run(*world[r], 1, call, vote, request, 0, 0, &response[r]);
      });
    }
    for (std::thread& t : threads) t.join();
  };
  const std::string& stopped = kStoppedByRank0;
  const std::pair<int, std::string> cases[] = {
      {2, "ForwardLayers: building layer 1 of 3"},
      {9, "ForwardLayers: after the layer-stack build, before layer 0 of 3"}};
  for (const auto& [at, point] : cases) {
    run(at);
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_EQ(got[r].code(), absl::StatusCode::kCancelled) << "rank " << r << ": " << got[r];
      EXPECT_TRUE(IsAgreedStop(got[r])) << "rank " << r << ": " << got[r];
      EXPECT_THAT(std::string(got[r].message()), HasSubstr(point + stopped)) << "rank " << r;
      EXPECT_EQ(runners[r].held_bytes(), 0) << "rank " << r;
      EXPECT_FALSE(response[r].has_output()) << "rank " << r;
    }
  }

  absl::StatusOr<std::vector<float>> ref = RunReference(layout, 7, tokens);
  ASSERT_TRUE(ref.ok()) << ref.status();
  run(0);
  for (int r = 0; r < kRanks; ++r) {
    ASSERT_TRUE(got[r].ok()) << "rank " << r << ": " << got[r];
    EXPECT_TRUE(response[r].rebuilt());
    ASSERT_NO_FATAL_FAILURE(
        ExpectReferenceOutput(response[r], *ref, "rank " + std::to_string(r) + " "));
  }
}

}  // namespace
}  // namespace layer_stack_runner_test
}  // namespace moe_ep::server
