#pragma once

// The call gate: at fixed points of a collective call's work (each
// Benchmark iteration; Forward before dispatch and between expert compute
// and combine; ForwardLayers before and after its stack build and between
// layers) the ranks agree whether any of them is past its call's deadline
// or was cancelled by its client, and then all stop there together, so that
// work never outlives its caller and frees the collective slot (issue 13
// item 6; found by the long fuzz run, bench/results/fuzz-long/ runs 3-4).
// A stop all ranks agreed on leaves the collective in step: it is not a
// group error (IsAgreedStop; server/worker_state.h IsGroupError), so the
// group stays usable and the next call on it needs no new Join.
// Between the gates, the heavy phases (a CPU Forward's expert compute, a
// layer's weight build in ForwardLayers) poll CallBound::Expired and stop
// early on their rank (core/stop_check.h; fuzz-long run 5); the rank then
// goes on to the next gate, where its latched vote stops every rank, so it
// never combines with ranks that did the work. One mechanism: the poll is
// the gate's own check, latched.
//
// Thread-compatible (one call at a time holds the collective slot).

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "core/collective.h"

namespace moe_ep::server {

// What bounds the collective call running now: its deadline and, for an
// RPC, whether its client cancelled it (null `cancelled`: it cannot be
// cancelled, e.g. the embedded worker's in-process calls).
struct CallBound {
  // Why a call should stop (kNone: it should not).
  enum class Stop { kNone, kLate, kCancelled };

  absl::Time deadline = absl::InfiniteFuture();
  std::function<bool()> cancelled;
  // The first stop Expired() saw on this object (kNone until then); read by
  // CallGate. Copies carry it; DataPlane::SetCall starts each call afresh.
  mutable Stop seen = Stop::kNone;

  // Expired()
  //
  // Whether the call should stop now: past its deadline (checked first:
  // gRPC reports a call past its deadline as cancelled too), or else
  // cancelled by its client. Cheap (a clock read and the cancel check):
  // heavy local work polls it between experts or weight chunks as its
  // core::StopCheck (core/stop_check.h) and stops early. The first true
  // answer is latched in `seen`, and the next CallGate on this same object
  // votes that stop whatever the clock or the cancel check say by then, so
  // a rank that skipped work is always among the ranks the gate stops for
  // (and with it every rank stops). Thread-compatible.
  bool Expired() const;
  // As a core::StopCheck: `this` must outlive it.
  std::function<bool()> StopCheck() const {
    return [this] { return Expired(); };
  }
};

// How long past its call's deadline a collective of the call may still
// wait for its peers: DataPlane::SetCall gives the plane's collectives
// CollectiveDeadline(call) = call.deadline + kCollectiveGrace. A collective
// in flight when the deadline passes (ranks run in step between gates, a
// moment apart) then finishes with its peers, and the next gate stops all
// ranks together, instead of a lone rank's 1 ms wait timing out and
// breaking the group; a peer that hangs still ends the wait within the
// grace of the deadline (issue 13 item 6).
inline constexpr absl::Duration kCollectiveGrace = absl::Seconds(2);
absl::Time CollectiveDeadline(const CallBound& call);

// CallGate()
//
// A collective over `collective` (every rank must enter it at the same
// point of the same call): all-gathers from each rank whether its `call`
// is past its deadline or else was cancelled (a gRPC call past its deadline
// also reads as cancelled: the deadline is checked first). The all-gather
// waits up to the group's timeout, not the call's deadline (the collective's
// SetCallDeadline is lifted for it and set to CollectiveDeadline(call)
// after it), so that
// ranks that reach the gate at different moments past the deadline still
// agree instead of breaking the group. OK when no rank wants to stop.
// Otherwise, on every rank, kDeadlineExceeded when some rank is past its
// deadline, else kCancelled:
//   "<where>: stopped on every rank: the call's deadline passed on rank(s)
//    [0, 2]; the client cancelled the call on rank(s) [1]; nothing was
//    committed and the group stays usable: <hint>"
// marked as an agreed stop (IsAgreedStop). `where` names the call and the
// point ("Forward (layer 3): before dispatch"); `hint` what the caller can
// change ("send it again with a longer deadline or less work"). The
// all-gather's own errors pass through unmarked.
// This rank's vote is `call.seen` when Expired() has latched one (work
// stopped early on it: it must be in the stop, see CallBound::Expired),
// else the deadline and cancel checks as Expired() makes them.
absl::Status CallGate(core::ControlCollective& collective, const CallBound& call,
                      absl::string_view where, absl::string_view hint);

// The gate points the data planes share (server/cpu_data_plane.cc,
// server/gpu_data_plane.cc): Forward's hint, and Benchmark's point before
// iteration `done` of `total` ("Benchmark: after <done> of <total>
// iterations (warmup included)") and hint.
inline constexpr absl::string_view kForwardStopHint =
    "send the step again with a longer deadline or fewer tokens";
inline constexpr absl::string_view kBenchmarkStopHint =
    "ask for fewer iterations or a longer deadline";
std::string BenchmarkGatePoint(int done, int total);

// Whether `status` is a CallGate stop (it carries the gate's payload).
// Copies of the status keep it; a status rebuilt from code and message
// does not.
bool IsAgreedStop(const absl::Status& status);

}  // namespace moe_ep::server
