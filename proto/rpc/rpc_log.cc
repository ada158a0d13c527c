#include "proto/rpc/rpc_log.h"

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "grpcpp/server_context.h"
#include "spdlog/spdlog.h"

namespace moe_ep::rpc {
namespace {

class RpcLogInterceptor final : public grpc::experimental::Interceptor {
 public:
  RpcLogInterceptor(const RpcLogOptions* options, grpc::experimental::ServerRpcInfo* info)
      : options_(options),
        method_(info->method() != nullptr ? info->method() : "?"),
        context_(info->server_context()),
        start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      Log(methods->GetSendStatus());
    }
    methods->Proceed();
  }

 private:
  void Log(const grpc::Status& status) const {
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start_)
            .count();
    const std::string peer = context_ != nullptr ? context_->peer() : "?";
    const std::string code =
        absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code()));
    const std::string message =
        status.error_message().empty() ? std::string() : ": " + status.error_message();
    if (!status.ok() && Matches(options_->warn_prefixes, /*prefix=*/true)) {
      spdlog::warn("{} from {} failed after {:.1f} ms: {}{}", method_, peer, ms, code, message);
      return;
    }
    const auto level = status.ok() && Matches(options_->info_methods, /*prefix=*/false)
                           ? spdlog::level::info
                           : spdlog::level::debug;
    if (status.ok()) {
      spdlog::log(level, "{} from {}: OK in {:.1f} ms", method_, peer, ms);
    } else {
      spdlog::log(level, "{} from {}: {} in {:.1f} ms{}", method_, peer, code, ms, message);
    }
  }

  bool Matches(const std::vector<std::string>& names, bool prefix) const {
    for (const std::string& name : names) {
      if (prefix ? absl::StartsWith(method_, name) : method_ == name) return true;
    }
    return false;
  }

  const RpcLogOptions* options_;
  std::string method_;
  grpc::ServerContextBase* context_;
  std::chrono::steady_clock::time_point start_;
};

class RpcLogFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit RpcLogFactory(RpcLogOptions options) : options_(std::move(options)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new RpcLogInterceptor(&options_, info);
  }

 private:
  const RpcLogOptions options_;
};

}  // namespace

RpcLogOptions WorkerRpcLogOptions() {
  RpcLogOptions options;
  options.warn_prefixes = {"/moe_ep.v1.Worker/"};
  for (const char* rpc : {"Join", "Leave", "ConfigureLayers", "AllocateWorkspace", "LoadExperts",
                          "InstallPlacement", "Rejoin"}) {
    options.info_methods.push_back(std::string("/moe_ep.v1.Worker/") + rpc);
  }
  return options;
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeRpcLogInterceptorFactory(
    RpcLogOptions options) {
  return std::make_unique<RpcLogFactory>(std::move(options));
}

}  // namespace moe_ep::rpc
