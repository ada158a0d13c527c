#pragma once

// Which workers a CLI command drives: an embedded local cluster of N workers
// (`--workers N`, the default) or running workers (`--targets h:p,...`).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/local_cluster.h"

namespace moe_ep::client {

struct WorkerSelection {
  int num_workers = 4;  // local cluster size when `targets` is empty
  std::string targets;  // comma-separated host:port list; wins when set
  std::string backend = "gloo";
  std::string worker_binary;  // empty: next to this executable
  std::string log_dir;        // empty: worker output to stderr
  // Passed to local workers as --log_level (trace, debug, info, warn, error,
  // critical, off); empty leaves the worker's default.
  std::string worker_log_level = "warn";
  // > 0: passed to local workers as --memory_cap_bytes (the worker refuses
  // with RESOURCE_EXHAUSTED beyond it); 0 leaves them uncapped.
  int64_t worker_memory_cap_bytes = 0;
};

struct AttachedWorkers {
  std::unique_ptr<LocalCluster> cluster;  // null for --targets
  std::vector<std::string> targets;       // rank order
};

// Starts the local cluster or parses the targets.
// Errors: those of ParseTargets and LocalCluster::Start.
absl::StatusOr<AttachedWorkers> AttachWorkers(const WorkerSelection& selection);

}  // namespace moe_ep::client
