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

// `moe-ep run`: the flags beyond RunJobOptions.
struct RunCommandFlags {
  RunJobOptions job;
  double rpc_timeout_s = kDefaultRpcTimeoutSeconds;
  std::string dispatch_dtype = "bf16";
  // --tp: the decoder-stack job of `moe-ep stack` (issue 4).
  int tp = 0, attn_dp = 1, moe_dense_tp = 0;
  bool json = false;
};

// What the subcommands' flags fill, and what the one given runs. It lives
// in RunCli's frame: the flags and the callbacks point into it.
struct Cli {
  std::function<absl::Status()> action;
  // `up` with local workers, `watch` and `coordinator` wait for SIGINT /
  // SIGTERM themselves; the other commands exit at once on it.
  bool long_running_up = false;
  WorkerSelection up_workers;
  GroupSetupOptions up_setup;
  PlanCommandOptions plan;
  bool plan_no_a2a = false;
  WorkspaceCommandOptions workspace;
  StatusCommandOptions status;
  HealthCommandOptions health;
  int64_t health_timeout_ms = 3000;
  WatchCommandOptions watch;
  bool watch_no_clear = false;
  CoordinatorCommandOptions coordinator;
  CoordinatorClientOptions coordinator_client;
  RunCommandFlags run;
  StackJobOptions stack;
  double stack_rpc_timeout_s = kDefaultRpcTimeoutSeconds;
  bool stack_no_a2a = false;
  bool stack_json = false;
  BenchCommandOptions bench;
};

void AddUpCommand(CLI::App& app, Cli& cli) {
  auto* up = app.add_subcommand(
      "up",
      "start N local workers, form the group, wait for Ctrl-C; or, with --targets, form and "
      "configure a group of running workers (embedded ones too) and exit");
  AddWorkerFlags(up, &cli.up_workers, /*allow_targets=*/true);
  up->add_option("--hidden", cli.up_setup.hidden, "configure: hidden size H (0 = only form)")
      ->capture_default_str();
  up->add_option("--num-experts", cli.up_setup.num_experts, "configure: routed experts E");
  up->add_option("--top-k", cli.up_setup.top_k, "configure: experts per token K");
  up->add_option("--capacity", cli.up_setup.capacity_tokens, "configure: N, tokens per rank");
  up->add_option("--cuda-graph-buckets", cli.up_setup.cuda_graph_buckets,
                 "configure: ascending token buckets for R")
      ->delimiter(',');
  up->add_option("--layers", cli.up_setup.layers, "configure: sparse layers")
      ->capture_default_str();
  up->add_option("--load-experts", cli.up_setup.experts, "configure: none | identity | swiglu")
      ->check(CLI::IsMember({"none", "identity", "swiglu"}))
      ->capture_default_str();
  up->add_option("--intermediate", cli.up_setup.intermediate, "configure: I of swiglu experts");
  up->add_option("--seed", cli.up_setup.seed, "configure: seed of swiglu experts")
      ->capture_default_str();
  up->add_option("--group-timeout", cli.up_setup.group_timeout_s,
                 "seconds a collective waits for every rank before the group is broken")
      ->capture_default_str();
  up->add_option("--invalid-expert-id", cli.up_setup.invalid_expert_id,
                 "configure: the padding id of topk ids, -1 | num_experts (other ids outside "
                 "[0, E) are errors)")
      ->check(CLI::IsMember({"-1", "num_experts"}))
      ->capture_default_str();
  up->add_option("--dispatch-dtype", cli.up_setup.dispatch_dtype,
                 "configure: what dispatch moves, bf16 | fp8_e4m3 (H a multiple of 128)")
      ->check(CLI::IsMember({"bf16", "fp8_e4m3"}))
      ->capture_default_str();
  up->callback([&cli] {
    cli.long_running_up = cli.up_workers.targets.empty();
    cli.action = [&cli] { return RunUpCommand(cli.up_workers, cli.up_setup, std::cout); };
  });
}

void AddPlanCommand(CLI::App& app, Cli& cli) {
  auto* plan = app.add_subcommand("plan", "print the per-layer scatter-mode plan (offline)");
  plan->add_option("--model", cli.plan.model, "config.json path or preset name")
      ->capture_default_str();
  plan->add_option("--tp", cli.plan.tp_size, "tensor-parallel size (= world)")
      ->required()
      ->check(Positive());
  plan->add_option("--attn-dp", cli.plan.attn_dp_size, "attention data-parallel size")
      ->capture_default_str()
      ->check(Positive());
  plan->add_option("--moe-dense-tp", cli.plan.moe_dense_tp_size,
                   "dense MLP TP size: 1, attn_tp or tp (default unset = tp)")
      ->check(Positive());
  plan->add_flag("--no-a2a", cli.plan_no_a2a, "no all-to-all backend: sparse MLPs run FULL");
  plan->add_flag("--json", cli.plan.json, "print the plan as JSON");
  plan->callback([&cli] {
    cli.plan.a2a_enabled = !cli.plan_no_a2a;
    cli.action = [&cli] { return RunPlanCommand(cli.plan, std::cout); };
  });
}

void AddWorkspaceCommand(CLI::App& app, Cli& cli) {
  auto* ws = app.add_subcommand("workspace", "print payload and workspace sizes (offline)");
  ws->add_option("--model", cli.workspace.model, "config.json path or preset name")
      ->capture_default_str();
  ws->add_option("--ep", cli.workspace.ep_size, "EP size E")->required()->check(Positive());
  ws->add_option("--max-tokens", cli.workspace.max_tokens, "capacity N, tokens per rank")
      ->required()
      ->check(Positive());
  ws->add_option("--dtype", cli.workspace.dtype,
                 "dispatch dtype (sizes only: the data planes move bf16 and fp8_e4m3)")
      ->check(CLI::IsMember({"bf16", "nvfp4", "mxfp8", "fp8_e4m3"}))
      ->capture_default_str();
  ws->add_flag("--json", cli.workspace.json, "print the sizes as JSON");
  ws->callback(
      [&cli] { cli.action = [&cli] { return RunWorkspaceCommand(cli.workspace, std::cout); }; });
}

void AddStatusCommand(CLI::App& app, Cli& cli) {
  auto* status = app.add_subcommand("status", "print a table of running workers");
  status->add_option("--targets", cli.status.targets, "host:port,...")->required();
  AddSecurityFlags(status, &cli.status.security);
  status->add_flag("--json", cli.status.json, "print the workers as JSON");
  status->callback(
      [&cli] { cli.action = [&cli] { return RunStatusCommand(cli.status, std::cout); }; });
}

void AddHealthCommand(CLI::App& app, Cli& cli) {
  auto* health = app.add_subcommand(
      "health",
      "one grpc.health.v1 Check of a plaintext health port (exec probes); exit 0 only if "
      "SERVING");
  health->add_option("--target", cli.health.target, "host:port of the --health-listen port")
      ->required();
  health
      ->add_option("--service", cli.health.service,
                   "\"\" = liveness (the process serves), moe_ep.v1.Worker = readiness "
                   "(joined and allocated)")
      ->capture_default_str();
  health->add_option("--timeout-ms", cli.health_timeout_ms, "deadline of the call, ms")
      ->capture_default_str()
      ->check(Positive());
  health->callback([&cli] {
    cli.action = [&cli] {
      cli.health.timeout = absl::Milliseconds(cli.health_timeout_ms);
      return RunHealthCommand(cli.health, std::cout);
    };
  });
}

void AddWatchCommand(CLI::App& app, Cli& cli) {
  auto* watch = app.add_subcommand("watch", "refresh the status table until Ctrl-C");
  watch->add_option("--targets", cli.watch.targets, "host:port,...")->required();
  watch->add_option("--interval-ms", cli.watch.interval_ms, "refresh interval, ms")
      ->capture_default_str()
      ->check(Positive());
  watch->add_option("--count", cli.watch.count, "stop after N refreshes (0 = until Ctrl-C)")
      ->capture_default_str()
      ->check(NonNegative());
  watch->add_flag("--no-clear", cli.watch_no_clear,
                  "append tables instead of redrawing the screen");
  AddSecurityFlags(watch, &cli.watch.security);
  watch->callback([&cli] {
    cli.long_running_up = true;  // stops by itself on Ctrl-C (exit 0)
    // No ANSI codes to a pipe or a file (issue 31 item 1).
    cli.watch.clear_screen = !cli.watch_no_clear && isatty(STDOUT_FILENO) == 1;
    cli.action = [&cli] {
      return RunWatchCommand(cli.watch, std::cout, [] { return InterruptSignal() != 0; });
    };
  });
}

void AddCoordinatorCommand(CLI::App& app, Cli& cli) {
  auto* coordinator = app.add_subcommand(
      "coordinator",
      "long-running service: keep a worker group formed, configured and allocated as a desired "
      "state says, re-forming it after any worker restart or failure (DESIGN §16)");
  AddCoordinatorFlags(coordinator, &cli.coordinator);
  coordinator->footer(DesiredStateHelp());
  // `moe-ep coordinator status|apply|drain`: a client of a running one (issue 31 item 1).
  AddCoordinatorClientCommands(coordinator, &cli.coordinator_client, &cli.action, &std::cout);
  coordinator->callback([&cli, coordinator] {
    if (!coordinator->get_subcommands().empty()) return;  // a client subcommand set `action`
    cli.long_running_up = true;  // stops by itself on SIGINT / SIGTERM (exit 0)
    cli.action = [&cli] {
      return RunCoordinatorCommand(cli.coordinator, std::cout,
                                   [] { return InterruptSignal() != 0; });
    };
  });
}

// `run`: the workers, the model, the inputs and the experts.
void AddRunJobFlags(CLI::App* run, RunCommandFlags& r) {
  AddWorkerFlags(run, &r.job.workers, /*allow_targets=*/true);
  run->add_option("--model", r.job.model, "config.json path or preset name")->capture_default_str();
  run->add_option("--layers", r.job.num_layers, "run the first L MoE layers")
      ->capture_default_str()
      ->check(Positive());
  run->add_option("--tokens", r.job.tokens_per_rank,
                  "mean tokens per rank and step (counts are uneven, one rank gets 0; "
                  "trace: routing prescribes them)")
      ->capture_default_str()
      ->check(Positive());
  run->add_flag("--even-tokens", r.job.even_tokens,
                "every rank gets exactly --tokens tokens (no zero-token rank)");
  run->add_option("--steps", r.job.steps, "forward steps")
      ->capture_default_str()
      ->check(Positive());
  run->add_option("--routing", r.job.routing,
                  "uniform | skewed[:S] | trace:FILE.jsonl | load:FILE.json")
      ->capture_default_str();
  run->add_option("--seed", r.job.seed, "seed of hidden states, routing and experts")
      ->capture_default_str();
  run->add_option("--experts", r.job.experts,
                  "swiglu (bf16) | identity | checkpoint (the config's quantization: fp8 "
                  "or mxfp4 experts, on every plane)")
      ->check(CLI::IsMember({"swiglu", "identity", "checkpoint"}))
      ->capture_default_str();
  run->add_option("--dispatch-dtype", r.dispatch_dtype,
                  "dispatch payload: bf16 | fp8_e4m3 (e4m3, one fp32 scale per 128 values; "
                  "the reference applies the same rounding)")
      ->check(CLI::IsMember({"bf16", "fp8_e4m3"}))
      ->capture_default_str();
}

// `run`: the workspace, redundant slots and rank masks, the check, the RPCs.
void AddRunCheckFlags(CLI::App* run, RunCommandFlags& r) {
  run->add_option("--capacity", r.job.capacity_tokens,
                  "workspace capacity N, tokens per rank (default: the run's largest count)")
      ->check(NonNegative());
  run->add_option("--redundant-slots", r.job.redundant_slots_per_rank,
                  "expert slots a worker may hold beyond ceil(experts / workers) (DESIGN §15)")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option("--rebalance-after", r.job.rebalance_after_steps,
                  "rebalance every run layer with EPLB from the workers' load statistics after "
                  "this step (0 = never; needs --redundant-slots); prints the load table")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option(
         "--kill-rank", r.job.kill_rank,
         "kill this local worker with SIGKILL just before --kill-at-step; the survivors "
         "mask it and keep serving (DESIGN §15; any backend, >= 2 local workers; -1 = none)")
      ->capture_default_str();
  run->add_option("--kill-at-step", r.job.kill_at_step,
                  "the step (1-based) before which --kill-rank is killed")
      ->check(NonNegative());
  run->add_option("--restart-at-step", r.job.restart_at_step,
                  "restart the killed worker before this step (1-based, after --kill-at-step) and "
                  "re-admit it (Rejoin); 0 = it stays masked")
      ->check(NonNegative());
  run->add_option("--rel-tol", r.job.tolerance.rel,
                  "pass when |out - ref| <= rel * max|ref| + atol")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option("--abs-tol", r.job.tolerance.atol, "atol of the check above")
      ->capture_default_str()
      ->check(NonNegative());
  run->add_option("--rpc-timeout", r.rpc_timeout_s, "deadline of each fanned-out call, seconds")
      ->capture_default_str()
      ->check(Positive());
}

// `run`: --tp (the decoder stack), --attach and --json.
void AddRunTpFlags(CLI::App* run, RunCommandFlags& r) {
  // Issue 4: `run --layers K --tp T --attn-dp D` runs the whole decoder stack
  // (the same job as `moe-ep stack`) instead of the MoE layers alone.
  auto* tp_option =
      run->add_option("--tp", r.tp,
                      "run the model's first --layers decoder layers (attention stand-in, DESIGN "
                      "§3 steps, dense and MoE MLPs) on T Gloo workers, as `moe-ep stack`")
          ->check(Positive());
  run->add_option("--attn-dp", r.attn_dp, "with --tp: attention data-parallel size")
      ->needs(tp_option)
      ->capture_default_str()
      ->check(Positive());
  run->add_option("--moe-dense-tp", r.moe_dense_tp,
                  "with --tp: dense MLP TP size (1, or the attention-TP size); unset = tp")
      ->needs(tp_option)
      ->check(NonNegative());
  run->add_flag("--attach", r.job.attach,
                "with --targets: drive steps on the group the workers already form (e.g. "
                "`moe-ep coordinator`'s; steps are not leased) without forming, configuring, "
                "allocating or loading; every step is still verified")
      ->excludes(tp_option);
  run->add_flag("--json", r.json, "progress on stderr, the summary as JSON on stdout");
}

// The action of `run` as given: the MoE-layer job, or with --tp the stack
// job (every run flag applies to it or is refused).
void SetRunAction(CLI::App* run, Cli& cli) {
  RunCommandFlags& r = cli.run;
  r.job.rpc_timeout = absl::Seconds(r.rpc_timeout_s);
  r.job.dispatch_dtype = *moe_ep::core::ParseDispatchDType(r.dispatch_dtype);
  if (r.tp > 0 && r.job.dispatch_dtype != moe_ep::core::DispatchDType::kBF16) {
    cli.action = [] {
      return absl::InvalidArgumentError(
          "--dispatch-dtype: fp8_e4m3 applies to the MoE-layer run, not to --tp (the decoder "
          "stack dispatches bf16)");
    };
    return;
  }
  if (r.tp > 0) {
    // Every run flag applies to the stack or is refused (issue 9 item 4).
    auto given = [run](const char* flag) { return run->get_option(flag)->count() > 0; };
    RunFlagsGiven flags;
    flags.experts = given("--experts");
    flags.routing = given("--routing");
    flags.rel_tol = given("--rel-tol");
    flags.abs_tol = given("--abs-tol");
    flags.even_tokens = given("--even-tokens");
    flags.workers = given("--workers");
    flags.backend = given("--backend");
    absl::StatusOr<StackJobOptions> stack_job =
        StackJobFromRun(r.job, flags, r.tp, r.attn_dp, r.moe_dense_tp);
    cli.action = [stack_job, &cli]() {
      return stack_job.ok() ? RunStackAction(*stack_job, cli.run.json) : stack_job.status();
    };
    return;
  }
  cli.action = [&cli]() -> absl::Status {
    const RunCommandFlags& r = cli.run;
    auto result = RunJob(r.job, r.json ? std::cerr : std::cout);
    if (!result.ok()) return result.status();
    if (r.json) {
      std::cout << RunSummaryJson(*result).dump(2) << "\n";
    } else {
      std::cout << "\n" << RenderRunSummary(*result);
    }
    if (!result->AllPass()) {
      return absl::DataLossError("at least one layer disagrees with the reference (see above)");
    }
    return absl::OkStatus();
  };
}

void AddRunCommand(CLI::App& app, Cli& cli) {
  auto* run = app.add_subcommand(
      "run", "the main job: run a model's MoE layers across the workers and verify them");
  AddRunJobFlags(run, cli.run);
  AddRunCheckFlags(run, cli.run);
  AddRunTpFlags(run, cli.run);
  run->callback([&cli, run] { SetRunAction(run, cli); });
}

// `stack`: the layout, the model's sizes and the inputs.
void AddStackShapeFlags(CLI::App* stack, Cli& cli) {
  stack
      ->add_option("--model", cli.stack.model,
                   "config.json path or preset: sparse pattern, experts, top-k, RMS eps")
      ->capture_default_str();
  stack->add_option("--tp", cli.stack.tp_size, "tensor-parallel size (= workers)")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--attn-dp", cli.stack.attn_dp_size, "attention data-parallel size")
      ->capture_default_str()
      ->check(Positive());
  stack
      ->add_option("--moe-dense-tp", cli.stack.moe_dense_tp_size,
                   "dense MLP TP size: 1, attn_tp or tp (default unset = tp)")
      ->check(Positive());
  stack->add_flag("--no-a2a", cli.stack_no_a2a, "no all-to-all backend: sparse MLPs run FULL");
  stack->add_option("--layers", cli.stack.num_layers, "run the model's first K layers")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--hidden", cli.stack.hidden, "hidden size H (0 = the model's)")
      ->capture_default_str()
      ->check(NonNegative());
  stack
      ->add_option("--moe-intermediate", cli.stack.moe_intermediate,
                   "expert intermediate size (0 = the model's)")
      ->capture_default_str()
      ->check(NonNegative());
  stack
      ->add_option("--dense-intermediate", cli.stack.dense_intermediate,
                   "dense MLP intermediate size, a multiple of --tp (0 = the model's)")
      ->capture_default_str()
      ->check(NonNegative());
  stack
      ->add_option("--tokens", cli.stack.tokens_per_group,
                   "mean tokens per DP group and step (uneven; one group gets 0 when attn_dp > 1)")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--steps", cli.stack.steps, "forward steps")
      ->capture_default_str()
      ->check(Positive());
  stack->add_option("--seed", cli.stack.seed, "seed of tokens, weights and routing")
      ->capture_default_str();
}

// `stack`: capacity, reduce-scatter, the workers, the RPCs and --json.
void AddStackWorkerFlags(CLI::App* stack, Cli& cli) {
  stack
      ->add_option(
          "--capacity", cli.stack.capacity_tokens,
          "all-to-all capacity N, tokens per rank (default: the largest DP group + attn_tp)")
      ->check(NonNegative());
  stack->add_flag("--allow-reduce-scatter", cli.stack.allow_reduce_scatter,
                  "FULL MLPs skip their all-reduce; the after-MLP step reduce-scatters (MAX_LEN)");
  stack->add_option("--targets", cli.stack.workers.targets,
                    "use running Gloo workers instead: host:port,... (--tp of them); the "
                    "command holds their lease while it runs (--owner)");
  AddLeaseFlags(stack, &cli.stack.workers.lease);
  stack->add_option("--worker-binary", cli.stack.workers.worker_binary,
                    "moe-ep-worker executable (default: next to moe-ep)");
  stack
      ->add_option("--log-dir", cli.stack.workers.log_dir,
                   "write each local worker's output to DIR/worker-<i>.log instead of stderr")
      ->check(CLI::ExistingDirectory);
  stack
      ->add_option("--rpc-timeout", cli.stack_rpc_timeout_s,
                   "deadline of each fanned-out call, seconds")
      ->capture_default_str()
      ->check(Positive());
  stack->add_flag("--json", cli.stack_json, "progress on stderr, the summary as JSON on stdout");
}

void AddStackCommand(CLI::App& app, Cli& cli) {
  auto* stack = app.add_subcommand(
      "stack",
      "run K decoder layers under DP attention + EP (ForwardLayers, Gloo) and verify every DP "
      "group against the single-process reference");
  AddStackShapeFlags(stack, cli);
  AddStackWorkerFlags(stack, cli);
  stack->callback([&cli] {
    cli.stack.a2a_enabled = !cli.stack_no_a2a;
    cli.stack.rpc_timeout = absl::Seconds(cli.stack_rpc_timeout_s);
    cli.action = [&cli]() { return RunStackAction(cli.stack, cli.stack_json); };
  });
}

void AddBenchCommand(CLI::App& app, Cli& cli) {
  auto* bench = app.add_subcommand("bench", "time dispatch and combine on the workers");
  AddWorkerFlags(bench, &cli.bench.workers, /*allow_targets=*/true);
  bench->add_option("--tokens", cli.bench.tokens_per_rank, "tokens per rank")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--hidden", cli.bench.hidden, "hidden size H")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--top-k", cli.bench.top_k, "experts per token K")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--num-experts", cli.bench.num_experts, "routed experts E")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--routing", cli.bench.routing, "uniform | skewed")
      ->check(CLI::IsMember({"uniform", "skewed"}))
      ->capture_default_str();
  bench->add_option("--iterations", cli.bench.iterations, "timed iterations")
      ->capture_default_str()
      ->check(Positive());
  bench->add_option("--warmup", cli.bench.warmup, "untimed iterations first")
      ->capture_default_str()
      ->check(NonNegative());
  bench->add_option("--seed", cli.bench.seed, "routing seed")->capture_default_str();
  bench->add_flag("--json", cli.bench.json, "print the results as JSON");
  bench->callback(
      [&cli] { cli.action = [&cli] { return RunBenchCommand(cli.bench, std::cout); }; });
}

// True, after printing the nearest name, when argv[1] is a mistyped
// subcommand (CLI11 would only say that a subcommand is required).
bool UnknownSubcommand(CLI::App& app, int argc, char** argv) {
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
      return true;
    }
  }
  return false;
}

// Runs the parsed command: exit 0, 1 (it failed), 2 (a flag combination it
// refuses) or 130 (interrupted).
int RunAction(Cli& cli) {
  // SIGINT / SIGTERM (client/interrupt.h): `up`, `watch` and `coordinator`
  // wait for the signal themselves; the other commands stop any local
  // workers and exit at once.
  const absl::Status installed = InstallInterruptHandler([&cli](int signo) {
    if (cli.long_running_up) return;
    LocalCluster::StopAll();
    std::cerr << "moe-ep: interrupted (signal " << signo << "), workers stopped\n";
    std::_Exit(130);
  });
  if (!installed.ok()) {
    std::cerr << "moe-ep: " << installed << "\n";
    return 1;
  }
  const absl::Status result = cli.action();
  if (InterruptSignal() != 0 && !cli.long_running_up) {
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
  Cli cli;
  AddUpCommand(app, cli);
  AddPlanCommand(app, cli);
  AddWorkspaceCommand(app, cli);
  AddStatusCommand(app, cli);
  AddHealthCommand(app, cli);
  AddWatchCommand(app, cli);
  AddCoordinatorCommand(app, cli);
  AddRunCommand(app, cli);
  AddStackCommand(app, cli);
  AddBenchCommand(app, cli);
  if (UnknownSubcommand(app, argc, argv)) return moe_ep::core::kExitBadCommandLine;
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version: exit 0
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);  // prints the reason and "Run with --help for more information."
    return moe_ep::core::kExitBadCommandLine;
  }

  return RunAction(cli);
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
