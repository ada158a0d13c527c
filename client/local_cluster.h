#pragma once

// The embedded local cluster (DESIGN §8): N `moe-ep-worker` processes on
// loopback ports started by this process, the default way to run the main job
// on one machine.
//
// Each worker is started as
//   moe-ep-worker --listen=127.0.0.1:0 --backend=<backend> [extra args]
// and announces its address with one stdout line
//   moe-ep-worker listening on HOST:PORT
// which Start() reads (with a timeout). Worker i becomes target i (rank i).
// Anything else a worker writes to stdout, and its stderr, goes to this
// process's stderr or to <log_dir>/worker-<i>.log.
//
// No worker outlives this process: each child sets PR_SET_PDEATHSIG(SIGKILL)
// before exec (the signal fires when the thread that started it exits, so call
// Start() from a thread that lives as long as the cluster, e.g. main), and
// Stop() / the destructor sends SIGTERM, waits up to `stop_timeout`, then
// SIGKILLs what is left. StopAll() stops every live cluster of this process
// (for a signal handler thread; see client/interrupt.h).
//
// A worker that exits while the cluster is not stopping (a crash, the OOM
// killer, a kill from outside, or Kill()) is reaped at once — it is never
// left defunct — and reported once, with its exit code or signal, through
// LocalClusterOptions::on_exit (default: one line on stderr), and kept for
// Exits() / WaitForExit(). Detection rides on the worker's stdout pipe: the
// kernel closes it when the process dies, so the report comes within
// milliseconds, not at the next RPC's timeout (issue 8).
//
// Thread safety: Stop(), Kill(), StopAll(), IsRunning(), Exits() and
// WaitForExit() may race with each other and with the reports; the rest is
// for the owning thread. Source: DESIGN §8, issue 2 ("no orphans"), issue 8.

#include <sys/types.h>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace moe_ep::client {

// A worker that exited while its cluster was not stopping.
struct WorkerExit {
  int index = -1;
  pid_t pid = -1;
  std::string target;       // "127.0.0.1:PORT" (empty before it announced one)
  int wait_status = 0;      // waitpid() status (WIFEXITED / WTERMSIG apply)
  bool sent_by_us = false;  // the signal came from LocalCluster::Kill()
  // "worker 2 (pid 4242, 127.0.0.1:40001) was killed by signal 9 (Killed)" or
  // "... exited with exit code 1"; "(sent by moe-ep)" when sent_by_us.
  std::string description;
};

// "exit code N", "signal N (NAME)", or "wait status N".
std::string DescribeWaitStatus(int wait_status);

struct LocalClusterOptions {
  int num_workers = 4;
  std::string backend = "gloo";  // passed as --backend
  // Worker executable. Empty: DefaultWorkerBinary().
  std::string worker_binary;
  // Empty: worker output goes to this process's stderr. Otherwise each worker
  // writes <log_dir>/worker-<i>.log (the directory must exist).
  std::string log_dir;
  absl::Duration start_timeout = absl::Seconds(30);  // until every address line is read
  absl::Duration stop_timeout = absl::Seconds(10);   // SIGTERM grace before SIGKILL
  std::vector<std::string> extra_args;               // appended to every worker's argv
  // Empty, or one list per worker: per_worker_args[i] is appended to worker
  // i's argv after extra_args (e.g. "--device=i", see UseOneWorkerPerGpu).
  std::vector<std::vector<std::string>> per_worker_args;
  // Called once per worker that exits while the cluster is not stopping, on
  // an internal thread, with no lock of the cluster held. Empty: writes
  // "moe-ep: <description>" to stderr.
  std::function<void(const WorkerExit&)> on_exit;
};

// Number of NVIDIA GPUs this machine gives a worker, found without linking
// CUDA into the client: the device nodes <dev_dir>/nvidia<N> (N a number;
// nvidiactl, nvidia-uvm, ... are not GPUs), narrowed by CUDA_VISIBLE_DEVICES
// when it is set (`cuda_visible_devices` non-null): its comma-separated
// entries up to the first that is neither an index below the node count nor
// a "GPU-"/"MIG-" UUID (CUDA stops there too; "" and "-1" hide every GPU),
// at most the node count. 0 when dev_dir cannot be read. Never fails.
// Example: /dev/nvidia0, /dev/nvidia1, /dev/nvidiactl and
// CUDA_VISIBLE_DEVICES="1" -> 1.
int CountLocalGpus(const std::string& dev_dir, const char* cuda_visible_devices);
// CountLocalGpus("/dev", getenv("CUDA_VISIBLE_DEVICES")).
int CountLocalGpus();

// Makes `options` start one NCCL worker per GPU: num_workers = num_gpus,
// backend "nccl", worker i gets "--device=i" (the i-th visible GPU).
// REQUIRES: num_gpus >= 1.
void UseOneWorkerPerGpu(int num_gpus, LocalClusterOptions* options);

// Returns "<directory of /proc/self/exe>/moe-ep-worker".
// Errors: kInternal when /proc/self/exe cannot be read.
absl::StatusOr<std::string> DefaultWorkerBinary();

// Parses "moe-ep-worker listening on HOST:PORT" (trailing whitespace allowed)
// and returns "HOST:PORT". Errors: kInvalidArgument for any other line.
absl::StatusOr<std::string> ParseListeningLine(const std::string& line);

class LocalCluster {
 public:
  // Starts the workers and waits for their addresses.
  // Errors (every started worker is stopped again):
  //   kInvalidArgument   num_workers < 1, empty backend, per_worker_args
  //                      neither empty nor num_workers long.
  //   kNotFound          the worker binary is missing or not executable (names
  //                      the path and --worker-binary).
  //   kNotFound          log_dir cannot be written.
  //   kDeadlineExceeded  a worker printed no address within start_timeout.
  //   kUnavailable       a worker exited before printing its address (names
  //                      its index, pid and exit status).
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(const LocalClusterOptions& options);

  // Stops the workers (see the file comment).
  ~LocalCluster();
  LocalCluster(const LocalCluster&) = delete;
  LocalCluster& operator=(const LocalCluster&) = delete;

  // "127.0.0.1:PORT" of worker i, in rank order.
  const std::vector<std::string>& targets() const { return targets_; }
  int num_workers() const { return static_cast<int>(workers_.size()); }
  // Process id of worker i (valid until Stop()).
  pid_t pid(int index) const;
  const std::string& worker_binary() const { return binary_; }

  // SIGTERM to every live worker, wait up to stop_timeout, then SIGKILL.
  // Idempotent. Returns OK when every worker has been reaped.
  absl::Status Stop();
  // Sends `signo` to worker `index` (e.g. to kill one mid-run) and, for
  // SIGKILL, reaps it. Errors: kInvalidArgument for a bad index; kNotFound
  // when the worker has already exited.
  absl::Status Kill(int index, int signo);
  // Starts worker `index` again after it exited (a kill from a test, a
  // crash) on the address it had (--listen=<its target>), with the same
  // arguments, and waits for its address line; its log under log_dir is
  // appended to. Call it from the thread that called Start() (see
  // PR_SET_PDEATHSIG above). Exits() keeps the earlier exits.
  // Errors: kInvalidArgument for a bad index; kFailedPrecondition while the
  // worker still runs; Start()'s errors for the new process.
  absl::Status Restart(int index);
  // True while worker `index` runs (not yet reaped).
  bool IsRunning(int index);
  // The waitpid() status of worker `index` once it has exited and been
  // reaped (WIFEXITED / WEXITSTATUS apply). Errors: kInvalidArgument for a
  // bad index; kFailedPrecondition while the worker still runs.
  absl::StatusOr<int> WaitStatus(int index);

  // The workers that have exited while the cluster was not stopping, in the
  // order they were reported.
  std::vector<WorkerExit> Exits();
  // Blocks until a worker has exited (returns the first report) or `timeout`
  // passes. Errors: kDeadlineExceeded on timeout.
  absl::StatusOr<WorkerExit> WaitForExit(absl::Duration timeout);

  // Stops every live LocalCluster of this process.
  static void StopAll();

 private:
  struct Worker {
    pid_t pid = -1;
    int stdout_fd = -1;  // read end of the worker's stdout pipe
    int log_fd = -1;     // where its output goes (owned when a log file)
    bool owns_log_fd = false;
    bool reaped = false;
    int wait_status = 0;
    bool reported = false;  // its exit went to on_exit
    int signal_sent = 0;    // by Kill()
    std::thread drain;      // copies stdout after the address line to log_fd
  };

  explicit LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {}
  // Starts worker `index` listening on `listen`; appends to its log file when
  // `append_log`.
  absl::Status Spawn(int index, const std::string& listen, bool append_log);
  // Reads the address lines of `indices` and starts their output threads.
  absl::Status ReadAddresses(const std::vector<int>& indices);
  absl::Status StopLocked();
  void ReapLocked(Worker& w, bool block);
  // The output thread of worker `index`: copies its stdout to its log, then,
  // at EOF, reaps and reports it unless the cluster is stopping.
  void DrainAndWatch(int index, int stdout_fd, int log_fd);
  void Report(WorkerExit exit);

  LocalClusterOptions options_;
  std::string binary_;
  std::vector<std::string> targets_;
  std::mutex mu_;  // guards workers_' process state
  std::vector<Worker> workers_;
  // Set before Stop() signals: exits from then on are expected, not reported.
  std::atomic<bool> stopping_{false};
  std::mutex exits_mu_;
  std::condition_variable exits_cv_;
  std::vector<WorkerExit> exits_;  // guarded by exits_mu_
};

}  // namespace moe_ep::client
