#pragma once

// Reader and writer of the safetensors checkpoint format (Hugging Face):
//   [8 bytes: N, little-endian uint64] [N bytes: JSON header] [raw data]
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end]} with offsets in bytes relative to the start of the raw data;
// an optional "__metadata__" entry holds string pairs. Data is little-endian,
// row-major. Supported dtypes: BF16, F16, F32, and the quantized checkpoints'
// F8_E4M3, F8_E5M2 (one byte an element) and U8 (mxfp4 blocks and E8M0
// scales); others are rejected by name.
//
// A multi-file checkpoint (model.safetensors.index.json with a "weight_map"
// from tensor name to shard file) opens through SafetensorsCheckpoint.
//
// Source: https://github.com/huggingface/safetensors (format description).

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::core {

enum class SafetensorsDType { kBF16, kF16, kF32, kF8E4M3, kF8E5M2, kU8 };

// "BF16", "F16", "F32", "F8_E4M3", "F8_E5M2", "U8" (the format's spelling).
std::string SafetensorsDTypeName(SafetensorsDType dtype);
// Bytes per element: 2, 2, 4, 1, 1, 1.
int SafetensorsDTypeSize(SafetensorsDType dtype);
// Whether the dtype holds plain float values (BF16, F16, F32): the others
// are quantized codes that mean nothing without their scales
// (core/quantized_weights.h) or raw bytes.
bool SafetensorsIsFloat(SafetensorsDType dtype);

// A tensor inside an open file. `data` points into the file's mapping and
// stays valid while the SafetensorsFile lives.
struct SafetensorsTensorView {
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
  absl::Span<const uint8_t> data;  // numel * dtype size bytes
};

// SafetensorsToBf16()
//
// Decodes elements [first_element, first_element + out.size()) of `view`
// (row-major) into bf16 bit patterns: BF16 as is, F16 exactly widened then
// F32 rounded to nearest even (core/bf16.h). Reads only those elements'
// bytes, so a loader can decode a large tensor in pieces into a bounded
// buffer. Errors: kInvalidArgument when the range exceeds the tensor's
// elements (with both), or the tensor is not BF16/F16/F32 (fp8 codes need
// their scales: core/quantized_weights.h). Thread-safe.
absl::Status SafetensorsToBf16(const SafetensorsTensorView& view, int64_t first_element,
                               absl::Span<uint16_t> out);

// ReleaseTensorPages()
//
// Tells the kernel this process no longer needs `view`'s pages resident
// (madvise MADV_DONTNEED over the whole pages the view touches). The data
// stays readable: the mapping is private, read-only and never written, so a
// later access reads the file again. A streaming loader calls it after each
// tensor, so its resident memory never holds more than one tensor of the
// file. Best effort: a failed madvise only leaves the pages resident.
void ReleaseTensorPages(const SafetensorsTensorView& view);

// One safetensors file, memory-mapped read-only. Move-only.
class SafetensorsFile {
 public:
  // Errors: kNotFound (no such file), kPermissionDenied / kInternal (open or
  // mmap failed, with errno text), kDataLoss (file shorter than its header
  // says, header not JSON, a tensor entry malformed: missing field, unknown
  // dtype, negative shape, offsets out of range or not matching the shape;
  // the message names the path and the tensor).
  static absl::StatusOr<SafetensorsFile> Open(const std::string& path);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  bool Contains(const std::string& name) const { return tensors_.count(name) > 0; }
  // Errors: kNotFound naming the tensor and the path.
  absl::StatusOr<SafetensorsTensorView> Find(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  void Release();

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::map<std::string, SafetensorsTensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A checkpoint of one or more safetensors files. `path` is a .safetensors
// file, a model.safetensors.index.json, or a directory holding either
// model.safetensors.index.json or model.safetensors. Shards open lazily on
// first lookup. Not thread-safe (lookups may open shards).
class SafetensorsCheckpoint {
 public:
  // Errors: kNotFound (path, index or shard missing), kDataLoss (index not
  // JSON or without "weight_map"), and SafetensorsFile::Open's errors.
  static absl::StatusOr<SafetensorsCheckpoint> Open(const std::string& path);

  // Errors: kNotFound naming the tensor; shard open errors.
  absl::StatusOr<SafetensorsTensorView> Find(const std::string& name);

 private:
  std::string dir_;
  std::map<std::string, std::string> weight_map_;  // tensor -> shard file name (index only)
  std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;  // shard path -> file
  std::string single_path_;                                       // set when not indexed
};

// One tensor to write: `data` holds numel * dtype size little-endian bytes.
struct SafetensorsTensor {
  std::string name;
  SafetensorsDType dtype = SafetensorsDType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;
};

// Writes `tensors` (in the given order) as one safetensors file, the header
// padded with spaces to a multiple of 8 bytes.
// Errors: kInvalidArgument (empty or duplicate name, negative dim, data size
// not numel * dtype size, naming the tensor), kInternal (write failed, with
// the path).
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsTensor>& tensors);

}  // namespace moe_ep::core
