#pragma once

// A protobuf message as JSON for `--json` output (issue 31 item 1): every
// field of the message's descriptor, set or not, under its proto name
// (snake_case, as in the .proto), so that a script sees each field even
// when it is zero. Unlike the proto3 JSON mapping, 64-bit integers are JSON
// numbers (byte counts stay integers) and enums are their value names
// ("WORKER_STATE_ALLOCATED"); repeated fields are arrays, messages objects
// (an unset one with its default values), bytes base64 (as the proto3 JSON
// mapping). Map fields are arrays of {"key", "value"} entries.
//
// Pure and thread-safe. Source: issue 31 item 1 (`status --json` carries
// every GetStatus field).

#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {

// Every field of `message` (see the file comment). Messages nested deeper
// than 16 levels (only a recursive type gets there) are JSON null.
nlohmann::json ProtoToJson(const google::protobuf::Message& message);

}  // namespace moe_ep::client
