/* The C API header compiles as strict C11 (-std=c11 -pedantic -Werror, see
 * tests/embedded.cmake) and its calls behave as documented from a C
 * program linked against libmoe_ep.so (issue 16 item 1). Exit 0 = pass;
 * each failed check prints "FAIL ..." and exits 1.
 * Usage: moe_ep_c11_smoke EXPECTED_VERSION */
#include <stdio.h>
#include <string.h>

#include "server/moe_ep.h"

static int failures = 0;

static void expect(int ok, const char* what) {
  if (!ok) {
    printf("FAIL %s (last error: %s)\n", what, moe_ep_last_error());
    ++failures;
  }
}

int main(int argc, char** argv) {
  if (argc != 2) {
    printf("usage: %s EXPECTED_VERSION\n", argv[0]);
    return 2;
  }
  expect(strcmp(moe_ep_version(), argv[1]) == 0, "moe_ep_version() is the project version");
  expect(moe_ep_abi_version() == MOE_EP_ABI_VERSION, "moe_ep_abi_version() == header's");
  expect(moe_ep_noop() == MOE_EP_OK && moe_ep_last_error()[0] == '\0', "moe_ep_noop");

  /* A bad flag: INVALID_ARGUMENT naming it, no worker. */
  moe_ep_worker* worker = (moe_ep_worker*)&failures; /* must be reset to NULL */
  const char* bad[] = {"--no-such-flag"};
  expect(moe_ep_worker_start(1, bad, &worker) == MOE_EP_INVALID_ARGUMENT, "bad flag refused");
  expect(strstr(moe_ep_last_error(), "--no-such-flag") != NULL, "message names the flag");
  expect(worker == NULL, "*out is NULL on error");

  /* A real worker on loopback: address, not ready, no group yet. */
  const char* args[] = {"--listen=127.0.0.1:0", "--backend=gloo", "--log-level=warn"};
  expect(moe_ep_worker_start(3, args, &worker) == MOE_EP_OK, "worker starts");
  if (worker == NULL) return 1;
  const char* address = NULL;
  expect(moe_ep_worker_address(worker, &address) == MOE_EP_OK && address != NULL &&
             strncmp(address, "127.0.0.1:", 10) == 0 && strlen(address) > 10,
         "address is 127.0.0.1:PORT");
  expect(moe_ep_worker_wait_ready(worker, 50) == MOE_EP_DEADLINE_EXCEEDED,
         "not ready before the orchestrator configures it");
  expect(strstr(moe_ep_last_error(), "WORKER_STATE_STARTED") != NULL, "message gives the state");
  expect(moe_ep_worker_wait_ready_for_steps(worker, MOE_EP_STEPS_WORKER_EXPERTS, 50) ==
             MOE_EP_DEADLINE_EXCEEDED,
         "not ready for steps before the orchestrator configures it");
  expect(strstr(moe_ep_last_error(), "not ready for steps") != NULL &&
             strstr(moe_ep_last_error(), "STARTED") != NULL,
         "the readiness message gives the state");
  expect(moe_ep_worker_wait_ready_for_steps(worker, 2, 50) == MOE_EP_INVALID_ARGUMENT,
         "an unknown experts value is refused");
  int64_t r = -1;
  expect(moe_ep_sync_token_counts(worker, 4, NULL, &r) == MOE_EP_FAILED_PRECONDITION && r == -1,
         "sync before Join: FAILED_PRECONDITION, nothing written");
  expect(moe_ep_dispatch(worker, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0, NULL, NULL, NULL, 0) ==
             MOE_EP_FAILED_PRECONDITION,
         "dispatch before Join: FAILED_PRECONDITION");
  moe_ep_worker_info info;
  memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  expect(moe_ep_worker_info_get(worker, &info) == MOE_EP_FAILED_PRECONDITION,
         "info before AllocateWorkspace: FAILED_PRECONDITION");
  expect(moe_ep_combine(NULL, NULL, 0, NULL, NULL, 0) == MOE_EP_INVALID_ARGUMENT,
         "NULL worker: INVALID_ARGUMENT");
  expect(moe_ep_worker_stop(worker, 1000) == MOE_EP_OK, "worker stops");
  expect(moe_ep_worker_stop(NULL, 0) == MOE_EP_OK, "stop(NULL) is a no-op");
  if (failures == 0) printf("PASS c11 smoke: version %s\n", moe_ep_version());
  return failures == 0 ? 0 : 1;
}
