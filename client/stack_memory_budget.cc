#include "client/stack_memory_budget.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "client/memory_budget.h"
#include "client/text_table.h"
#include "core/layer_stack_memory.h"
#include "core/status_macros.h"

namespace moe_ep::client {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kWorkerProcessBytes = 128 * kMiB;
constexpr int64_t kCoordinatorProcessBytes = 256 * kMiB;

std::string Bytes(int64_t b) { return FormatBytes(static_cast<double>(b)); }

int64_t Usable(int64_t available_bytes) {
  return available_bytes - MemorySafetyMarginBytes(available_bytes);
}

}  // namespace

absl::StatusOr<StackMemoryEstimate> EstimateStackMemory(const StackMemoryInput& in) {
  const std::pair<const char*, int64_t> non_negative[] = {
      {"num_local_workers", in.num_local_workers},
      {"step_rows", in.step_rows},
      {"gathered_rows", in.gathered_rows}};
  for (const auto& [name, value] : non_negative) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= 0, got ", value));
    }
  }
  const core::LayerStackConfig& c = in.config;
  const int64_t h = c.hidden;
  StackMemoryEstimate e;
  ASSIGN_OR_RETURN(e.worker_stack_bytes, core::EstimateLayerStackBytes(c, 0));
  ASSIGN_OR_RETURN(int64_t scratch,
                   core::EstimateLayerStackScratchBytes(c, in.gathered_rows,
                                                        c.layout.effective_moe_dense_tp_size()));
  e.worker_other_bytes = scratch + 16 * in.gathered_rows * h + kWorkerProcessBytes;
  e.worker_bytes = e.worker_stack_bytes + e.worker_other_bytes;
  e.local_workers_bytes = int64_t{in.num_local_workers} * e.worker_bytes;
  ASSIGN_OR_RETURN(e.reference_bytes, core::EstimateReferenceLayerStackBytes(c, in.step_rows));
  const int64_t attn_tp = c.layout.tp_size / c.layout.attn_dp_size;
  e.coordinator_bytes =
      e.reference_bytes + in.step_rows * h * (8 + 4 * attn_tp) + kCoordinatorProcessBytes;
  e.needed_bytes = e.local_workers_bytes + e.coordinator_bytes;
  return e;
}

absl::Status CheckStackMemory(const StackMemoryInput& input, int64_t available_bytes) {
  ASSIGN_OR_RETURN(StackMemoryEstimate e, EstimateStackMemory(input));
  const int64_t usable = Usable(available_bytes);
  if (e.needed_bytes <= usable) return absl::OkStatus();

  const int layers = static_cast<int>(input.config.sparse_layers.size());
  std::string msg =
      absl::StrCat("memory preflight: this stack needs about ", Bytes(e.needed_bytes),
                   " on this machine, but only ", Bytes(usable), " is available (MemAvailable ",
                   Bytes(available_bytes), " minus a ",
                   Bytes(MemorySafetyMarginBytes(available_bytes)), " safety margin): ");
  if (input.num_local_workers > 0) {
    absl::StrAppend(&msg, input.num_local_workers, " local worker(s) x ", Bytes(e.worker_bytes),
                    " (stack weights and workspace ", Bytes(e.worker_stack_bytes), " for ", layers,
                    " layer(s), other ", Bytes(e.worker_other_bytes), ") + ");
  }
  absl::StrAppend(&msg, "this process ", Bytes(e.coordinator_bytes),
                  " (the single-process reference holds its largest layer whole: ",
                  Bytes(e.reference_bytes), "). Options:");
  int fitting_layers = 0;
  for (int l = layers - 1; l >= 1; --l) {
    StackMemoryInput fewer = input;
    fewer.config.sparse_layers.resize(l);
    absl::StatusOr<StackMemoryEstimate> fe = EstimateStackMemory(fewer);
    if (fe.ok() && fe->needed_bytes <= usable) {
      fitting_layers = l;
      break;
    }
  }
  if (fitting_layers > 0) {
    absl::StrAppend(&msg, "\n  --layers ", fitting_layers,
                    "           the most leading layers that fit");
  } else {
    absl::StrAppend(&msg, "\n  --layers             fewer layers do not help: ",
                    layers == 1 ? "one layer" : "even one layer", " does not fit");
  }
  absl::StrAppend(&msg,
                  "\n  --hidden, --moe-intermediate, --dense-intermediate   stand-in sizes that "
                  "keep the model's layer pattern, experts and top-k (e.g. --hidden 64 "
                  "--moe-intermediate 32 --dense-intermediate 128)",
                  "\n  --targets h:p,...    workers on other machines (moe-ep-worker there); this "
                  "process alone needs ",
                  Bytes(e.coordinator_bytes),
                  e.coordinator_bytes <= usable ? ", fits" : ", still too much");
  return absl::ResourceExhaustedError(msg);
}

int64_t StackWorkerMemoryCapBytes(const StackMemoryEstimate& estimate, int num_local_workers,
                                  int64_t available_bytes) {
  if (num_local_workers < 1) return 0;
  const int64_t left = Usable(available_bytes) - estimate.coordinator_bytes;
  return std::max<int64_t>(left / num_local_workers, 1);
}

}  // namespace moe_ep::client
