#include "client/run_tp_options.h"

#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

TEST(StackJobFromRun, AppliesTheRunFlagsTheStackHas) {
  RunJobOptions run;
  run.model = "tiny-moe";
  run.num_layers = 2;
  run.tokens_per_rank = 9;
  run.steps = 3;
  run.seed = 42;
  run.capacity_tokens = 77;
  run.rpc_timeout = absl::Seconds(31);
  run.workers.targets = "127.0.0.1:1,127.0.0.1:2";
  run.workers.worker_log_level = "debug";
  run.workers.security.auth_token_file = "/tmp/token";
  run.workers.backend = "gloo";
  run.experts = "swiglu";
  RunFlagsGiven given;
  given.backend = true;  // gloo: what the stack runs on
  given.experts = true;  // swiglu: what the stack runs
  auto stack = StackJobFromRun(run, given, 2, 2, 1);
  ASSERT_TRUE(stack.ok()) << stack.status();
  EXPECT_EQ(stack->model, "tiny-moe");
  EXPECT_EQ(stack->tp_size, 2);
  EXPECT_EQ(stack->attn_dp_size, 2);
  EXPECT_EQ(stack->moe_dense_tp_size, 1);
  EXPECT_EQ(stack->num_layers, 2);
  EXPECT_EQ(stack->tokens_per_group, 9);
  EXPECT_EQ(stack->steps, 3);
  EXPECT_EQ(stack->seed, 42u);
  EXPECT_EQ(stack->capacity_tokens, 77);
  EXPECT_EQ(stack->rpc_timeout, absl::Seconds(31));
  EXPECT_EQ(stack->workers.targets, "127.0.0.1:1,127.0.0.1:2");
  EXPECT_EQ(stack->workers.worker_log_level, "debug");
  EXPECT_EQ(stack->workers.security.auth_token_file, "/tmp/token");
}

TEST(StackJobFromRun, WorkersEqualToTpAndBackendAutoAreAccepted) {
  RunJobOptions run;
  run.workers.num_workers = 4;
  run.workers.backend = "auto";
  RunFlagsGiven given;
  given.workers = true;
  given.backend = true;
  EXPECT_TRUE(StackJobFromRun(run, given, 4, 1, 0).ok());
}

TEST(StackJobFromRun, RefusesEachFlagTheStackCannotApplyNamingIt) {
  struct Case {
    std::function<void(RunJobOptions&, RunFlagsGiven&)> set;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.experts = "identity";
         g.experts = true;
       },
       "--experts identity: not with --tp: the layer stack's sparse layers run seeded SwiGLU"},
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.routing = "trace:/nonexistent/trace.jsonl";
         g.routing = true;
       },
       "--routing trace:/nonexistent/trace.jsonl: not with --tp: the layer stack routes"},
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.routing = "uniform";
         g.routing = true;
       },
       "--routing uniform: not with --tp"},
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.tolerance.rel = 0.5;
         g.rel_tol = true;
       },
       "--rel-tol 0.5: not with --tp: the layer stack checks every element"},
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.tolerance.atol = 0.25;
         g.abs_tol = true;
       },
       "--abs-tol 0.25: not with --tp"},
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.even_tokens = true;
         g.even_tokens = true;
       },
       "--even-tokens: not with --tp"},
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.workers.num_workers = 3;
         g.workers = true;
       },
       "--workers: expected 2 (with --tp the group is --tp workers), got 3"},
      {[](RunJobOptions& r, RunFlagsGiven& g) {
         r.workers.backend = "nccl";
         g.backend = true;
       },
       "--backend nccl: not with --tp: the layer stack (ForwardLayers) runs on Gloo"},
  };
  for (const Case& c : cases) {
    RunJobOptions run;
    RunFlagsGiven given;
    c.set(run, given);
    auto stack = StackJobFromRun(run, given, 2, 1, 0);
    EXPECT_EQ(stack.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(stack.status().message(), HasSubstr(c.message));
  }
}

TEST(StackJobFromRun, DefaultsLeftAloneAreNotRefused) {
  // The run's defaults (routing skewed, experts swiglu, tolerances, 4
  // workers, backend auto) are not flags the user gave.
  RunJobOptions run;
  auto stack = StackJobFromRun(run, RunFlagsGiven{}, 2, 1, 0);
  ASSERT_TRUE(stack.ok()) << stack.status();
  EXPECT_EQ(stack->capacity_tokens, 0);  // automatic
}

}  // namespace
}  // namespace moe_ep::client
