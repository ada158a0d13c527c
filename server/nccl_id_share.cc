#include "server/nccl_id_share.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"

namespace moe_ep::server {
namespace {

constexpr int kHeaderBytes = 3;  // code, payload length (2 bytes)
constexpr int kPayloadBytes = kNcclIdRecordBytes - kHeaderBytes;
// The highest absl::StatusCode (kUnauthenticated).
constexpr int kMaxStatusCode = 16;

std::string Record(int code, absl::string_view payload) {
  std::string record(kNcclIdRecordBytes, '\0');
  const size_t length = std::min<size_t>(payload.size(), kPayloadBytes);
  record[0] = static_cast<char>(code);
  record[1] = static_cast<char>(length & 0xff);
  record[2] = static_cast<char>(length >> 8);
  std::copy_n(payload.data(), length, record.begin() + kHeaderBytes);
  return record;
}

}  // namespace

std::string EncodeNcclIdRecord(const absl::StatusOr<std::string>& id) {
  if (!id.ok()) return Record(static_cast<int>(id.status().code()), id.status().message());
  if (id->size() != kNcclUniqueIdBytes) {
    return Record(static_cast<int>(absl::StatusCode::kInternal),
                  absl::StrCat("the id source returned ", id->size(), " bytes, expected ",
                               kNcclUniqueIdBytes));
  }
  return Record(0, *id);
}

absl::StatusOr<std::string> DecodeNcclIdRecord(absl::string_view record, absl::string_view maker,
                                               absl::string_view where) {
  auto malformed = [&](const std::string& what) {
    return absl::UnavailableError(
        absl::StrCat("the NCCL unique id record from ", maker, " (", where, ") ", what));
  };
  if (record.size() != kNcclIdRecordBytes) {
    return malformed(absl::StrCat("has ", record.size(), " bytes, expected ", kNcclIdRecordBytes));
  }
  const int code = static_cast<uint8_t>(record[0]);
  const int length = static_cast<uint8_t>(record[1]) | (static_cast<uint8_t>(record[2]) << 8);
  if (code > kMaxStatusCode) {
    return malformed(absl::StrCat("has status code ", code, ", expected 0 to ", kMaxStatusCode));
  }
  if (length > kPayloadBytes) {
    return malformed(
        absl::StrCat("has a payload of ", length, " bytes, expected at most ", kPayloadBytes));
  }
  const absl::string_view payload = record.substr(kHeaderBytes, length);
  if (code != 0) {
    return absl::Status(static_cast<absl::StatusCode>(code),
                        absl::StrCat(maker, " could not make the NCCL unique id: ", payload));
  }
  if (length != kNcclUniqueIdBytes) {
    return malformed(
        absl::StrCat("holds an id of ", length, " bytes, expected ", kNcclUniqueIdBytes));
  }
  return std::string(payload);
}

absl::StatusOr<std::string> ShareNcclUniqueId(
    core::ControlCollective& members, const std::function<absl::StatusOr<std::string>()>& make_id,
    absl::string_view maker) {
  const bool is_maker = members.rank() == 0;
  // The other members' rows are never read: zeros.
  const std::string mine =
      is_maker ? EncodeNcclIdRecord(make_id()) : std::string(kNcclIdRecordBytes, '\0');
  std::string all(static_cast<size_t>(kNcclIdRecordBytes) * members.size(), '\0');
  const absl::Status gathered = members.AllGather(mine.data(), kNcclIdRecordBytes, all.data());
  if (!gathered.ok()) {
    // Member 0's own failure says more than the all-gather's.
    if (is_maker) {
      absl::StatusOr<std::string> own = DecodeNcclIdRecord(mine, maker, "its own record");
      if (!own.ok()) return own.status();
    }
    return absl::Status(gathered.code(),
                        absl::StrCat("NCCL unique id all-gather: ", gathered.message()));
  }
  return DecodeNcclIdRecord(absl::string_view(all).substr(0, kNcclIdRecordBytes), maker,
                            "member 0's all-gather row");
}

}  // namespace moe_ep::server
