#include "core/agreement.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

// The wire form of a ballot: fixed size, trivially copyable. Field names and
// the rpc travel as fingerprints; a rank reads names from its own ballot.
struct WireBallot {
  int64_t version = kBallotVersion;
  uint64_t rpc = 0;
  int64_t generation = 0;
  int64_t sequence = 0;
  int64_t code = 0;
  int64_t num_fields = 0;
  uint64_t names[kBallotMaxFields] = {};
  int64_t values[kBallotMaxFields] = {};
  char rpc_text[32] = {};
  char message[kBallotMessageBytes] = {};
};

void CopyText(char* dst, size_t size, absl::string_view text) {
  const size_t n = std::min(size - 1, text.size());
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

std::string ShowValue(const BallotField& field, int64_t value) {
  return field.is_fingerprint ? Hex64(static_cast<uint64_t>(value)) : absl::StrCat(value);
}

}  // namespace

absl::StatusOr<std::string> EncodeBallot(const Ballot& ballot) {
  if (ballot.fields.size() > kBallotMaxFields) {
    return absl::InvalidArgumentError(absl::StrCat(
        "vote of ", ballot.rpc, ": ", ballot.fields.size(), " fields, at most ", kBallotMaxFields));
  }
  WireBallot mine;
  mine.rpc = Fingerprint64(ballot.rpc);
  mine.generation = ballot.generation;
  mine.sequence = ballot.sequence;
  mine.code = static_cast<int64_t>(ballot.local.code());
  mine.num_fields = static_cast<int64_t>(ballot.fields.size());
  for (size_t i = 0; i < ballot.fields.size(); ++i) {
    mine.names[i] = Fingerprint64(ballot.fields[i].name);
    mine.values[i] = ballot.fields[i].value;
  }
  CopyText(mine.rpc_text, sizeof(mine.rpc_text), ballot.rpc);
  CopyText(mine.message, sizeof(mine.message), ballot.local.message());
  return std::string(reinterpret_cast<const char*>(&mine), sizeof(mine));
}

absl::Status DecideVote(const Ballot& ballot, int me, const std::vector<std::string>& wire) {
  const int n = static_cast<int>(wire.size());
  std::vector<WireBallot> all(n);
  for (int r = 0; r < n; ++r) {
    if (wire[r].size() != sizeof(WireBallot)) {
      return absl::AbortedError(absl::StrCat("rank ", r, " sent a ballot of ", wire[r].size(),
                                             " bytes, expected ", sizeof(WireBallot),
                                             " (a worker of another release?)"));
    }
    std::memcpy(&all[r], wire[r].data(), sizeof(WireBallot));
  }
  const uint64_t rpc = Fingerprint64(ballot.rpc);
  for (int r = 0; r < n; ++r) {
    const WireBallot& b = all[r];
    if (b.version != kBallotVersion || b.rpc != rpc || b.generation != ballot.generation ||
        b.sequence != ballot.sequence) {
      return absl::AbortedError(
          absl::StrCat("ranks are not in the same call: rank ", r, " is in ",
                       std::string(b.rpc_text, strnlen(b.rpc_text, sizeof(b.rpc_text))),
                       " (generation ", b.generation, ", vote ", b.sequence, ", ballot version ",
                       b.version, "), this rank (rank ", me, ") is in ", ballot.rpc,
                       " (generation ", ballot.generation, ", vote ", ballot.sequence, ")"));
    }
  }
  if (!ballot.local.ok()) return ballot.local;
  std::vector<std::string> rejected;
  for (int r = 0; r < n; ++r) {
    if (all[r].code == 0) continue;
    rejected.push_back(absl::StrCat(
        "rank ", r, " rejected its ", ballot.rpc,
        " request: ", absl::StatusCodeToString(static_cast<absl::StatusCode>(all[r].code)), ": ",
        std::string(all[r].message, strnlen(all[r].message, sizeof(all[r].message)))));
  }
  if (!rejected.empty()) {
    return absl::AbortedError(absl::StrCat(absl::StrJoin(rejected, "; "),
                                           "; nothing moved, the group is still usable (this rank "
                                           "is rank ",
                                           me, ")"));
  }
  const int64_t num_fields = static_cast<int64_t>(ballot.fields.size());
  for (size_t i = 0; i < ballot.fields.size(); ++i) {
    bool differs = false;
    for (int r = 0; r < n; ++r) {
      differs = differs || all[r].num_fields != num_fields ||
                all[r].names[i] != Fingerprint64(ballot.fields[i].name) ||
                all[r].values[i] != ballot.fields[i].value;
    }
    if (!differs) continue;
    std::vector<std::string> values;
    values.reserve(n);
    for (int r = 0; r < n; ++r) {
      values.push_back(
          absl::StrCat("rank ", r, " = ", ShowValue(ballot.fields[i], all[r].values[i])));
    }
    if (me >= n) {  // a prefix without this rank: its own value last
      values.push_back(
          absl::StrCat("rank ", me, " = ", ShowValue(ballot.fields[i], ballot.fields[i].value)));
    }
    return absl::AbortedError(absl::StrCat(ballot.rpc, ": ", ballot.fields[i].name,
                                           " differs across ranks: ", absl::StrJoin(values, ", "),
                                           "; every rank must get the same request"));
  }
  return absl::OkStatus();
}

absl::Status RunVote(ControlCollective& group, const Ballot& ballot) {
  ASSIGN_OR_RETURN(std::string mine, EncodeBallot(ballot));
  const int n = group.size();
  std::vector<WireBallot> gathered(n);
  RETURN_IF_ERROR(group.AllGather(mine.data(), mine.size(), gathered.data()));
  std::vector<std::string> wire(n);
  for (int r = 0; r < n; ++r) {
    // A masked rank (lost, core/masked_collective.h) does not vote: it
    // counts as agreeing with this rank.
    wire[r] = group.IsLive(r)
                  ? std::string(reinterpret_cast<const char*>(&gathered[r]), sizeof(WireBallot))
                  : mine;
  }
  return DecideVote(ballot, group.rank(), wire);
}

}  // namespace moe_ep::core
