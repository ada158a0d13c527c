#pragma once

// The argument checks of an engine's in-process data calls
// (server/data_plane.h Engine*, server/moe_ep.h; DESIGN §14), written once
// for every transport (issue 34 item 1): each plane runs these before it
// enqueues anything, then reports a failure its own way (the CPU plane in
// its engine call round, so no peer waits; the GPU planes' dispatch by
// enqueueing a refusal in place of the step, which the peers' device-side
// check reports (issue 30 item 1), their other calls at once). All pure and
// thread-safe; messages name the call, the field, the rank, expected and got.

#include <cstdint>

#include "absl/status/status.h"
#include "server/data_plane.h"

namespace moe_ep::server {

// CheckEngineInputs()
//
// A step's inputs on `rank`: hidden [T, H], topk_ids [T, K], topk_weights
// [T, K] must not be null when `num_tokens` > 0. Errors: kInvalidArgument
// naming the null ones.
absl::Status CheckEngineInputs(const char* call, int rank, int64_t num_tokens, const void* hidden,
                               const int32_t* topk_ids, const float* topk_weights);

// CheckEngineOutput()
//
// A step's output [T, H] on `rank` must not be null when `num_tokens` > 0.
// Errors: kInvalidArgument.
absl::Status CheckEngineOutput(const char* call, int rank, int64_t num_tokens, const void* output);

// CheckEngineRecvBuffers()
//
// The receive buffers of a dispatch on `rank` whose committed geometry is
// R = `runtime_max` rows per source and which holds `num_local_experts`
// experts: out.rows >= R; source_counts [E] not null; expert_counts [L] not
// null when L > 0; hidden, topk_ids and topk_weights not null when
// out.rows > 0. Errors: kInvalidArgument naming the field, expected and got.
absl::Status CheckEngineRecvBuffers(const char* call, int rank, const EngineRecvBuffers& out,
                                    int64_t runtime_max, int num_local_experts);

// CheckEngineCombineArgs()
//
// A combine on `rank` of `expert_out` [E, rows, H] into `output` [T, H],
// the dispatched step holding `step_tokens` tokens at R = `runtime_max`:
// rows >= R, expert_out not null when rows > 0, output not null when the
// step has tokens. Pure: what then happens to the step is the plane's (gloo
// and nccl keep it dispatched, the one-sided plane refuses it). Errors:
// kInvalidArgument naming the field (the null one), expected and got.
absl::Status CheckEngineCombineArgs(const char* call, int rank, int64_t rows, int64_t runtime_max,
                                    const void* expert_out, const void* output,
                                    int64_t step_tokens);

// RefusedDispatchError()
//
// What a GPU plane's dispatch returns when its arguments failed this rank's
// checks (`args`, not OK) and it tried to enqueue a refusal in place of the
// step (issue 30 item 1) with result `refused`: `args` itself when the
// refusal was enqueued (the peers' step ends at once); otherwise `args`
// with its code and, appended, that no refusal was enqueued, why, and that
// the peers' step waits for this rank until the group's timeout.
absl::Status RefusedDispatchError(const absl::Status& args, const absl::Status& refused);

// RefusedCombineError()
//
// What a GPU plane's combine returns when its arguments failed this rank's
// checks (`args`, not OK) while a step was dispatched, and it enqueued a
// refused combine in place of it (issue 30 item 1) with result `refused`:
// `args` with "(refused: the step is over on every rank; the peers'
// check_step names this rank)" appended when the refusal was enqueued;
// otherwise `args` with, appended, that no refusal was enqueued, why, and
// that the peers' combine waits for this rank until the group's timeout.
absl::Status RefusedCombineError(const absl::Status& args, const absl::Status& refused);

}  // namespace moe_ep::server
