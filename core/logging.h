#pragma once

// Structured logs of the worker (issue 5, "Observability"): every line carries
// the worker's rank, group generation and geometry epoch.
//
//   --log-format=text (default): spdlog's usual line with a context field,
//     [2025-01-02 10:11:12.345] [info] [rank=1 gen=3 epoch=7] message
//     ("rank=-" before Join).
//   --log-format=json: one JSON object per line (JSON Lines), e.g.
//     {"ts":"2025-01-02T10:11:12.345678Z","level":"info","logger":"moe-ep-worker",
//      "rank":1,"generation":3,"epoch":7,"thread":1234,"msg":"..."}
//     with "rank"/"generation"/"epoch" null before Join; the message is
//     JSON-escaped (invalid UTF-8 replaced).
//
// The fields are process-wide and set with SetLogContext(); the worker
// service sets them whenever its state, generation or epoch changes, so a
// line logged inside a call that changes them (e.g. Join) shows the values
// from before the change and the lines after it the new ones.
//
// A process that is not a worker (the coordinator service, issue 31 item 5)
// uses the same formats without the worker's fields:
//     [2025-01-02 10:11:12.345] [info] message
//     {"ts":"...","level":"info","logger":"moe-ep-coordinator","thread":1234,"msg":"..."}
//
// Thread-safe (the fields are atomics). Source: issue 5; spdlog 1.10
// (custom formatter), nlohmann-json (escaping).

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "spdlog/formatter.h"

namespace moe_ep::core {

// rank < 0 means "not joined" (rank, generation and epoch print as null / "-").
void SetLogContext(int rank, int64_t generation, int64_t epoch);

// Which fields a line carries besides time, level and message.
enum class LogFields {
  kWorker,  // rank, generation and epoch (SetLogContext)
  kPlain,   // none (a process that is not a worker)
};

// A formatter for `format` ("text" or "json").
// Errors: kInvalidArgument for any other format (names the flag and value).
absl::StatusOr<std::unique_ptr<spdlog::formatter>> MakeLogFormatter(
    const std::string& format, LogFields fields = LogFields::kWorker);

// Installs MakeLogFormatter(format, fields) on the default logger.
// Errors: as MakeLogFormatter.
absl::Status ConfigureLogFormat(const std::string& format, LogFields fields = LogFields::kWorker);

}  // namespace moe_ep::core
