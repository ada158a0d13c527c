#pragma once

// The command line of `moe-ep-worker` (DESIGN §8; issue 9 item 5): one
// dialect with `moe-ep`, kebab-case (`--log-level`), CLI11. The underscore
// spellings of earlier releases (`--log-level`) are accepted for one release,
// hidden from `--help`, with a note on stderr naming the new spelling.

#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "server/request_limits.h"
#include "server/store_limits.h"

namespace moe_ep::server {

// Every flag of the worker, with its default. Units in the names; the help
// text of each is in server/worker_flags.cc.
struct WorkerFlags {
  std::string listen = "127.0.0.1:0";
  std::string backend = "auto";         // auto, gloo, nccl
  std::string gpu_data_plane = "auto";  // auto, one-sided, nccl (backend nccl)
  int32_t device = 0;
  int32_t onesided_sm_budget = 16;           // blocks of each one-sided communication kernel
  bool onesided_receive_buffers = false;     // engine receive buffers in the one-sided windows
  int64_t memory_cap_bytes = 0;              // 0 = 3/4 of the machine's or cgroup's memory
  std::vector<std::string> checkpoint_dirs;  // --checkpoint-dir, repeatable
  RequestLimits limits;                      // --max-*
  StoreLimits store;                         // --store-max-*
  std::string log_level = "info";
  std::string log_format = "text";  // text, json
  std::string data_plane_host;      // "" = from GLOO_SOCKET_IFNAME, else 127.0.0.1
  std::string port_file;
  int64_t drain_timeout_ms = 5000;
  std::string tls_cert;
  std::string tls_key;
  std::string tls_client_ca;
  std::string tls_peer_ca;
  int32_t tls_refresh_s = 10;
  bool allow_insecure = false;
  std::string auth_token_file;
  int32_t max_message_bytes = 256 << 20;
  std::string metrics_listen;
  std::string metrics_port_file;
  std::string health_listen;
  std::string health_port_file;
  bool enable_echo = false;  // serve the test-only Echo RPC (worker.proto)
};

// ParseWorkerFlags()
//
// Parses argv[1..argc) into `*flags`. Returns std::nullopt when the worker
// should start, else the exit status the process should return at once:
//   0  --help / -h (the flag list with defaults, on `out`) or --version
//      ("moe-ep-worker 0.1.0", on `out`).
//   2  a command line that does not parse (core::kExitBadCommandLine): an
//      unknown flag, a missing value, a value of the wrong type or out of
//      range ("--drain-timeout-ms: expected a number >= 0, got -5"), an
//      unknown --backend / --log-level / --log-format; the message and
//      "Run with --help for more information." go to `err`.
// `--flag value` and `--flag=value` both work; a bool flag takes no value
// (`--allow-insecure`) or `=true` / `=false`. An underscore spelling writes
// "moe-ep-worker: --log-level is deprecated, use --log-level" to `err`.
// Not thread-safe (fills `*flags`); call once from main. Source: issue 9.
std::optional<int> ParseWorkerFlags(int argc, const char* const* argv, WorkerFlags* flags,
                                    std::ostream& out, std::ostream& err);

}  // namespace moe_ep::server
