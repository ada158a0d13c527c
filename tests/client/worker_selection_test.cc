#include "client/worker_selection.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "CLI/CLI.hpp"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_certs.h"

namespace moe_ep::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(AttachWorkers, TargetsNeedNoCluster) {
  WorkerSelection w;
  w.targets = "127.0.0.1:5000,127.0.0.1:5001";
  auto attached = AttachWorkers(w);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(attached->cluster, nullptr);
  EXPECT_THAT(attached->targets, ElementsAre("127.0.0.1:5000", "127.0.0.1:5001"));
  w.targets = "127.0.0.1:5000,127.0.0.1:5000";
  EXPECT_EQ(AttachWorkers(w).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AttachWorkers, StartsLocalWorkersWithBackendLogLevelAndMemoryCap) {
  char tmpl[] = "/tmp/moe_ep_worker_selection_test_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string script = dir + "/worker";
  std::ofstream(script) << "#!/bin/sh\necho \"args: $*\" >&2\n"
                           "echo 'moe-ep-worker listening on 127.0.0.1:9'\nexec sleep 1000\n";
  chmod(script.c_str(), 0755);
  WorkerSelection w;
  w.num_workers = 2;
  w.backend = "auto";
  w.worker_binary = script;
  w.log_dir = dir;
  w.worker_log_level = "error";
  w.worker_memory_cap_bytes = 123456;
  {
    auto attached = AttachWorkers(w);
    ASSERT_TRUE(attached.ok()) << attached.status();
    ASSERT_NE(attached->cluster, nullptr);
    EXPECT_THAT(attached->targets, ElementsAre("127.0.0.1:9", "127.0.0.1:9"));
  }  // the cluster stops here
  std::ifstream log(dir + "/worker-1.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_THAT(
      text,
      HasSubstr(
          "args: --listen=127.0.0.1:0 --backend=auto --log-level=error --memory-cap-bytes=123456"));
  std::filesystem::remove_all(dir);
}

// How local workers are started: the table in client/worker_selection.h.
TEST(PlanLocalWorkers, GlooKeepsTheWorkerCountEvenWithGpus) {
  const LocalWorkerPlan plan = *PlanLocalWorkers("gloo", 3, 8);
  EXPECT_EQ(plan.num_workers, 3);
  EXPECT_EQ(plan.backend, "gloo");
  EXPECT_FALSE(plan.one_per_gpu);
}

TEST(PlanLocalWorkers, AutoAndNcclWithGpusStartOneNcclWorkerPerGpu) {
  for (const char* backend : {"auto", "nccl"}) {
    const LocalWorkerPlan plan = *PlanLocalWorkers(backend, 4, 2);
    EXPECT_EQ(plan.num_workers, 2) << backend;
    EXPECT_EQ(plan.backend, "nccl") << backend;
    EXPECT_TRUE(plan.one_per_gpu) << backend;
  }
}

TEST(PlanLocalWorkers, AutoWithoutGpusLetsTheWorkersResolveIt) {
  const LocalWorkerPlan plan = *PlanLocalWorkers("auto", 4, 0);
  EXPECT_EQ(plan.num_workers, 4);
  EXPECT_EQ(plan.backend, "auto");
  EXPECT_FALSE(plan.one_per_gpu);
}

TEST(PlanLocalWorkers, NcclWithoutGpusIsFailedPrecondition) {
  absl::StatusOr<LocalWorkerPlan> plan = PlanLocalWorkers("nccl", 4, 0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("no NVIDIA GPU found"));
}

// Parses `args` (after the program name) into a fresh selection.
absl::StatusOr<WorkerSelection> ParseSelection(std::vector<std::string> args, bool allow_targets) {
  CLI::App app("test");
  WorkerSelection w;
  AddWorkerSelectionFlags(&app, &w, allow_targets);
  std::reverse(args.begin(), args.end());  // CLI11 takes the vector reversed
  try {
    app.parse(args);
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  return w;
}

TEST(AddWorkerSelectionFlags, TargetsTakeTheTlsAndTokenFlags) {
  auto w =
      ParseSelection({"--targets", "a:1,b:2", "--tls-ca", "/ca.pem", "--tls-cert", "/c.pem",
                      "--tls-key", "/k.pem", "--auth-token-file", "/token", "--backend", "gloo"},
                     /*allow_targets=*/true);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->targets, "a:1,b:2");
  EXPECT_EQ(w->backend, "gloo");
  EXPECT_EQ(w->security.tls_ca, "/ca.pem");
  EXPECT_EQ(w->security.tls_cert, "/c.pem");
  EXPECT_EQ(w->security.tls_key, "/k.pem");
  EXPECT_EQ(w->security.auth_token_file, "/token");
}

TEST(AddWorkerSelectionFlags, DefaultsAreAutoBackendPlaintextAndFourWorkers) {
  auto w = ParseSelection({}, /*allow_targets=*/true);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->backend, "auto");
  EXPECT_EQ(w->num_workers, 4);
  EXPECT_EQ(w->worker_log_level, "warn");
  EXPECT_TRUE(w->security.tls_ca.empty());
}

TEST(AddWorkerSelectionFlags, WithoutTargetsThereAreNoTargetsNorTlsFlags) {
  // `up` starts its own loopback workers: neither flag exists there.
  EXPECT_FALSE(ParseSelection({"--tls-ca", "/ca.pem"}, /*allow_targets=*/false).ok());
  EXPECT_FALSE(ParseSelection({"--targets", "a:1"}, /*allow_targets=*/false).ok());
  EXPECT_FALSE(ParseSelection({"--targets", "a:1", "--workers", "2"}, true).ok());
}

TEST(AttachWorkers, SecurityFlagWithoutTargetsIsInvalidArgumentNamingIt) {
  WorkerSelection w;
  w.worker_binary = "/nonexistent/moe-ep-worker";
  w.backend = "gloo";
  w.security.auth_token_file = "/token";
  absl::StatusOr<AttachedWorkers> attached = AttachWorkers(w);
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(attached.status().message()),
              HasSubstr("--auth-token-file \"/token\": only with --targets"));
}

TEST(AttachWorkers, TargetsWithBadSecurityOptionsAreInvalidArgument) {
  WorkerSelection w;
  w.targets = "127.0.0.1:5000";
  w.security.tls_cert = "/c.pem";  // without --tls-key
  EXPECT_EQ(AttachWorkers(w).status().code(), absl::StatusCode::kInvalidArgument);
  w.security = ClientSecurityOptions();
  w.security.tls_ca = "/nonexistent/ca.pem";
  absl::StatusOr<AttachedWorkers> attached = AttachWorkers(w);
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(attached.status().message()), HasSubstr("--tls-ca"));
}

TEST(AttachWorkers, TargetsGetChannelCredentialsLocalClustersNone) {
  testing::TestPki pki;
  if (!testing::MakeTestPki("worker_selection_test", &pki)) GTEST_SKIP() << "openssl failed";
  WorkerSelection w;
  w.targets = "127.0.0.1:5000";
  auto plain = AttachWorkers(w);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_NE(plain->channel_credentials, nullptr);
  w.security.tls_ca = pki.ca_cert;
  w.security.tls_cert = pki.client_cert;
  w.security.tls_key = pki.client_key;
  auto tls = AttachWorkers(w);
  ASSERT_TRUE(tls.ok()) << tls.status();
  EXPECT_NE(tls->channel_credentials, nullptr);
  EXPECT_NE(tls->channel_credentials, plain->channel_credentials);
  std::filesystem::remove_all(pki.dir);
}

}  // namespace
}  // namespace moe_ep::client
