#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/bf16.h"
#include "core/status_macros.h"
#include "nlohmann/json.hpp"

namespace moe_ep::core {
namespace {

using json = nlohmann::json;

// Refuse absurd header sizes before allocating (the format's own reader caps
// the header at 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

absl::StatusOr<SafetensorsDType> ParseDType(const std::string& name) {
  if (name == "BF16") return SafetensorsDType::kBF16;
  if (name == "F16") return SafetensorsDType::kF16;
  if (name == "F32") return SafetensorsDType::kF32;
  if (name == "F8_E4M3") return SafetensorsDType::kF8E4M3;
  if (name == "F8_E5M2") return SafetensorsDType::kF8E5M2;
  if (name == "U8") return SafetensorsDType::kU8;
  return absl::DataLossError(
      absl::StrCat("dtype: expected BF16, F16, F32, F8_E4M3, F8_E5M2 or U8, got \"", name, "\""));
}

uint64_t ReadLe64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Parses one tensor entry of the header into `view` (its data pointing into
// `data`, which is `data_bytes` long).
absl::Status ParseEntry(const json& entry, const uint8_t* data, uint64_t data_bytes,
                        SafetensorsTensorView* view) {
  if (!entry.is_object() || !entry.contains("dtype") || !entry.contains("shape") ||
      !entry.contains("data_offsets")) {
    return absl::DataLossError("expected an object with dtype, shape and data_offsets");
  }
  const json& dtype = entry["dtype"];
  const json& shape = entry["shape"];
  const json& offsets = entry["data_offsets"];
  if (!dtype.is_string()) return absl::DataLossError("dtype: expected a string");
  ASSIGN_OR_RETURN(view->dtype, ParseDType(dtype.get<std::string>()));
  if (!shape.is_array()) return absl::DataLossError("shape: expected an array");
  uint64_t numel = 1;
  view->shape.clear();
  for (const json& d : shape) {
    if (!d.is_number_integer() || d.get<int64_t>() < 0) {
      return absl::DataLossError(
          absl::StrCat("shape: expected non-negative integers, got ", shape.dump()));
    }
    const uint64_t dim = d.get<uint64_t>();
    if (dim != 0 && numel > (uint64_t{1} << 62) / dim) {
      return absl::DataLossError(absl::StrCat("shape: too large: ", shape.dump()));
    }
    numel *= dim;
    view->shape.push_back(static_cast<int64_t>(dim));
  }
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    return absl::DataLossError("data_offsets: expected [begin, end] of non-negative integers");
  }
  const uint64_t begin = offsets[0].get<uint64_t>();
  const uint64_t end = offsets[1].get<uint64_t>();
  if (begin > end || end > data_bytes) {
    return absl::DataLossError(absl::StrFormat(
        "data_offsets: [%d, %d] outside the data region of %d bytes", begin, end, data_bytes));
  }
  const uint64_t expected = numel * SafetensorsDTypeSize(view->dtype);
  if (end - begin != expected) {
    return absl::DataLossError(
        absl::StrFormat("data_offsets: expected %d bytes for shape %s, got %d", expected,
                        shape.dump(), end - begin));
  }
  view->data = absl::Span<const uint8_t>(data + begin, end - begin);
  return absl::OkStatus();
}

}  // namespace

std::string SafetensorsDTypeName(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kBF16:
      return "BF16";
    case SafetensorsDType::kF16:
      return "F16";
    case SafetensorsDType::kF32:
      return "F32";
    case SafetensorsDType::kF8E4M3:
      return "F8_E4M3";
    case SafetensorsDType::kF8E5M2:
      return "F8_E5M2";
    case SafetensorsDType::kU8:
      return "U8";
  }
  return "?";
}

int SafetensorsDTypeSize(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kF32:
      return 4;
    case SafetensorsDType::kBF16:
    case SafetensorsDType::kF16:
      return 2;
    case SafetensorsDType::kF8E4M3:
    case SafetensorsDType::kF8E5M2:
    case SafetensorsDType::kU8:
      return 1;
  }
  return 1;
}

bool SafetensorsIsFloat(SafetensorsDType dtype) {
  return dtype == SafetensorsDType::kBF16 || dtype == SafetensorsDType::kF16 ||
         dtype == SafetensorsDType::kF32;
}

absl::Status SafetensorsToBf16(const SafetensorsTensorView& view, int64_t first_element,
                               absl::Span<uint16_t> out) {
  if (!SafetensorsIsFloat(view.dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SafetensorsToBf16: dtype ", SafetensorsDTypeName(view.dtype),
        " holds quantized codes or bytes, not bf16/f16/f32 values; read it with its scales "
        "(core/quantized_weights.h)"));
  }
  const int64_t size = SafetensorsDTypeSize(view.dtype);
  const int64_t numel = static_cast<int64_t>(view.data.size()) / size;
  const int64_t count = static_cast<int64_t>(out.size());
  if (first_element < 0 || first_element > numel || count > numel - first_element) {
    return absl::InvalidArgumentError(
        absl::StrFormat("SafetensorsToBf16: elements [%d, %d) outside the tensor's %d",
                        first_element, first_element + count, numel));
  }
  const uint8_t* p = view.data.data() + first_element * size;
  switch (view.dtype) {
    case SafetensorsDType::kBF16:
      for (int64_t i = 0; i < count; ++i)
        out[i] = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
      break;
    case SafetensorsDType::kF32:
      for (int64_t i = 0; i < count; ++i) {
        const uint32_t bits = static_cast<uint32_t>(p[4 * i]) | (uint32_t{p[4 * i + 1]} << 8) |
                              (uint32_t{p[4 * i + 2]} << 16) | (uint32_t{p[4 * i + 3]} << 24);
        float f;
        std::memcpy(&f, &bits, 4);
        out[i] = FloatToBf16(f);
      }
      break;
    case SafetensorsDType::kF16:
      for (int64_t i = 0; i < count; ++i) {
        const uint16_t h = static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8));
        // IEEE half -> float: every half value is exact in float.
        const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
        const int exp = (h >> 10) & 0x1f;
        const uint32_t mant = h & 0x3ffu;
        float f;
        if (exp == 0) {
          f = std::ldexp(static_cast<float>(mant), -24);
          if (sign) f = -f;
        } else {
          const uint32_t bits =
              exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                        : (sign | (static_cast<uint32_t>(exp - 15 + 127) << 23) | (mant << 13));
          std::memcpy(&f, &bits, 4);
        }
        out[i] = FloatToBf16(f);
      }
      break;
    case SafetensorsDType::kF8E4M3:
    case SafetensorsDType::kF8E5M2:
    case SafetensorsDType::kU8:
      break;  // refused above
  }
  return absl::OkStatus();
}

void ReleaseTensorPages(const SafetensorsTensorView& view) {
  if (view.data.empty()) return;
  // Whole pages: back to the page start, forward to the next page end (both
  // inside the mapping, which is page-aligned and covers its last page).
  const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
  const uint8_t* data = view.data.data();
  const size_t head = reinterpret_cast<uintptr_t>(data) & (page - 1);
  const size_t length = (head + view.data.size() + page - 1) & ~(page - 1);
  (void)::madvise(const_cast<uint8_t*>(data - head), length, MADV_DONTNEED);
}

absl::StatusOr<SafetensorsFile> SafetensorsFile::Open(const std::string& path) {
  // O_NONBLOCK: opening a named pipe must not wait for a writer (it is
  // refused below as not a regular file).
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat("safetensors file ", path, ": ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(msg);
    if (err == EACCES) return absl::PermissionDeniedError(msg);
    return absl::InternalError(msg);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::InternalError(absl::StrCat("fstat ", path, ": ", std::strerror(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(
        "safetensors file ", path, ": not a regular file (a pipe, device or socket is refused)"));
  }
  const uint64_t file_bytes = static_cast<uint64_t>(st.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    return absl::DataLossError(
        absl::StrFormat("safetensors file %s: expected at least 8 bytes (header length), got %d",
                        path, file_bytes));
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  const int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) {
    return absl::InternalError(absl::StrCat("mmap ", path, ": ", std::strerror(map_err)));
  }
  SafetensorsFile file;
  file.path_ = path;
  file.map_ = map;
  file.map_bytes_ = file_bytes;

  const auto* bytes = static_cast<const uint8_t*>(map);
  const uint64_t header_bytes = ReadLe64(bytes);
  if (header_bytes > kMaxHeaderBytes || header_bytes > file_bytes - 8) {
    return absl::DataLossError(
        // The length's value is not shown: the file may be anything (errors
        // never echo file contents, issue 13 item 9).
        absl::StrFormat("safetensors file %s: the header length (first 8 bytes) exceeds the "
                        "file (%d bytes) or %d bytes; not a safetensors file",
                        path, file_bytes, kMaxHeaderBytes));
  }
  json header;
  try {
    header = json::parse(bytes + 8, bytes + 8 + header_bytes);
  } catch (const json::parse_error& e) {
    // e.what() quotes the bytes it read: give only the position.
    return absl::DataLossError(absl::StrCat(
        "safetensors file ", path, ": header is not JSON (parse error at byte ", e.byte, ")"));
  } catch (const json::exception&) {
    return absl::DataLossError(absl::StrCat("safetensors file ", path, ": header is not JSON"));
  }
  if (!header.is_object()) {
    return absl::DataLossError(
        absl::StrCat("safetensors file ", path, ": header is not a JSON object"));
  }
  const uint8_t* data = bytes + 8 + header_bytes;
  const uint64_t data_bytes = file_bytes - 8 - header_bytes;
  for (const auto& [name, entry] : header.items()) {
    if (name == "__metadata__") {
      if (entry.is_object()) {
        for (const auto& [key, value] : entry.items()) {
          if (value.is_string()) file.metadata_[key] = value.get<std::string>();
        }
      }
      continue;
    }
    SafetensorsTensorView view;
    absl::Status s = ParseEntry(entry, data, data_bytes, &view);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("safetensors file ", path, ", tensor \"", name,
                                                 "\": ", s.message()));
    }
    file.tensors_.emplace(name, std::move(view));
  }
  return file;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept { *this = std::move(other); }

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    Release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    tensors_ = std::move(other.tensors_);  // spans stay valid: the mapping moved with them
    metadata_ = std::move(other.metadata_);
    other.tensors_.clear();
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() { Release(); }

void SafetensorsFile::Release() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  map_ = nullptr;
  map_bytes_ = 0;
}

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& [name, view] : tensors_) out.push_back(name);
  return out;
}

absl::StatusOr<SafetensorsTensorView> SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(
        absl::StrCat("tensor \"", name, "\" not found in safetensors file ", path_));
  }
  return it->second;
}

absl::StatusOr<SafetensorsCheckpoint> SafetensorsCheckpoint::Open(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat("safetensors checkpoint ", path, ": no such path"));
  }
  fs::path index_path;
  SafetensorsCheckpoint ckpt;
  if (fs::is_directory(path, ec)) {
    const fs::path dir(path);
    if (fs::exists(dir / "model.safetensors.index.json", ec)) {
      index_path = dir / "model.safetensors.index.json";
    } else if (fs::exists(dir / "model.safetensors", ec)) {
      ckpt.single_path_ = (dir / "model.safetensors").string();
    } else {
      return absl::NotFoundError(
          absl::StrCat("safetensors checkpoint ", path,
                       ": directory has neither "
                       "model.safetensors.index.json nor model.safetensors"));
    }
  } else if (absl::string_view(path).size() >= 5 &&
             absl::string_view(path).substr(path.size() - 5) == ".json") {
    index_path = path;
  } else {
    ckpt.single_path_ = path;
  }

  if (!ckpt.single_path_.empty()) {
    ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(ckpt.single_path_));
    ckpt.open_[ckpt.single_path_] = std::make_unique<SafetensorsFile>(std::move(file));
    return ckpt;
  }

  std::error_code type_ec;
  if (!std::filesystem::is_regular_file(index_path, type_ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat("safetensors index ", index_path.string(),
                     ": not a regular file (a pipe, device or socket is refused)"));
  }
  std::ifstream in(index_path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("safetensors index ", index_path.string(), ": cannot open"));
  }
  try {
    const json index = json::parse(in);
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
      return absl::DataLossError(absl::StrCat("safetensors index ", index_path.string(),
                                              ": expected an object with \"weight_map\""));
    }
    for (const auto& [name, shard] : index["weight_map"].items()) {
      if (!shard.is_string()) {
        return absl::DataLossError(absl::StrCat("safetensors index ", index_path.string(),
                                                ": weight_map[\"", name, "\"] is not a string"));
      }
      // A shard is a file beside the index: no path may lead elsewhere.
      const std::string file = shard.get<std::string>();
      if (file.empty() || file.find('/') != std::string::npos || file == "." || file == "..") {
        return absl::DataLossError(absl::StrCat("safetensors index ", index_path.string(),
                                                ": a weight_map shard is not a file name in "
                                                "the index's directory"));
      }
      ckpt.weight_map_[name] = file;
    }
  } catch (const json::parse_error& e) {
    // e.what() quotes the bytes it read: give only the position.
    return absl::DataLossError(absl::StrCat("safetensors index ", index_path.string(),
                                            ": not JSON (parse error at byte ", e.byte, ")"));
  } catch (const json::exception&) {
    return absl::DataLossError(
        absl::StrCat("safetensors index ", index_path.string(), ": not JSON"));
  }
  ckpt.dir_ = index_path.parent_path().string();
  return ckpt;
}

absl::StatusOr<SafetensorsTensorView> SafetensorsCheckpoint::Find(const std::string& name) {
  std::string shard_path = single_path_;
  if (shard_path.empty()) {
    auto it = weight_map_.find(name);
    if (it == weight_map_.end()) {
      return absl::NotFoundError(
          absl::StrCat("tensor \"", name, "\" not in the weight_map of the index in ", dir_));
    }
    shard_path = (std::filesystem::path(dir_) / it->second).string();
  }
  auto it = open_.find(shard_path);
  if (it == open_.end()) {
    ASSIGN_OR_RETURN(SafetensorsFile file, SafetensorsFile::Open(shard_path));
    it = open_.emplace(shard_path, std::make_unique<SafetensorsFile>(std::move(file))).first;
  }
  return it->second->Find(name);
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors) {
  // Validate everything before creating the file.
  json header = json::object();
  std::set<std::string> seen;
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor name: expected a non-empty name other than __metadata__, got \"", t.name, "\""));
    }
    if (!seen.insert(t.name).second) {
      return absl::InvalidArgumentError(absl::StrCat("tensor \"", t.name, "\": duplicate name"));
    }
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("tensor \"%s\": shape: expected non-negative dims, got %d", t.name, d));
      }
      numel *= static_cast<uint64_t>(d);
    }
    const uint64_t expected = numel * SafetensorsDTypeSize(t.dtype);
    if (t.data.size() != expected) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor \"%s\": data: expected %d bytes (numel %d x %d), got %d", t.name,
                          expected, numel, SafetensorsDTypeSize(t.dtype), t.data.size()));
    }
    header[t.name] = {{"dtype", SafetensorsDTypeName(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + expected}}};
    offset += expected;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(uint64_t{text.size()} >> (8 * i));

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::InternalError(absl::StrCat("safetensors write ", path, ": cannot open"));
  out.write(reinterpret_cast<const char*>(len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const SafetensorsTensor& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.data.data()),
              static_cast<std::streamsize>(t.data.size()));
  }
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("safetensors write ", path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace moe_ep::core
