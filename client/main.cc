// moe-ep: the coordinator CLI (DESIGN §8). Flags and wiring only; the logic
// lives in the client library (client/*_command.h, client/run_job.h).
//
// Exit codes: 0 success; 1 an operation failed (or `run` / `stack` found a
// layer or DP group that disagrees with the reference); 2 bad command line
// (one CLI11 refuses, a mistyped subcommand, which gets the nearest name, or
// a flag combination a command refuses: IsCommandLineError); 130 interrupted.

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/bench_command.h"
#include "client/cli_validators.h"
#include "client/credentials.h"
#include "client/desired_state.h"
#include "client/health_command.h"
#include "client/interrupt.h"
#include "client/local_cluster.h"
#include "client/plan_command.h"
#include "client/run_job.h"
#include "client/run_tp_options.h"
#include "client/service/coordinator_cli.h"
#include "client/service/coordinator_command.h"
#include "client/stack_job.h"
#include "client/status_command.h"
#include "client/up_command.h"
#include "client/watch_command.h"
#include "client/worker_selection.h"
#include "client/workspace_command.h"
#include "core/command_line.h"

namespace {

using namespace moe_ep::client;  // NOLINT(build/namespaces): main.cc wiring only

// --workers / --targets / --backend / --worker-binary / --log-dir /
// --worker-log-level, and for --targets the TLS / token flags.
void AddWorkerFlags(CLI::App* cmd, WorkerSelection* w, bool allow_targets) {
  AddWorkerSelectionFlags(cmd, w, allow_targets);
}

// `moe-ep stack` and `moe-ep run --tp`: run, print the summary (with --json:
// progress on stderr, the JSON summary on stdout), and fail when any DP group
// disagrees with the reference.
absl::Status RunStackAction(const StackJobOptions& options, bool json) {
  auto result = RunStackJob(options, json ? std::cerr : std::cout);
  if (!result.ok()) return result.status();
  if (json) {
    std::cout << StackSummaryJson(*result).dump(2) << "\n";
  } else {
    std::cout << "\n" << RenderStackSummary(*result);
  }
  if (!result->AllPass()) {
    return absl::DataLossError("at least one DP group disagrees with the reference (see above)");
  }
  return absl::OkStatus();
}

// The CLI. Parse errors are caught around app.parse() (exit 2); library
// throws become absl::Status inside the commands. main() below catches what is
// left (bad_alloc, a CLI11 flag defined twice) so local workers are stopped by
// their destructors and the process exits 1 with the reason.
int RunCli(int argc, char** argv) {
  CLI::App app{
      "moe-ep: expert-parallel MoE coordinator (forms a group of moe-ep-worker "
      "processes, configures, runs and verifies MoE layers)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "moe-ep " + std::string(moe_ep::core::Version()),
                       "print the version and exit");
  std::function<absl::Status()> action;
  bool long_running_up = false;

  // up
  WorkerSelection up_workers;
  GroupSetupOptions up_setup;
  auto* up = app.add_subcommand(
      "up",
      "start N local workers, form the group, wait for Ctrl-C; or, with --targets, form and "
      "configure a group of running workers (embedded ones too) and exit");
  AddWorkerFlags(up, &up_workers, /*allow_targets=*/true);
  up->add_option("--hidden", up_setup.hidden, "configure: hidden size H (0 = only form)")
      ->capture_default_str();
  up->add_option("--num-experts", up_setup.num_experts, "configure: routed experts E");
  up->add_option("--top-k", up_setup.top_k, "configure: experts per token K");
  up->add_option("--capacity", up_setup.capacity_tokens, "configure: N, tokens per rank");
  up->add_option("--cuda-graph-buckets", up_setup.cuda_graph_buckets,
                 "configure: ascending token buckets for R")
      ->delimiter(',');
  up->add_option("--layers", up_setup.layers, "configure: sparse layers")->capture_default_str();
  up->add_option("--load-experts", up_setup.experts, "configure: none | identity | swiglu")
      ->check(CLI::IsMember({"none", "identity", "swiglu"}))
      ->capture_default_str();
  up->add_option("--intermediate", up_setup.intermediate, "configure: I of swiglu experts");
  up->add_option("--seed", up_setup.seed, "configure: seed of swiglu experts")
      ->capture_default_str();
  up->add_option("--group-timeout", up_setup.group_timeout_s,
                 "seconds a collective waits for every rank before the group is broken")
      ->capture_default_str();
  up->add_option("--invalid-expert-id", up_setup.invalid_expert_id,
                 "configure: the padding id of topk ids, -1 | num_experts (other ids outside "
                 "[0, E) are errors)")
      ->check(CLI::IsMember({"-1", "num_experts"}))
      ->capture_default_str();
  up->add_option("--dispatch-dtype", up_setup.dispatch_dtype,
                 "configure: what dispatch moves, bf16 | fp8_e4m3 (H a multiple of 128)")
      ->check(CLI::IsMember({"bf16", "fp8_e4m3"}))
      ->capture_default_str();
  up->callback([&] {
    long_running_up = up_workers.targets.empty();
    action = [&] { return RunUpCommand(up_workers, up_setup, std::cout); };
  });

  // plan
  PlanCommandOptions plan_options;
  bool no_a2a = false;
  auto* plan = app.add_subcommand("plan", "print the per-layer scatter-mode plan (offline)");
  plan->add_option("--model", plan_options.model, "config.json path or preset name")
      ->capture_default_str();
  plan->add_option("--tp", plan_options.tp_size, "tensor-parallel size (= world)")
      ->required()
      ->check(Positive());
  plan->add_option("--attn-dp", plan_options.attn_dp_size, "attention data-parallel size")
      ->capture_default_str()
      ->check(Positive());
  plan->add_option("--moe-dense-tp", plan_options.moe_dense_tp_size,
                   "dense MLP TP size: 1, attn_tp or tp (default unset = tp)")
      ->check(Positive());
  plan->add_flag("--no-a2a", no_a2a, "no all-to-all backend: sparse MLPs run FULL");
  plan->add_flag("--json", plan_options.json, "print the plan as JSON");
  plan->callback([&] {
    plan_options.a2a_enabled = !no_a2a;
    action = [&] { return RunPlanCommand(plan_options, std::cout); };
  });

  // workspace
  WorkspaceCommandOptions ws_options;
  auto* ws = app.add_subcommand("workspace", "print payload and workspace sizes (offline)");
  ws->add_option("--model", ws_options.model, "config.json path or preset name")
      ->capture_default_str();
  ws->add_option("--ep", ws_options.ep_size, "EP size E")->required()->check(Positive());
  ws->add_option("--max-tokens", ws_options.max_tokens, "capacity N, tokens per rank")
      ->required()
      ->check(Positive());
  ws->add_option("--dtype", ws_options.dtype,
                 "dispatch dtype (sizes only: the data planes move bf16 and fp8_e4m3)")
      ->check(CLI::IsMember({"bf16", "nvfp4", "mxfp8", "fp8_e4m3"}))
      ->capture_default_str();
  ws->add_flag("--json", ws_options.json, "print the sizes as JSON");
  ws->callback([&] { action = [&] { return RunWorkspaceCommand(ws_options, std::cout); }; });

  // status
  StatusCommandOptions status_options;
  auto* status = app.add_subcommand("status", "print a table of running workers");
  status->add_option("--targets", status_options.targets, "host:port,...")->required();
  AddSecurityFlags(status, &status_options.security);
  status->add_flag("--json", status_options.json, "print the workers as JSON");
  status->callback([&] { action = [&] { return RunStatusCommand(status_options, std::cout); }; });

  // health
  HealthCommandOptions health_options;
  int64_t health_timeout_ms = 3000;
  auto* health = app.add_subcommand(
      "health",
      "one grpc.health.v1 Check of a plaintext health port (exec probes); exit 0 only if "
      "SERVING");
  health->add_option("--target", health_options.target, "host:port of the --health-listen port")
      ->required();
  health
      ->add_option("--service", health_options.service,
                   "\"\" = liveness (the process serves), moe_ep.v1.Worker = readiness "
                   "(joined and allocated)")
      ->capture_default_str();
  health->add_option("--timeout-ms", health_timeout_ms, "deadline of the call, ms")
      ->capture_default_str()
      ->check(Positive());
  health->callback([&] {
    action = [&] {
      health_options.timeout = absl::Milliseconds(health_timeout_ms);
      return RunHealthCommand(health_options, std::cout);
    };
  });

  // watch
  WatchCommandOptions watch_options;
  auto* watch = app.add_subcommand("watch", "refresh the status table until Ctrl-C");
  watch->add_option("--targets", watch_options.targets, "host:port,...")->required();
  watch->add_option("--interval-ms", watch_options.interval_ms, "refresh interval, ms")
      ->capture_default_str()
      ->check(Positive());
  watch->add_option("--count", watch_options.count, "stop after N refreshes (0 = until Ctrl-C)")
      ->capture_default_str()
      ->check(NonNegative());
  bool watch_no_clear = false;
  watch->add_flag("--no-clear", watch_no_clear, "append tables instead of redrawing the screen");
  AddSecurityFlags(watch, &watch_options.security);
  watch->callback([&] {
    long_running_up = true;  // stops by itself on Ctrl-C (exit 0)
    // No ANSI codes to a pipe or a file (issue 31 item 1).
    watch_options.clear_screen = !watch_no_clear && isatty(STDOUT_FILENO) == 1;
    action = [&] {
      return RunWatchCommand(watch_options, std::cout, [] { return InterruptSignal() != 0; });
    };
  });

  // coordinator
  CoordinatorCommandOptions coordinator_options;
  auto* coordinator = app.add_subcommand(
      "coordinator",
      "long-running service: keep a worker group formed, configured and allocated as a desired "
      "state says, re-forming it after any worker restart or failure (DESIGN §16)");
  AddCoordinatorFlags(coordinator, &coordinator_options);
  coordinator->footer(DesiredStateHelp());
  // `moe-ep coordinator status|apply|drain`: a client of a running one (issue 31 item 1).
  CoordinatorClientOptions coordinator_client;
  AddCoordinatorClientCommands(coordinator, &coordinator_client, &action, &std::cout);
  coordinator->callback([&] {
    if (!coordinator->get_subcommands().empty()) return;  // a client subcommand set `action`
    long_running_up = true;  // stops by itself on SIGINT / SIGTERM (exit 0)
    action = [&] {
      return RunCoordinatorCommand(coordinator_options, std::cout,
                                   [] { return InterruptSignal() != 0; });
    };
  });

  // run
  RunJobOptions run_options;
  double rpc_timeout_s = kDefaultRpcTimeoutSeconds;
  auto* run = app.add_subcommand(
      "run", "the main job: run a model's MoE layers across the workers and verify them");
  AddWorkerFlags(run, &run_options.workers, /*allow_targets=*/true);
  run->add_option("--model", run_options.model, "config.json path or preset name")
      ->capture_default_str();
  run->add_option("--layers", run_options.num_layers, "run the first L MoE layers")
      ->capture_default_str()
      ->check(Positive());
  run->add_option("--tokens", run_options.tokens_per_rank,
                  "mean tokens per rank and step (counts are uneven, one rank gets 0; "
                  "trace: routing prescribes them)")
      ->capture_default_str()
      ->check(Positive());
  run->add_flag("--even-tokens", run_options.even_tokens,
                "every rank gets exactly --tokens tokens (no zero-token rank)");
  run->add_option("--steps", run_options.steps, "forward steps")
      ->capture_default_str()
      ->check(Positive());
  run->add_option("--routing", run_options.routing,
                  "uniform | skewed[:S] | trace:FILE.jsonl | load:FILE.json")
      ->capture_default_str();
  run->add_option("--seed", run_options.seed, "seed of hidden states, routing and experts")
      ->capture_default_str();
  run->add_option("--experts", run_options.experts,
                  "swiglu (bf16) | identity | checkpoint (the config's quantization: fp8 or "
                  "mxfp4 experts, gloo plane)")
      ->check(CLI::IsMember({"swiglu", "identity", "checkpoint"}))
      ->capture_default_str();
  std::string run_dispatch_dtype = "bf16";
  run->add_option("--dispatch-dtype", run_dispatch_dtype,
                  "dispatch payload: bf16 | fp8_e4m3 (e4m3, one fp32 scale per 128 values; "
                  "the reference applies the same rounding)")
      ->check(CLI::IsMember({"bf16", "fp8_e4m3"}))
      ->capture_default_str();
  run->add_option("--capacity", run_options.capacity_tokens,
                  "workspace capacity N, tokens per rank (default: the run's largest count)")
      ->check(NonNegative());
  run->add_option("--redundant-slots", run_options.redundant_slots_per_rank,
                  "expert slots a worker may hold beyond ceil(experts / workers) (DESIGN §15)")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option("--rebalance-after", run_options.rebalance_after_steps,
                  "rebalance every run layer with EPLB from the workers' load statistics after "
                  "this step (0 = never; needs --redundant-slots); prints the load table")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option(
         "--kill-rank", run_options.kill_rank,
         "kill this local worker with SIGKILL just before --kill-at-step; the survivors "
         "mask it and keep serving (DESIGN §15; any backend, >= 2 local workers; -1 = none)")
      ->capture_default_str();
  run->add_option("--kill-at-step", run_options.kill_at_step,
                  "the step (1-based) before which --kill-rank is killed")
      ->check(NonNegative());
  run->add_option("--restart-at-step", run_options.restart_at_step,
                  "restart the killed worker before this step (1-based, after --kill-at-step) and "
                  "re-admit it (Rejoin); 0 = it stays masked")
      ->check(NonNegative());
  run->add_option("--rel-tol", run_options.tolerance.rel,
                  "pass when |out - ref| <= rel * max|ref| + atol")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option("--abs-tol", run_options.tolerance.atol, "atol of the check above")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option("--rpc-timeout", rpc_timeout_s, "deadline of each fanned-out call, seconds")
      ->capture_default_str()
      ->check(Positive());
  // Issue 4: `run --layers K --tp T --attn-dp D` runs the whole decoder stack
  // (the same job as `moe-ep stack`) instead of the MoE layers alone.
  int run_tp = 0, run_attn_dp = 1, run_moe_dense_tp = 0;
  auto* run_tp_option =
      run->add_option("--tp", run_tp,
                      "run the model's first --layers decoder layers (attention stand-in, DESIGN "
                      "§3 steps, dense and MoE MLPs) on T Gloo workers, as `moe-ep stack`")
          ->check(Positive());
  run->add_option("--attn-dp", run_attn_dp, "with --tp: attention data-parallel size")
      ->needs(run_tp_option)
      ->capture_default_str()
      ->check(Positive());
  run->add_option("--moe-dense-tp", run_moe_dense_tp,
                  "with --tp: dense MLP TP size (1, or the attention-TP size); unset = tp")
      ->needs(run_tp_option)
      ->check(NonNegative());
  run->add_flag("--attach", run_options.attach,
                "with --targets: drive steps on the group the workers already form (e.g. "
                "`moe-ep coordinator`'s; steps are not leased) without forming, configuring, "
                "allocating or loading; every step is still verified")
      ->excludes(run_tp_option);
  bool run_json = false;
  run->add_flag("--json", run_json, "progress on stderr, the summary as JSON on stdout");
  run->callback([&] {
    run_options.rpc_timeout = absl::Seconds(rpc_timeout_s);
    run_options.dispatch_dtype = *moe_ep::core::ParseDispatchDType(run_dispatch_dtype);
    if (run_tp > 0 && run_options.dispatch_dtype != moe_ep::core::DispatchDType::kBF16) {
      action = [] {
        return absl::InvalidArgumentError(
            "--dispatch-dtype: fp8_e4m3 applies to the MoE-layer run, not to --tp (the decoder "
            "stack dispatches bf16)");
      };
      return;
    }
    if (run_tp > 0) {
      // Every run flag applies to the stack or is refused (issue 9 item 4).
      auto given = [&](const char* flag) { return run->get_option(flag)->count() > 0; };
      RunFlagsGiven flags;
      flags.experts = given("--experts");
      flags.routing = given("--routing");
      flags.rel_tol = given("--rel-tol");
      flags.abs_tol = given("--abs-tol");
      flags.even_tokens = given("--even-tokens");
      flags.workers = given("--workers");
      flags.backend = given("--backend");
      absl::StatusOr<StackJobOptions> stack_job =
          StackJobFromRun(run_options, flags, run_tp, run_attn_dp, run_moe_dense_tp);
      action = [stack_job, &run_json]() {
        return stack_job.ok() ? RunStackAction(*stack_job, run_json) : stack_job.status();
      };
      return;
    }
    action = [&]() -> absl::Status {
      auto result = RunJob(run_options, run_json ? std::cerr : std::cout);
      if (!result.ok()) return result.status();
      if (run_json) {
        std::cout << RunSummaryJson(*result).dump(2) << "\n";
      } else {
        std::cout << "\n" << RenderRunSummary(*result);
      }
      if (!result->AllPass()) {
        return absl::DataLossError("at least one layer disagrees with the reference (see above)");
      }
      return absl::OkStatus();
    };
  });

  // stack
  StackJobOptions stack_options;
  double stack_rpc_timeout_s = kDefaultRpcTimeoutSeconds;
  bool stack_no_a2a = false;
  auto* stack = app.add_subcommand(
      "stack",
      "run K decoder layers under DP attention + EP (ForwardLayers, Gloo) and verify every DP "
      "group against the single-process reference");
  stack
      ->add_option("--model", stack_options.model,
                   "config.json path or preset: sparse pattern, experts, top-k, RMS eps")
      ->capture_default_str();
  stack->add_option("--tp", stack_options.tp_size, "tensor-parallel size (= workers)")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--attn-dp", stack_options.attn_dp_size, "attention data-parallel size")
      ->capture_default_str()
      ->check(Positive());
  stack
      ->add_option("--moe-dense-tp", stack_options.moe_dense_tp_size,
                   "dense MLP TP size: 1, attn_tp or tp (default unset = tp)")
      ->check(Positive());
  stack->add_flag("--no-a2a", stack_no_a2a, "no all-to-all backend: sparse MLPs run FULL");
  stack->add_option("--layers", stack_options.num_layers, "run the model's first K layers")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--hidden", stack_options.hidden, "hidden size H (0 = the model's)")
      ->capture_default_str()
      ->check(NonNegative());
  stack
      ->add_option("--moe-intermediate", stack_options.moe_intermediate,
                   "expert intermediate size (0 = the model's)")
      ->capture_default_str()
      ->check(NonNegative());
  stack
      ->add_option("--dense-intermediate", stack_options.dense_intermediate,
                   "dense MLP intermediate size, a multiple of --tp (0 = the model's)")
      ->capture_default_str()
      ->check(NonNegative());
  stack
      ->add_option("--tokens", stack_options.tokens_per_group,
                   "mean tokens per DP group and step (uneven; one group gets 0 when attn_dp > 1)")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--steps", stack_options.steps, "forward steps")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--seed", stack_options.seed, "seed of tokens, weights and routing")
      ->capture_default_str();
  stack
      ->add_option(
          "--capacity", stack_options.capacity_tokens,
          "all-to-all capacity N, tokens per rank (default: the largest DP group + attn_tp)")
      ->check(NonNegative());
  stack->add_flag("--allow-reduce-scatter", stack_options.allow_reduce_scatter,
                  "FULL MLPs skip their all-reduce; the after-MLP step reduce-scatters (MAX_LEN)");
  stack->add_option("--targets", stack_options.workers.targets,
                    "use running Gloo workers instead: host:port,... (--tp of them); the "
                    "command holds their lease while it runs (--owner)");
  AddLeaseFlags(stack, &stack_options.workers.lease);
  stack->add_option("--worker-binary", stack_options.workers.worker_binary,
                    "moe-ep-worker executable (default: next to moe-ep)");
  stack
      ->add_option("--log-dir", stack_options.workers.log_dir,
                   "write each local worker's output to DIR/worker-<i>.log instead of stderr")
      ->check(CLI::ExistingDirectory);
  stack
      ->add_option("--rpc-timeout", stack_rpc_timeout_s,
                   "deadline of each fanned-out call, seconds")
      ->capture_default_str()
      ->check(Positive());
  bool stack_json = false;
  stack->add_flag("--json", stack_json, "progress on stderr, the summary as JSON on stdout");
  stack->callback([&] {
    stack_options.a2a_enabled = !stack_no_a2a;
    stack_options.rpc_timeout = absl::Seconds(stack_rpc_timeout_s);
    action = [&]() { return RunStackAction(stack_options, stack_json); };
  });

  // bench
  BenchCommandOptions bench_options;
  auto* bench = app.add_subcommand("bench", "time dispatch and combine on the workers");
  AddWorkerFlags(bench, &bench_options.workers, /*allow_targets=*/true);
  bench->add_option("--tokens", bench_options.tokens_per_rank, "tokens per rank")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--hidden", bench_options.hidden, "hidden size H")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--top-k", bench_options.top_k, "experts per token K")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--num-experts", bench_options.num_experts, "routed experts E")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--routing", bench_options.routing, "uniform | skewed")
      ->check(CLI::IsMember({"uniform", "skewed"}))
      ->capture_default_str();
  bench->add_option("--iterations", bench_options.iterations, "timed iterations")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--warmup", bench_options.warmup, "untimed iterations first")
      ->capture_default_str()
      ->check(NonNegative());
  bench->add_option("--seed", bench_options.seed, "routing seed")->capture_default_str();
  bench->add_flag("--json", bench_options.json, "print the results as JSON");
  bench->callback([&] { action = [&] { return RunBenchCommand(bench_options, std::cout); }; });

  // A mistyped subcommand: name the nearest one (CLI11 would only say that
  // a subcommand is required).
  if (argc > 1 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
      names.push_back(sub->get_name());
    }
    if (std::find(names.begin(), names.end(), argv[1]) == names.end()) {
      std::cerr << "moe-ep: unknown subcommand '" << argv[1] << "'";
      if (auto nearest = NearestName(argv[1], names)) {
        std::cerr << "; did you mean " << *nearest << "?";
      }
      std::cerr << "\nRun with --help for the subcommands.\n";
      return moe_ep::core::kExitBadCommandLine;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version: exit 0
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the reason and "Run with --help for more information."
    return moe_ep::core::kExitBadCommandLine;
  }

  // SIGINT / SIGTERM (client/interrupt.h): `up`, `watch` and `coordinator`
  // wait for the signal themselves; the other commands stop any local
  // workers and exit at once.
  const absl::Status installed = InstallInterruptHandler([&](int signo) {
    if (long_running_up) return;
    LocalCluster::StopAll();
    std::cerr << "moe-ep: interrupted (signal " << signo << "), workers stopped\n";
    std::_Exit(130);
  });
  if (!installed.ok()) {
    std::cerr << "moe-ep: " << installed << "\n";
    return 1;
  }
  const absl::Status result = action();
  if (InterruptSignal() != 0 && !long_running_up) {
    // The signal thread is stopping the workers (the calls above failed
    // because of it); wait for it to finish rather than report those errors.
    LocalCluster::StopAll();
    return 130;
  }
  if (IsCommandLineError(result)) {  // a flag combination the command refuses
    std::cerr << "moe-ep: error: " << result.message()
              << "\nRun with --help for more information.\n";
    return moe_ep::core::kExitBadCommandLine;
  }
  if (!result.ok()) {
    std::cerr << "moe-ep: error: " << result << "\n";
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return RunCli(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "moe-ep: error: unexpected exception: " << e.what()
              << " (a bug: please report it with the command line)\n";
  } catch (...) {
    std::cerr << "moe-ep: error: unexpected exception that is not a std::exception (a bug: "
                 "please report it with the command line)\n";
  }
  return 1;
}
