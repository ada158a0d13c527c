#include "client/health_command.h"

#include <chrono>
#include <memory>

#include "absl/strings/str_cat.h"
#include "client/grpc_status.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace moe_ep::client {
namespace {

using Response = grpc::health::v1::HealthCheckResponse;

const char* StatusName(Response::ServingStatus status) {
  switch (status) {
    case Response::SERVING:
      return "SERVING";
    case Response::NOT_SERVING:
      return "NOT_SERVING";
    case Response::SERVICE_UNKNOWN:
      return "SERVICE_UNKNOWN";
    default:
      return "UNKNOWN";
  }
}

}  // namespace

absl::Status RunHealthCommand(const HealthCommandOptions& options, std::ostream& out) {
  if (options.target.empty()) return absl::InvalidArgumentError("--target: expected host:port");
  if (options.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("--timeout-ms: expected > 0, got ",
                                                   absl::ToInt64Milliseconds(options.timeout)));
  }
  auto stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(options.target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       absl::ToChronoMilliseconds(options.timeout));
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(options.service);
  Response response;
  const grpc::Status status = stub->Check(&context, request, &response);
  const std::string what = absl::StrCat(options.target, " service \"", options.service, "\"");
  if (!status.ok()) {
    const absl::Status error = ToAbslStatus(status);
    return absl::Status(error.code(),
                        absl::StrCat("health check of ", what, ": ", error.message()));
  }
  out << what << " " << StatusName(response.status()) << "\n";
  if (response.status() != Response::SERVING) {
    return absl::UnavailableError(absl::StrCat(what, " is ", StatusName(response.status())));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::client
