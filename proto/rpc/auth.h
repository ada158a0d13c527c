#pragma once

// Bearer-token authentication of the worker's control plane (issue 5): every
// call must carry the metadata "authorization: Bearer <token>" with the token
// held in --auth-token-file (a Kubernetes secret). A call without it, or with
// another token, is rejected with UNAUTHENTICATED by gRPC's security layer
// before any service handler runs, so it leaves no trace in the worker's
// state or counters.
//
// The file is re-read when its modification time or size changes (checked on
// each call, one stat()), so a rotated secret takes effect without a restart;
// a rotation that leaves the file unreadable or empty keeps the previous
// token (and logs a warning). Leading/trailing whitespace of the file is
// ignored.
//
// gRPC runs AuthMetadataProcessors only on secure (TLS) server credentials;
// proto/rpc/tls_credentials.h refuses a token without TLS.
//
// Thread-safe. Source: issue 5; gRPC 1.51 grpcpp/security/auth_metadata_processor.h.

#include <sys/types.h>

#include <ctime>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace moe_ep::rpc {

// The token in `path`, whitespace-trimmed.
// Errors: kInvalidArgument when the file cannot be read or holds no token
// (names the path).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

class BearerTokenAuth final : public grpc::AuthMetadataProcessor {
 public:
  // Errors: as ReadTokenFile.
  static absl::StatusOr<std::shared_ptr<BearerTokenAuth>> Create(const std::string& path);

  // UNAUTHENTICATED when "authorization" is missing, is not "Bearer <token>",
  // or the token differs (constant-time comparison); OK otherwise (the
  // authorization entry is consumed: handlers never see it).
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata,
                       OutputMetadata* response_metadata) override;

  // The token in force (re-reads a changed file first).
  std::string CurrentToken();

 private:
  explicit BearerTokenAuth(std::string path) : path_(std::move(path)) {}
  // Re-reads the file when its mtime or size changed. Needs mu_.
  void RefreshLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string path_;
  absl::Mutex mu_;
  std::string token_ ABSL_GUARDED_BY(mu_);
  struct timespec mtime_ ABSL_GUARDED_BY(mu_) = {};
  off_t size_ ABSL_GUARDED_BY(mu_) = -1;
};

}  // namespace moe_ep::rpc
