#pragma once

// What every transport's dispatcher offers the plane core (DESIGN §17; issue
// 34 item 1): the bytes of its buffers, the geometry commit and the step
// check. The dispatchers of the three data planes implement it
// (core::EpDispatcher on Gloo, kernels::GpuEpDispatcher on NCCL,
// kernels::onesided::OneSidedDispatcher over peer windows), so
// server::DataPlane answers allocated_bytes, CommitGeometry and
// EngineCheckStep once for all of them instead of three transports each
// forwarding the same calls.
//
// Thread safety: as the implementing dispatcher (thread-compatible: one
// caller thread at a time).

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::core {

class StepDispatcher {
 public:
  virtual ~StepDispatcher() = default;

  // Bytes this dispatcher allocated (host or device, its whole workspace).
  virtual int64_t allocated_bytes() const = 0;

  // Commits (epoch, R = `runtime_max_tokens_per_rank`) for the next steps,
  // checking `local_tokens` <= R (core::GeometryState::Commit, DESIGN §6).
  // Errors: kFailedPrecondition (a step is in flight), kResourceExhausted
  // (R > the workspace's capacity_tokens), kInvalidArgument (R <
  // local_tokens or R < 0). On error the previous geometry stays.
  virtual absl::Status CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                                      int64_t local_tokens) = 0;

  // The sync point of a step enqueued without a host wait: waits for the
  // dispatcher's work and reports what its device-side checks recorded
  // (kAborted for a geometry disagreement naming the rank, kInvalidArgument
  // for an expert id out of range, kDeadlineExceeded for a peer that never
  // signalled), then clears the record. A dispatcher that checks each step
  // on the host before it returns (the CPU one) has nothing to report: OK.
  virtual absl::Status CheckStep() { return absl::OkStatus(); }

 protected:
  StepDispatcher() = default;
  StepDispatcher(const StepDispatcher&) = default;
  StepDispatcher& operator=(const StepDispatcher&) = default;
};

}  // namespace moe_ep::core
