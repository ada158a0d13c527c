#include "core/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace safetensors_test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string TempPath(const std::string& name) {
  return (std::filesystem::path(::testing::TempDir()) / name).string();
}

std::vector<uint8_t> FloatBytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// Writes raw bytes: an 8-byte little-endian length, `header`, then `data`.
void WriteRaw(const std::string& path, const std::string& header, const std::string& data,
              uint64_t declared_len) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>(declared_len >> (8 * i)));
  out << header << data;
}

TEST(Safetensors, RoundTrip) {
  const std::string path = TempPath("round_trip.safetensors");
  SafetensorsTensor a{
      "a.weight", SafetensorsDType::kF32, {2, 3}, FloatBytes({1, 2, 3, 4, 5, -6.5f})};
  SafetensorsTensor b{"b", SafetensorsDType::kBF16, {3}, {0x80, 0x3f, 0x00, 0x40, 0x00, 0xc0}};
  SafetensorsTensor c{"c.empty", SafetensorsDType::kF16, {0, 4}, {}};
  ASSERT_TRUE(WriteSafetensors(path, {a, b, c}).ok());

  // The header length is a multiple of 8 and the layout is 8 + header + data.
  const auto file_bytes = std::filesystem::file_size(path);
  std::ifstream in(path, std::ios::binary);
  uint8_t len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | len_bytes[i];
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(file_bytes, 8 + header_len + 24 + 6);

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_THAT(file->names(), ElementsAre("a.weight", "b", "c.empty"));
  auto ta = file->Find("a.weight");
  ASSERT_TRUE(ta.ok());
  EXPECT_EQ(ta->dtype, SafetensorsDType::kF32);
  EXPECT_THAT(ta->shape, ElementsAre(2, 3));
  ASSERT_EQ(ta->data.size(), 24u);
  float v[6];
  std::memcpy(v, ta->data.data(), 24);
  EXPECT_THAT(v, ElementsAre(1, 2, 3, 4, 5, -6.5f));
  auto tb = file->Find("b");
  ASSERT_TRUE(tb.ok());
  EXPECT_EQ(tb->dtype, SafetensorsDType::kBF16);
  EXPECT_THAT(std::vector<uint8_t>(tb->data.begin(), tb->data.end()),
              ElementsAre(0x80, 0x3f, 0x00, 0x40, 0x00, 0xc0));
  auto tc = file->Find("c.empty");
  ASSERT_TRUE(tc.ok());
  EXPECT_THAT(tc->shape, ElementsAre(0, 4));
  EXPECT_TRUE(tc->data.empty());

  // Moving the file keeps its views valid.
  SafetensorsFile moved = std::move(*file);
  auto again = moved.Find("a.weight");
  ASSERT_TRUE(again.ok());
  std::memcpy(v, again->data.data(), 24);
  EXPECT_EQ(v[5], -6.5f);
}

TEST(Safetensors, ReadsHandWrittenFileWithMetadata) {
  // A file as the Python library writes it: metadata entry, spaces after JSON.
  const std::string path = TempPath("hand.safetensors");
  std::string header =
      R"({"__metadata__":{"format":"pt"},"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::vector<uint8_t> data = FloatBytes({0.25f, -3.0f});
  WriteRaw(path, header, std::string(data.begin(), data.end()), header.size());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata().at("format"), "pt");
  EXPECT_THAT(file->names(), ElementsAre("x"));
  auto x = file->Find("x");
  ASSERT_TRUE(x.ok());
  float v[2];
  std::memcpy(v, x->data.data(), 8);
  EXPECT_EQ(v[0], 0.25f);
  EXPECT_EQ(v[1], -3.0f);
}

TEST(Safetensors, MissingFileAndTensorAreNotFound) {
  auto missing = SafetensorsFile::Open(TempPath("does_not_exist.safetensors"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("does_not_exist"));

  const std::string path = TempPath("one.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"t", SafetensorsDType::kF32, {1}, FloatBytes({1})}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  auto t = file->Find("nope");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(t.status().message(), HasSubstr("\"nope\""));
}

TEST(Safetensors, CorruptFilesAreDataLoss) {
  struct Case {
    std::string name;
    std::string header;
    std::string data;
    int64_t declared;  // -1: header.size()
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {"short", "", "", -2, "at least 8 bytes"},
      {"len_too_big", "{}", "", 4096, "exceeds the file"},
      {"not_json", "{not json", "", -1, "not JSON"},
      {"not_object", "[1,2]", "", -1, "not a JSON object"},
      {"bad_dtype", R"({"t":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})",
       std::string(8, '\0'), -1, "I64"},
      {"missing_field", R"({"t":{"dtype":"F32","shape":[1]}})", "", -1, "data_offsets"},
      {"negative_dim", R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})",
       std::string(4, '\0'), -1, "non-negative"},
      {"out_of_range", R"({"t":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
       std::string(8, '\0'), -1, "outside the data region"},
      {"size_mismatch", R"({"t":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})",
       std::string(8, '\0'), -1, "expected 6 bytes"},
  };
  for (const Case& c : cases) {
    const std::string path = TempPath("corrupt_" + c.name + ".safetensors");
    if (c.declared == -2) {
      std::ofstream(path, std::ios::binary) << "abc";
    } else {
      WriteRaw(path, c.header, c.data, c.declared < 0 ? c.header.size() : c.declared);
    }
    auto file = SafetensorsFile::Open(path);
    EXPECT_EQ(file.status().code(), absl::StatusCode::kDataLoss) << c.name;
    EXPECT_THAT(file.status().message(), HasSubstr(c.fragment)) << c.name;
  }
}

TEST(Safetensors, WriterRejectsBadTensors) {
  const std::string path = TempPath("bad_write.safetensors");
  auto dup = WriteSafetensors(path, {{"t", SafetensorsDType::kF32, {1}, FloatBytes({1})},
                                     {"t", SafetensorsDType::kF32, {1}, FloatBytes({2})}});
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dup.message(), HasSubstr("duplicate"));
  auto size = WriteSafetensors(path, {{"t", SafetensorsDType::kBF16, {2, 2}, {0, 0, 0, 0}}});
  EXPECT_EQ(size.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(size.message(), HasSubstr("expected 8 bytes"));
  auto name = WriteSafetensors(path, {{"", SafetensorsDType::kF32, {0}, {}}});
  EXPECT_EQ(name.code(), absl::StatusCode::kInvalidArgument);
  auto dim = WriteSafetensors(path, {{"t", SafetensorsDType::kF32, {-2}, {}}});
  EXPECT_EQ(dim.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(dim.message(), HasSubstr("non-negative"));
}

TEST(SafetensorsCheckpoint, ShardedIndex) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "sharded_ckpt";
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(WriteSafetensors((dir / "model-00001-of-00002.safetensors").string(),
                               {{"a", SafetensorsDType::kF32, {1}, FloatBytes({1.5f})}})
                  .ok());
  ASSERT_TRUE(WriteSafetensors((dir / "model-00002-of-00002.safetensors").string(),
                               {{"b", SafetensorsDType::kF32, {1}, FloatBytes({2.5f})}})
                  .ok());
  std::ofstream(dir / "model.safetensors.index.json")
      << R"({"metadata":{"total_size":8},"weight_map":{"a":"model-00001-of-00002.safetensors",)"
      << R"("b":"model-00002-of-00002.safetensors","c":"model-00003-of-00002.safetensors"}})";

  auto ckpt = SafetensorsCheckpoint::Open(dir.string());
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  auto b = ckpt->Find("b");
  ASSERT_TRUE(b.ok()) << b.status();
  float v;
  std::memcpy(&v, b->data.data(), 4);
  EXPECT_EQ(v, 2.5f);
  auto a = ckpt->Find("a");
  ASSERT_TRUE(a.ok());
  std::memcpy(&v, a->data.data(), 4);
  EXPECT_EQ(v, 1.5f);
  EXPECT_EQ(ckpt->Find("z").status().code(), absl::StatusCode::kNotFound);
  // Listed in the index but its shard is missing.
  EXPECT_EQ(ckpt->Find("c").status().code(), absl::StatusCode::kNotFound);

  // The index path itself opens the same checkpoint.
  auto by_index = SafetensorsCheckpoint::Open((dir / "model.safetensors.index.json").string());
  ASSERT_TRUE(by_index.ok());
  EXPECT_TRUE(by_index->Find("a").ok());
}

TEST(SafetensorsCheckpoint, Errors) {
  EXPECT_EQ(SafetensorsCheckpoint::Open(TempPath("no_such_dir")).status().code(),
            absl::StatusCode::kNotFound);
  const std::filesystem::path empty = std::filesystem::path(::testing::TempDir()) / "empty_ckpt";
  std::filesystem::create_directories(empty);
  auto e = SafetensorsCheckpoint::Open(empty.string());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(e.status().message(), HasSubstr("model.safetensors"));
  const std::string bad_index = TempPath("bad.index.json");
  std::ofstream(bad_index) << R"({"metadata":{}})";
  auto b = SafetensorsCheckpoint::Open(bad_index);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(b.status().message(), HasSubstr("weight_map"));
}

// Decoding in pieces gives the same bits as decoding at once; a released
// tensor reads again from the file.
TEST(SafetensorsToBf16, PiecesEqualTheWholeAndReleasedPagesStayReadable) {
  const std::string path = TempPath("to_bf16.safetensors");
  // 1.0, -2.5, 3.0f + 2^-10 (rounds to nearest even: 3.0), 1e-3 in F32.
  SafetensorsTensor f32{
      "f", SafetensorsDType::kF32, {2, 2}, FloatBytes({1, -2.5f, 3.0009765625f, 1e-3f})};
  // F16 1.0 (0x3c00), -2.0 (0xc000), 2^-24 (0x0001, subnormal).
  SafetensorsTensor f16{"h", SafetensorsDType::kF16, {3}, {0x00, 0x3c, 0x00, 0xc0, 0x01, 0x00}};
  ASSERT_TRUE(WriteSafetensors(path, {f32, f16}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto view = file->Find("f");
  ASSERT_TRUE(view.ok());
  std::vector<uint16_t> whole(4);
  ASSERT_TRUE(SafetensorsToBf16(*view, 0, absl::MakeSpan(whole)).ok());
  EXPECT_THAT(whole, ElementsAre(0x3f80, 0xc020, 0x4040, FloatToBf16(1e-3f)));
  std::vector<uint16_t> pieces(4);
  ASSERT_TRUE(SafetensorsToBf16(*view, 0, absl::MakeSpan(pieces.data(), 3)).ok());
  ReleaseTensorPages(*view);
  ASSERT_TRUE(SafetensorsToBf16(*view, 3, absl::MakeSpan(pieces.data() + 3, 1)).ok());
  EXPECT_EQ(pieces, whole);
  const absl::Status beyond = SafetensorsToBf16(*view, 3, absl::MakeSpan(pieces.data(), 2));
  EXPECT_EQ(beyond.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(beyond.message()), HasSubstr("elements [3, 5) outside the tensor's 4"));
  auto half = file->Find("h");
  ASSERT_TRUE(half.ok());
  std::vector<uint16_t> h(3);
  ASSERT_TRUE(SafetensorsToBf16(*half, 0, absl::MakeSpan(h)).ok());
  EXPECT_THAT(h, ElementsAre(0x3f80, 0xc000, 0x3380));  // 2^-24 = 0x33800000
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace safetensors_test
}  // namespace moe_ep::core
