#pragma once

// How member 0 of a group hands the NCCL unique id to the others (DESIGN §8
// Join, §15 rank masks; issue 17): it publishes a fixed-size record that
// holds either the id or the error it got making one, so a failed
// ncclGetUniqueId reaches every member at once, naming the member that
// failed, instead of leaving the others waiting for an id until their
// timeout. Two carriers use the record:
//   - the Join's rendezvous store (ExchangeNcclUniqueId, server/data_plane.h);
//   - a rank mask round's Gloo group of the members, when the survivors
//     re-initialise a communicator (ShareNcclUniqueId below).
// Record layout, kNcclIdRecordBytes bytes: byte 0 the absl::StatusCode of
// member 0's outcome (0 = OK), bytes 1-2 the payload length (little-endian),
// then the payload: the kNcclUniqueIdBytes id, or the error message (cut to
// what fits), zero-padded.

#include <functional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/collective.h"

namespace moe_ep::server {

// Size of an NCCL unique id (NCCL_UNIQUE_ID_BYTES).
inline constexpr int kNcclUniqueIdBytes = 128;
// Size of the record member 0 publishes (see the file comment).
inline constexpr int kNcclIdRecordBytes = 512;

// EncodeNcclIdRecord()
//
// The record of member 0's outcome: `id` (kNcclUniqueIdBytes bytes) or its
// error. An OK `id` of another length is encoded as kInternal naming the
// length. Pure.
std::string EncodeNcclIdRecord(const absl::StatusOr<std::string>& id);

// DecodeNcclIdRecord()
//
// The id in `record`, or member 0's error: its code, with the message
// "<maker> could not make the NCCL unique id: <its message>" (`maker` names
// member 0, e.g. "rank 3"). Errors: kUnavailable when `record` is not a
// record (size other than kNcclIdRecordBytes, a code past 16, a payload
// length past the record or an id of the wrong length), naming `where` the
// record came from and what was wrong. Pure.
absl::StatusOr<std::string> DecodeNcclIdRecord(absl::string_view record, absl::string_view maker,
                                               absl::string_view where);

// ShareNcclUniqueId()
//
// A collective over `members`: member 0 (members.rank() == 0) calls
// `make_id`, every member all-gathers kNcclIdRecordBytes per member, and all
// decode member 0's record. Returns the id on every member; when `make_id`
// fails, every member (member 0 included) returns its error, as
// DecodeNcclIdRecord words it with `maker`, as soon as the all-gather is
// done. `make_id` is called on member 0 only. Errors: member 0's, the
// all-gather's (kDeadlineExceeded, kUnavailable: prefixed "NCCL unique id
// all-gather: "), kUnavailable for a malformed record. Thread safety: that
// of `members` (one caller).
absl::StatusOr<std::string> ShareNcclUniqueId(
    core::ControlCollective& members, const std::function<absl::StatusOr<std::string>()>& make_id,
    absl::string_view maker);

}  // namespace moe_ep::server
