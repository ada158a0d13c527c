#pragma once

// Stopping heavy local work early (issue 13 item 6; the long fuzz run 5,
// bench/results/fuzz-long/): a loop whose length a request sets (expert
// compute over the received rows, seeded weight generation of a layer
// stack) polls a StopCheck between its units and, once it answers true,
// returns LocalStop instead of finishing. The server's check is
// server::CallBound::Expired (the call's deadline passed or its client
// cancelled it); what a collective caller does next is its own: the
// server runs the call gate that follows, which stops every rank together
// (server/call_gate.h), so a rank that skipped its work never exchanges
// with ranks that did it.

#include <functional>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moe_ep::core {

// Answers true when the work should stop now. Must be cheap (polled between
// experts or weight chunks, never from inside a ParallelFor range) and is
// called on the thread that runs the loop. Null: never stops.
using StopCheck = std::function<bool()>;

// Whether `stop` is set and answers true now.
inline bool ShouldStop(const StopCheck& stop) { return stop && stop(); }

// LocalStop()
//
// The status of work that `stop` ended early: kCancelled
//   "<what>: stopped early on this rank (its call's deadline passed or its
//    client cancelled it); nothing was kept"
// marked (IsLocalStop). `what` names the work and how far it got
// ("expert compute: after 3 of 8 experts").
absl::Status LocalStop(absl::string_view what);

// Whether `status` came from LocalStop (copies keep the mark).
bool IsLocalStop(const absl::Status& status);

}  // namespace moe_ep::core
