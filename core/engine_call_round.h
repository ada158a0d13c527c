#pragma once

// The opening round of every in-process data call of an engine on the CPU
// (Gloo) plane (server/moe_ep.h; DESIGN §14; issue 30 item 1).
//
// Why: a data call is a Gloo collective of the engine's thread, and Gloo
// pairs the ranks' operations by order and tag only. Two ranks in different
// calls (one in dispatch, one in combine, or one that returned early on its
// own error while its peers went on) pair operations of different sizes:
// Gloo's TCP device thread then throws gloo::EnforceNotMet ("op.preamble.
// length <= op.nbytes") on a thread of its own, where nothing can catch it,
// and the process aborts; or the tags drift apart and every later call
// waits out the group's timeout. So every engine call opens with this one
// all-gather of a fixed-size ticket, whatever the call and whatever this
// rank's own checks said: which call (sync, dispatch, combine, forward), the
// plane's count of opened calls, this rank's verdict on its own arguments
// and state (a status code), and what the ranks must agree on (epoch, R,
// layer). Only when every live rank is in the same call and accepted it
// does the call's payload move; otherwise every rank returns having moved
// nothing, with the same operation count, so the next call pairs cleanly.
// A rank whose checks fail must still call Open (and the call's checks must
// all run before it, so that no rank can fail between the round and the
// payload).
//
// The ticket: 8 int64 = {kTicketMagic, call, sequence, code, epoch, R,
// layer, value}. `value` is gathered, not compared (the sync call's local
// token count).
//
// Not thread-safe (the plane's caller holds the collective slot).
// Source: DESIGN §14 ("no exception from Gloo ... ever escapes"), issue 30.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/collective.h"

namespace moe_ep::core {

enum class EngineCall : int64_t {
  kSyncTokenCounts = 1,
  kDispatch = 2,
  kCombine = 3,
  kForward = 4,
  kDispatchOnly = 5,
};

// "moe_ep_sync_token_counts", "moe_ep_dispatch", "moe_ep_combine",
// "moe_ep_forward", "moe_ep_dispatch_only"; "another call" for any other
// value.
const char* EngineCallName(EngineCall call);

// What one rank brings to the round.
struct EngineCallTicket {
  EngineCall call = EngineCall::kDispatch;
  int64_t epoch = 0;  // the committed geometry epoch (0 where the call has none)
  int64_t runtime_max_tokens_per_rank = 0;  // R (0 where the call has none)
  int64_t layer = 0;                        // forward's layer (0 otherwise)
  int64_t value = 0;                        // gathered: sync's local_tokens
};

class EngineCallRound {
 public:
  static constexpr int64_t kTicketMagic = 0x6d6f652d65702d31;  // "moe-ep-1"

  // Open()
  //
  // The round of one call: all-gathers `mine` with this rank's `local`
  // verdict, then counts the call (sequence() + 1) whatever the outcome,
  // once the all-gather completed. Returns:
  //   `local`            when it is an error (the peers learn it);
  //   kAborted           live peers refused their call, each named with
  //                      its code ("rank 1 refused its moe_ep_dispatch
  //                      (INVALID_ARGUMENT); its own error names why;
  //                      nothing moved, the group is still usable (this
  //                      rank is rank 0)"),
  //                      or the ranks are not in the same call: another
  //                      call or call number ("rank 1 is in moe_ep_combine,
  //                      this rank (0) in moe_ep_dispatch: every rank makes
  //                      the same data calls in the same order"), another
  //                      epoch or R ("geometry mismatch ...") or layer;
  //   the collective's error (a group error: DEADLINE_EXCEEDED, UNAVAILABLE).
  // With OK, `values` (may be null) receives each rank's ticket value
  // ([size], 0 for a masked rank).
  absl::Status Open(ControlCollective& collective, const EngineCallTicket& mine,
                    const absl::Status& local, std::vector<int64_t>* values);

  // Calls opened since construction or Reset (the ticket's sequence).
  int64_t sequence() const { return sequence_; }
  // Starts counting again from 0: on every member of a group at once (a
  // rank-mask agreement, which every member adopts in the same call).
  void Reset() { sequence_ = 0; }

 private:
  int64_t sequence_ = 0;
  std::vector<int64_t> send_;
  std::vector<int64_t> all_;
};

}  // namespace moe_ep::core
