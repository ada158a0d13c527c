#pragma once

// `moe-ep run --tp T`: the run's flags mapped onto the layer-stack job
// (client/stack_job.h), every flag either applied or refused with a message
// naming it, never silently ignored (issue 9 item 4).
//
// Applied: --model, --layers, --tokens (mean tokens per DP group: per rank
// when attn_dp = tp), --steps, --seed, --capacity, --rpc-timeout, --targets
// and its security flags, --worker-binary, --log-dir, --worker-log-level,
// --experts swiglu, --backend gloo | auto (the stack runs on Gloo), --workers
// equal to --tp. Refused (kInvalidArgument): --experts identity, --routing,
// --rel-tol, --abs-tol, --even-tokens, --workers other than --tp, --backend
// nccl; each message says why and what to do.

#include "absl/status/statusor.h"
#include "client/run_job.h"
#include "client/stack_job.h"

namespace moe_ep::client {

// Which run flags the command line gave (rather than left at their default).
struct RunFlagsGiven {
  bool experts = false;
  bool routing = false;
  bool rel_tol = false;
  bool abs_tol = false;
  bool even_tokens = false;
  bool workers = false;
  bool backend = false;
};

// The stack job of `run --tp tp --attn-dp attn_dp --moe-dense-tp
// moe_dense_tp` with the flags `run` holds. Errors: kInvalidArgument naming
// the first refused flag (in the order of RunFlagsGiven), expected vs got.
// Pure.
absl::StatusOr<StackJobOptions> StackJobFromRun(const RunJobOptions& run,
                                                const RunFlagsGiven& given, int tp, int attn_dp,
                                                int moe_dense_tp);

}  // namespace moe_ep::client
