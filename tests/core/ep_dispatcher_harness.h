#pragma once

// Test harness shared by the core::EpDispatcher tests (bf16, fp8, placement,
// engine calls): options from the workspace geometry, one dispatcher per rank
// on its own thread over a loopback Gloo group, and random step inputs.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "absl/time/time.h"
#include "core/ep_dispatcher.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core::testing {

// Options for `ep_size` ranks, `capacity` tokens per rank, hidden size
// `hidden`, top-k `top_k` over `num_experts` experts, dispatched as `dtype`.
inline EpDispatcherOptions DispatcherOptions(int ep_size, int64_t capacity, int64_t hidden,
                                             int top_k, int num_experts,
                                             DispatchDType dtype = DispatchDType::kBF16) {
  EpDispatcherOptions o;
  o.workspace = WorkspaceSpec{ep_size, capacity, hidden, top_k, dtype};
  o.num_experts = num_experts;
  return o;
}

// Runs fn(rank, dispatcher) on `ep_size` threads, each with its own Gloo rank
// and dispatcher built from `options`; a failed join or Create fails the test.
inline void RunEp(int ep_size, const EpDispatcherOptions& options,
                  const std::function<void(int, EpDispatcher&)>& fn) {
  auto store = NewHashStore();
  RunOnRanks(ep_size, [&](int rank) {
    auto group = JoinLoopback(store, rank, ep_size, absl::Seconds(20));
    ASSERT_TRUE(group.ok()) << group.status();
    auto dispatcher = EpDispatcher::Create(group->get(), options, 0);
    ASSERT_TRUE(dispatcher.ok()) << dispatcher.status();
    fn(rank, **dispatcher);
  });
}

// One rank's step input: hidden [T, H] bf16, ids [T, K] (distinct valid
// experts), weights [T, K] in [0.05, 1).
struct StepInput {
  int64_t tokens = 0;
  std::vector<bf16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

// A step input whose hidden values come from value(gen); ids are the first
// `top_k` of a shuffle of [0, num_experts), so they are distinct.
inline StepInput RandomInputWith(uint32_t seed, int64_t tokens, int64_t hidden, int top_k,
                                 int num_experts,
                                 const std::function<float(std::mt19937&)>& value) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> wt(0.05f, 1.0f);
  StepInput in;
  in.tokens = tokens;
  for (int64_t i = 0; i < tokens * hidden; ++i) in.hidden.push_back(FloatToBf16(value(gen)));
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> experts(num_experts);
    for (int e = 0; e < num_experts; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), gen);
    for (int k = 0; k < top_k; ++k) {
      in.ids.push_back(experts[k]);
      in.weights.push_back(wt(gen));
    }
  }
  return in;
}

// Hidden values uniform in [-1, 1).
inline StepInput RandomInput(uint32_t seed, int64_t tokens, int64_t hidden, int top_k,
                             int num_experts) {
  std::uniform_real_distribution<float> val(-1.0f, 1.0f);
  return RandomInputWith(seed, tokens, hidden, top_k, num_experts,
                         [&](std::mt19937& gen) { return val(gen); });
}

}  // namespace moe_ep::core::testing
