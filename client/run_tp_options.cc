#include "client/run_tp_options.h"

#include "absl/strings/str_cat.h"

namespace moe_ep::client {
namespace {

absl::Status Refuse(absl::string_view flag, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": not with --tp: ", why));
}

}  // namespace

absl::StatusOr<StackJobOptions> StackJobFromRun(const RunJobOptions& run,
                                                const RunFlagsGiven& given, int tp, int attn_dp,
                                                int moe_dense_tp) {
  if (given.experts && run.experts != "swiglu") {
    return Refuse(absl::StrCat("--experts ", run.experts),
                  "the layer stack's sparse layers run seeded SwiGLU experts; leave --experts "
                  "out, or run the MoE layers alone (without --tp) for identity experts");
  }
  if (given.routing) {
    return Refuse(absl::StrCat("--routing ", run.routing),
                  "the layer stack routes every token by a seeded hash of its position "
                  "(core/layer_stack.h RouteToken); leave --routing out, or run without --tp");
  }
  constexpr absl::string_view kTolerance =
      "the layer stack checks every element with |out - ref| <= tol * (1 + |ref|), tol 2^-7 "
      "with a sparse layer and 1e-4 for dense layers only; leave it out, or run without --tp";
  if (given.rel_tol) return Refuse(absl::StrCat("--rel-tol ", run.tolerance.rel), kTolerance);
  if (given.abs_tol) return Refuse(absl::StrCat("--abs-tol ", run.tolerance.atol), kTolerance);
  if (given.even_tokens) {
    return Refuse("--even-tokens",
                  "the layer stack gives its DP groups different token counts on purpose (one "
                  "group empty on even steps; PlanStackTokenCounts); leave it out");
  }
  if (given.workers && run.workers.num_workers != tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers: expected ", tp, " (with --tp the group is --tp workers), got ",
                     run.workers.num_workers, "; leave --workers out"));
  }
  if (given.backend && run.workers.backend == "nccl") {
    return Refuse("--backend nccl",
                  "the layer stack (ForwardLayers) runs on Gloo workers; use --backend gloo "
                  "or leave it out");
  }
  StackJobOptions stack;
  stack.model = run.model;
  stack.workers = run.workers;
  stack.tp_size = tp;
  stack.attn_dp_size = attn_dp;
  stack.moe_dense_tp_size = moe_dense_tp;
  stack.num_layers = run.num_layers;
  stack.tokens_per_group = run.tokens_per_rank;
  stack.steps = run.steps;
  stack.seed = run.seed;
  stack.capacity_tokens = run.capacity_tokens;
  stack.rpc_timeout = run.rpc_timeout;
  return stack;
}

}  // namespace moe_ep::client
