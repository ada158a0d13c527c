#include "core/masked_collective.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moe_ep::core {

absl::StatusOr<std::unique_ptr<MaskedCollective>> MaskedCollective::Create(
    std::unique_ptr<ControlCollective> inner, int rank, std::vector<bool> live) {
  if (inner == nullptr) return absl::InvalidArgumentError("masked group: no survivors' group");
  const int world = static_cast<int>(live.size());
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("masked group: rank ", rank, " outside [0, ", world, ")"));
  }
  if (!live[rank]) {
    return absl::InvalidArgumentError(
        absl::StrCat("masked group: rank ", rank, " is itself masked out"));
  }
  int live_count = 0;
  int index = 0;
  for (int r = 0; r < world; ++r) {
    if (r == rank) index = live_count;
    if (live[r]) ++live_count;
  }
  if (inner->size() != live_count || inner->rank() != index) {
    return absl::InvalidArgumentError(absl::StrCat(
        "masked group: the survivors' group has rank ", inner->rank(), " of ", inner->size(),
        ", expected rank ", index, " of ", live_count, " (rank ", rank, " of ", world, ")"));
  }
  return std::unique_ptr<MaskedCollective>(
      new MaskedCollective(std::move(inner), rank, std::move(live)));
}

MaskedCollective::MaskedCollective(std::unique_ptr<ControlCollective> inner, int rank,
                                   std::vector<bool> live)
    : inner_(std::move(inner)), rank_(rank), live_(std::move(live)) {
  int next = 0;
  inner_index_.assign(live_.size(), -1);
  for (size_t r = 0; r < live_.size(); ++r) {
    if (live_[r]) inner_index_[r] = next++;
  }
  send_scratch_.resize(next);
  recv_scratch_.resize(next);
}

absl::Status MaskedCollective::AllToAllV(const void* send, absl::Span<const int64_t> send_bytes,
                                         void* recv, absl::Span<const int64_t> recv_bytes) {
  if (static_cast<int>(send_bytes.size()) != size() ||
      static_cast<int>(recv_bytes.size()) != size()) {
    return absl::InvalidArgumentError(absl::StrCat("AllToAllV: expected ", size(),
                                                   " counts each, got ", send_bytes.size(), " and ",
                                                   recv_bytes.size()));
  }
  for (int r = 0; r < size(); ++r) {
    const int i = inner_index_[r];
    if (i >= 0) {
      send_scratch_[i] = send_bytes[r];
      recv_scratch_[i] = recv_bytes[r];
    } else if (send_bytes[r] != 0 || recv_bytes[r] != 0) {
      return absl::InternalError(absl::StrCat("AllToAllV: rank ", rank_, " would move ",
                                              send_bytes[r], " bytes to and ", recv_bytes[r],
                                              " bytes from rank ", r, ", which is masked out"));
    }
  }
  // Masked ranks hold zero bytes, so the packed buffers need no moving.
  return inner_->AllToAllV(send, send_scratch_, recv, recv_scratch_);
}

absl::Status MaskedCollective::AllGather(const void* send, int64_t bytes_per_rank, void* recv) {
  if (bytes_per_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("AllGather: bytes_per_rank: expected >= 0, got ", bytes_per_rank));
  }
  gather_scratch_.resize(static_cast<size_t>(inner_->size()) * bytes_per_rank);
  absl::Status gathered = inner_->AllGather(send, bytes_per_rank, gather_scratch_.data());
  if (!gathered.ok()) return gathered;
  char* out = static_cast<char*>(recv);
  for (int r = 0; r < size(); ++r) {
    char* row = out + static_cast<int64_t>(r) * bytes_per_rank;
    const int i = inner_index_[r];
    if (bytes_per_rank == 0) continue;
    if (i >= 0) {
      std::memcpy(row, gather_scratch_.data() + static_cast<int64_t>(i) * bytes_per_rank,
                  bytes_per_rank);
    } else {
      std::memset(row, 0, bytes_per_rank);
    }
  }
  return absl::OkStatus();
}

absl::Status MaskedCollective::AllReduceSum(float* data, int64_t count) {
  return inner_->AllReduceSum(data, count);
}

absl::Status MaskedCollective::Barrier() { return inner_->Barrier(); }

absl::StatusOr<std::unique_ptr<ControlCollective>> MaskedCollective::Split(
    absl::Span<const int> ranks, const std::string& tag) {
  std::vector<int> mapped;
  mapped.reserve(ranks.size());
  for (int r : ranks) {
    if (r < 0 || r >= size() || inner_index_[r] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Split(", tag, "): rank ", r, " is masked out or outside [0, ", size(), ")"));
    }
    mapped.push_back(inner_index_[r]);
  }
  return inner_->Split(mapped, tag);
}

}  // namespace moe_ep::core
