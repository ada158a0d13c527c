#include "proto/rpc/probe_server.h"

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"

namespace moe_ep::rpc {
namespace {

// Removes the builder's plugins (server reflection, and any other the
// process registered) before the server is built.
class NoPluginsOption final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments* /*args*/) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->clear();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<grpc::Server>> StartProbeServer(
    const std::string& listen, grpc::CallbackGenericService* unimplemented, int* port) {
  grpc::ServerBuilder builder;
  *port = 0;
  builder.AddListeningPort(listen, grpc::InsecureServerCredentials(), port);
  builder.RegisterCallbackGenericService(unimplemented);
  builder.SetOption(std::make_unique<NoPluginsOption>());
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || *port == 0) {
    return absl::UnavailableError(absl::StrCat("--health-listen: cannot bind ", listen));
  }
  return server;
}

}  // namespace moe_ep::rpc
