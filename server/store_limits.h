#pragma once

// Limits of the Rendezvous store (server/rendezvous_service.h; issue 13
// item 10), flags --store-max-* of moe-ep-worker (server/worker_flags.h),
// and the metadata key of the per-generation rendezvous secret. Plain data.

#include <cstdint>

namespace moe_ep::server {

// Metadata key of the per-generation rendezvous secret (server/grpc_store.h
// sends it with every call when Join gave one).
inline constexpr char kSecretMetadataKey[] = "x-moe-ep-rendezvous-secret";

struct StoreLimits {
  int64_t max_key_bytes = 512;
  int64_t max_value_bytes = int64_t{1} << 20;  // Gloo addresses and NCCL ids are < 1 KiB
  int64_t max_keys = 65536;
  // Keys + values held. The worker carves this budget out of its memory cap
  // (server/main.cc), so the store counts in the cap.
  int64_t max_total_bytes = int64_t{16} << 20;
  int64_t max_wait_keys = 4096;  // keys of one Wait
  // Writes need a generation opened by OpenGeneration (the worker's mode);
  // false: any key may be written (a bare store, as in unit tests).
  bool require_open_generation = false;
};

}  // namespace moe_ep::server
