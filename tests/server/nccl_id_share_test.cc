#include "server/nccl_id_share.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

// The NCCL unique-id record (server/nccl_id_share.h; issue 17): the id or
// member 0's error, and what a malformed record reports. Its share over a
// mask round's members is tested in tests/server/data_plane_test.cc, with
// the Join's store exchange.

namespace moe_ep::server {
namespace nccl_id_share_test {
namespace {

std::string FakeId(char fill) { return std::string(kNcclUniqueIdBytes, fill); }

TEST(NcclIdRecord, CarriesTheIdOrTheErrorWithItsCode) {
  const std::string id = std::string(64, '\x01') + std::string(64, '\xfe');
  const std::string record = EncodeNcclIdRecord(id);
  ASSERT_EQ(record.size(), static_cast<size_t>(kNcclIdRecordBytes));
  EXPECT_EQ(record[0], 0);
  EXPECT_EQ(record[1], '\x80');  // 128 = 0x0080, little-endian
  EXPECT_EQ(record[2], 0);
  absl::StatusOr<std::string> back = DecodeNcclIdRecord(record, "rank 0", "the test");
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(*back, id);

  const std::string failed =
      EncodeNcclIdRecord(absl::ResourceExhaustedError("ncclGetUniqueId: out of memory"));
  EXPECT_EQ(failed[0], static_cast<char>(absl::StatusCode::kResourceExhausted));
  absl::StatusOr<std::string> error = DecodeNcclIdRecord(failed, "rank 2 (member 0)", "the test");
  EXPECT_EQ(error.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(error.status().message(),
            "rank 2 (member 0) could not make the NCCL unique id: ncclGetUniqueId: out of memory");
}

TEST(NcclIdRecord, CutsALongMessageToTheRecord) {
  const std::string long_message(2000, 'm');
  const std::string record = EncodeNcclIdRecord(absl::InternalError(long_message));
  ASSERT_EQ(record.size(), static_cast<size_t>(kNcclIdRecordBytes));
  absl::StatusOr<std::string> error = DecodeNcclIdRecord(record, "rank 0", "the test");
  EXPECT_EQ(error.status().code(), absl::StatusCode::kInternal);
  // 512 - 3 header bytes of the message survive.
  EXPECT_EQ(error.status().message(),
            "rank 0 could not make the NCCL unique id: " + std::string(509, 'm'));
}

TEST(NcclIdRecord, AnIdOfTheWrongLengthIsEncodedAsInternal) {
  absl::StatusOr<std::string> error =
      DecodeNcclIdRecord(EncodeNcclIdRecord(std::string(5, 'i')), "rank 0", "the test");
  EXPECT_EQ(error.status().code(), absl::StatusCode::kInternal);
  EXPECT_EQ(error.status().message(),
            "rank 0 could not make the NCCL unique id: the id source returned 5 bytes, expected "
            "128");
}

TEST(NcclIdRecord, MalformedRecordsAreUnavailableSayingWhatIsWrong) {
  struct Case {
    std::string record;
    std::string want;
  };
  std::string bad_code = EncodeNcclIdRecord(FakeId('a'));
  bad_code[0] = 17;
  std::string bad_length = EncodeNcclIdRecord(FakeId('a'));
  bad_length[1] = '\xff';
  bad_length[2] = '\x01';  // 511 > 509
  std::string short_id = EncodeNcclIdRecord(FakeId('a'));
  short_id[1] = 100;
  const std::string prefix = "the NCCL unique id record from rank 0 (at x) ";
  const std::vector<Case> cases = {
      {std::string(7, '\0'), prefix + "has 7 bytes, expected 512"},
      {bad_code, prefix + "has status code 17, expected 0 to 16"},
      {bad_length, prefix + "has a payload of 511 bytes, expected at most 509"},
      {short_id, prefix + "holds an id of 100 bytes, expected 128"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<std::string> got = DecodeNcclIdRecord(c.record, "rank 0", "at x");
    EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << got.status();
    EXPECT_EQ(got.status().message(), c.want);
  }
}

}  // namespace
}  // namespace nccl_id_share_test
}  // namespace moe_ep::server
