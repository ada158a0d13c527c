#include "server/host_forward.h"

#include <cstdint>
#include <cstring>

namespace moe_ep::server {
namespace {

template <typename T>
bool Aligned(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % alignof(T) == 0;
}

// `bytes` as a span of T: in place when aligned, else copied into `copy`.
template <typename T>
absl::Span<const T> View(absl::string_view bytes, std::vector<T>* copy) {
  const size_t n = bytes.size() / sizeof(T);
  if (n == 0) return {};
  if (Aligned<T>(bytes.data())) return {reinterpret_cast<const T*>(bytes.data()), n};
  copy->resize(n);
  std::memcpy(copy->data(), bytes.data(), n * sizeof(T));
  return *copy;
}

}  // namespace

HostForwardTensors::HostForwardTensors(const HostForward& io) : out_bytes_(io.output) {
  if (io.hidden_fp32) {
    hidden_copy_.resize(io.hidden.size() / sizeof(float));
    for (size_t i = 0; i < hidden_copy_.size(); ++i) {
      float value;
      std::memcpy(&value, io.hidden.data() + i * sizeof(float), sizeof(float));
      hidden_copy_[i] = core::FloatToBf16(value);
    }
    hidden_ = hidden_copy_;
  } else {
    hidden_ = View(io.hidden, &hidden_copy_);
  }
  topk_ids_ = View(io.topk_ids, &ids_copy_);
  topk_weights_ = View(io.topk_weights, &weights_copy_);
  const size_t out_elems = io.output.size() / sizeof(core::bf16_t);
  if (out_elems > 0 && Aligned<core::bf16_t>(io.output.data())) {
    output_ = {reinterpret_cast<core::bf16_t*>(io.output.data()), out_elems};
  } else {
    output_copy_.resize(out_elems);
    output_ = absl::MakeSpan(output_copy_);
  }
}

void HostForwardTensors::Finish() {
  if (!output_copy_.empty()) {
    std::memcpy(out_bytes_.data(), output_copy_.data(), output_copy_.size() * sizeof(core::bf16_t));
  }
}

absl::StatusOr<core::StepStats> RunOnHostTensors(const HostForward& io, const HostStep& step) {
  HostForwardTensors tensors(io);
  absl::StatusOr<core::StepStats> stats =
      step(tensors.hidden(), tensors.topk_ids(), tensors.topk_weights(), tensors.output());
  if (stats.ok()) tensors.Finish();
  return stats;
}

}  // namespace moe_ep::server
