"""GPU tests of the embedded worker's Python layer (issue 16 item 4; DESIGN §14).

On the nccl backend, with torch CUDA tensors: torch experts between dispatch
and combine equal a dense torch reference; dispatch + experts + combine
captured in a torch CUDA graph and replayed with new inputs equal it too;
forward with the worker's identity experts; the argument checks; a graph
captured before the group re-forms is reported stale (RECAPTURE); and an
engine's steady state (dispatch(out=) / combine(out=), in place too) on both
GPU data planes. EP 1 on one GPU; the 2- and 4-GPU cases run one process per GPU and skip on fewer.

Needs torch with CUDA, libmoe_ep.so (MOE_EP_LIBRARY) and the `moe-ep` CLI
(MOE_EP_CLI) that forms the group with `up --targets` (no gRPC in Python).
Every test prints why it skips otherwise.

    MOE_EP_LIBRARY=... MOE_EP_CLI=... python3 -m unittest -v test_engine_gpu
"""

import os
import subprocess
import sys
import unittest
from typing import Any, List, Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

try:
    import torch
except ImportError:  # the CPU CI image has no torch
    torch = None

HIDDEN = 256
NUM_EXPERTS = 16
TOP_K = 4
CAPACITY = 64


def _skip_reason(gpus: int = 1) -> Optional[str]:
    if torch is None:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if torch.cuda.device_count() < gpus:
        return f"needs {gpus} GPUs, {torch.cuda.device_count()} visible"
    if not os.environ.get("MOE_EP_CLI"):
        return "MOE_EP_CLI (the moe-ep CLI that forms the group) is not set"
    return None


def form_group(targets: List[str]) -> None:
    """`moe-ep up --targets`: Join, ConfigureLayers, AllocateWorkspace and identity experts."""
    subprocess.run(
        [os.environ["MOE_EP_CLI"], "up", "--targets", ",".join(targets), "--backend", "nccl",
         "--hidden", str(HIDDEN), "--num-experts", str(NUM_EXPERTS), "--top-k", str(TOP_K),
         "--capacity", str(CAPACITY), "--load-experts", "identity"],
        check=True, timeout=180, stdout=subprocess.DEVNULL)


def expert_weights(device: Any) -> Any:
    g = torch.Generator(device="cpu").manual_seed(7)
    w = torch.randn(NUM_EXPERTS, HIDDEN, HIDDEN, generator=g) / HIDDEN ** 0.5
    return w.to(device=device, dtype=torch.bfloat16)


def run_experts(x: Any, ids: Any, weights: Any, w: Any, first: int, count: int) -> Any:
    """Per row: sum over the row's choices k on experts [first, first + count) of
    weights[k] * (x @ w[ids[k]]), in fp32, cast to bf16. x [..., H] bf16; no
    host sync (capturable): padding rows carry the invalid id and weight 0."""
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in range(first, first + count):
        coef = (weights * (ids == e)).sum(dim=-1, keepdim=True)
        y += coef * (xf @ w[e].float())
    return y.to(torch.bfloat16)


def random_inputs(tokens: int, seed: int, device: Any, invalid: int) -> Any:
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:TOP_K]
                       for _ in range(tokens)]).to(torch.int32) if tokens else \
        torch.zeros(0, TOP_K, dtype=torch.int32)
    weights = torch.rand(tokens, TOP_K, generator=g)
    if tokens > 2:
        ids[1, :] = invalid  # a token routed nowhere
        weights[1, :] = 0.0
        ids[2, 0] = invalid  # a choice that selects no expert
    return hidden.to(device), ids.to(device), weights.to(device)


def assert_close(test: unittest.TestCase, name: str, got: Any, want: Any) -> None:
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    scale = want.float().abs().max().item() if want.numel() else 0.0
    test.assertLessEqual(err, 2e-2 * scale + 1e-3, f"{name}: max |got - want| {err}, scale {scale}")


class SteadyStateCase:
    """An engine's steady state on one GPU, run on each GPU plane."""

    worker: Any
    info: Any
    w: Any

    def experts(self, out: Any) -> Any:
        return run_experts(out.hidden_states, out.topk_ids, out.topk_weights, self.w,
                           self.info.first_expert, self.info.num_local_experts)

    def test_steady_state_calls_write_into_out(self) -> None:
        # dispatch(out=) / combine(out=) with exact CUDA tensors: an engine's
        # steady state, checked in one pass (issue 30 item 3), exact as the
        # checked path; the tensors' device is the library's check.
        from moe_ep_client.engine import EngineError

        invalid = self.info.invalid_expert_id
        tokens = 24
        _, r = self.worker.sync_token_counts(tokens)
        self.worker.commit_geometry(600, r, tokens)
        hidden, ids, weights = random_inputs(tokens, 61, "cuda:0", invalid)
        out = self.worker.dispatch(hidden, ids, weights, recv_rows=r)
        y = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda:0")
        self.worker.combine(self.experts(out), out=y)

        def step(seed: int) -> None:
            h, i, w = random_inputs(tokens, seed, "cuda:0", invalid)
            self.assertIs(self.worker.dispatch(h, i, w, recv_rows=r, out=out), out)
            routed = (i != invalid).any(dim=1)
            n = int(routed.sum().item())
            self.assertEqual(out.num_recv_tokens_per_source.tolist(), [n], f"seed {seed}")
            self.assertTrue(torch.equal(out.hidden_states[0, :n], h[routed]), f"seed {seed}")
            self.assertTrue(torch.equal(out.topk_weights[0, :n], w[routed]), f"seed {seed}")
            self.assertIs(self.worker.combine(self.experts(out), out=y), y)
            assert_close(self, f"seed {seed}", y, run_experts(h, i, w, self.w, 0, NUM_EXPERTS))

        for seed in (62, 63, 64):
            step(seed)
        # A host tensor passes the one-pass checks; the library refuses it,
        # naming the argument and the device, and the step ends there.
        with self.assertRaisesRegex(EngineError, "hidden is not device memory of CUDA device 0"):
            self.worker.dispatch(hidden.cpu(), ids, weights, recv_rows=r, out=out)
        with self.assertRaisesRegex(ValueError, r"topk_weights: expected shape \[24, 4\]"):
            self.worker.dispatch(hidden, ids, weights[:4], recv_rows=r, out=out)
        step(65)
        # combine's out: a host tensor is the library's to refuse, a wrong
        # shape the checked path's.
        self.worker.dispatch(hidden, ids, weights, recv_rows=r, out=out)
        with self.assertRaisesRegex(EngineError, "output is not device memory of CUDA device 0"):
            self.worker.combine(self.experts(out), out=y.cpu())
        self.worker.dispatch(hidden, ids, weights, recv_rows=r, out=out)
        with self.assertRaisesRegex(ValueError, r"out: expected shape \[24, 256\]"):
            self.worker.combine(self.experts(out), out=y[:3])
        step(66)
        # Combine in place: out a view of the expert outputs' own rows (an
        # engine reusing the buffer); the planes read every row before
        # writing one.
        h, i, w = random_inputs(tokens, 67, "cuda:0", invalid)
        self.worker.dispatch(h, i, w, recv_rows=r, out=out)
        expert_out = self.experts(out)
        alias = expert_out[0, :tokens]
        self.assertIs(self.worker.combine(expert_out, out=alias), alias)
        assert_close(self, "in place", alias, run_experts(h, i, w, self.w, 0, NUM_EXPERTS))
        self.worker.check_step()


def start_one_gpu(cls: Any, plane: str, *flags: str) -> None:
    """EP 1 on cuda:0 on GPU data plane `plane`, formed, with torch experts."""
    from moe_ep_client.engine import Worker

    cls.worker = Worker(["--listen=127.0.0.1:0", "--backend=nccl", "--device=0",
                         "--log-level=warn", f"--gpu-data-plane={plane}", *flags])
    form_group([cls.worker.address])
    cls.worker.wait_ready(timeout_s=60)
    cls.info = cls.worker.info(refresh=True)
    cls.w = expert_weights("cuda:0")


@unittest.skipIf(_skip_reason() is not None, _skip_reason() or "")
class OneGpuTest(SteadyStateCase, unittest.TestCase):
    """EP 1 on cuda:0."""

    worker: Any = None

    @classmethod
    def setUpClass(cls) -> None:
        start_one_gpu(cls, "nccl")

    @classmethod
    def tearDownClass(cls) -> None:
        if cls.worker is not None:
            cls.worker.stop()


    def test_info_is_the_gpu_group(self) -> None:
        self.assertEqual(self.info.backend, "nccl")
        self.assertEqual(self.info.device, 0)
        self.assertEqual((self.info.world_size, self.info.num_local_experts), (1, NUM_EXPERTS))

    def test_torch_experts_equal_dense_reference(self) -> None:
        from moe_ep_client.engine import Dispatcher

        dispatcher = Dispatcher(self.worker, first_epoch=1)
        invalid = self.info.invalid_expert_id
        for step, tokens in enumerate([37, 0, 64, 5]):
            hidden, ids, weights = random_inputs(tokens, 100 + step, "cuda:0", invalid)
            out = dispatcher.dispatch(hidden, ids, weights)
            self.assertTrue(out.hidden_states.is_cuda and out.num_recv_tokens_per_source.is_cuda)
            # What arrived: the tokens with a valid choice, in token order (EP 1).
            routed = (ids != invalid).any(dim=1) if tokens else torch.zeros(0, dtype=torch.bool)
            n = int(routed.sum().item())
            self.assertEqual(out.num_recv_tokens_per_source.tolist(), [n], f"step {step}")
            want_counts = torch.bincount(ids[ids != invalid].long(), minlength=NUM_EXPERTS)
            self.assertEqual(out.num_recv_tokens_per_expert.tolist(), want_counts.tolist())
            self.assertTrue(torch.equal(out.hidden_states[0, :n], hidden[routed]))
            self.assertTrue(torch.equal(out.topk_ids[0, :n], ids[routed]))
            self.assertTrue(torch.equal(out.topk_weights[0, :n], weights[routed]))
            self.assertTrue(bool((out.topk_ids[0, n:] == invalid).all()))
            combined = dispatcher.combine(self.experts(out))
            self.assertEqual(tuple(combined.shape), (tokens, HIDDEN))
            want = run_experts(hidden, ids, weights, self.w, 0, NUM_EXPERTS)
            assert_close(self, f"step {step} (T={tokens}) combine", combined, want)
        self.worker.check_step()

    def test_forward_with_identity_experts(self) -> None:
        invalid = self.info.invalid_expert_id
        hidden, ids, weights = random_inputs(29, 5, "cuda:0", invalid)
        _, r = self.worker.sync_token_counts(29)
        self.worker.commit_geometry(50, r, 29)
        out = self.worker.forward(0, hidden, ids, weights)
        want = ((weights * (ids != invalid))[:, :, None] * hidden.float()[:, None, :]).sum(dim=1)
        assert_close(self, "forward", out, want)
        self.worker.check_step()

    def test_graph_capture_and_replay(self) -> None:
        from moe_ep_client.engine import Dispatcher

        bucket = 32
        dispatcher = Dispatcher(self.worker, first_epoch=200, graph_bucket=bucket)
        invalid = self.info.invalid_expert_id
        hidden, ids, weights = random_inputs(bucket, 300, "cuda:0", invalid)

        def step() -> Any:
            out = dispatcher.dispatch(hidden, ids, weights)
            return dispatcher.combine(self.experts(out))

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch asks
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        token = dispatcher.graph_token()
        with torch.cuda.graph(graph):
            static_out = step()
        for trial in range(3):
            h2, i2, w2 = random_inputs(bucket, 400 + trial, "cuda:0", invalid)
            hidden.copy_(h2)
            ids.copy_(i2)
            weights.copy_(w2)
            self.assertTrue(self.worker.check_graph(token))
            graph.replay()
            torch.cuda.synchronize()
            want = run_experts(h2, i2, w2, self.w, 0, NUM_EXPERTS)
            assert_close(self, f"replay {trial}", static_out, want)
        self.worker.check_step()

    def test_token_counts_on_the_device(self) -> None:
        local = torch.tensor([13], dtype=torch.int64, device="cuda:0")
        counts = self.worker.sync_token_counts_async(local)
        self.assertEqual(counts.tolist(), [13])
        self.assertTrue(counts.is_cuda)

    def test_argument_checks_name_the_argument(self) -> None:
        from moe_ep_client.engine import Dispatcher

        dispatcher = Dispatcher(self.worker)
        hidden, ids, weights = random_inputs(8, 1, "cuda:0", self.info.invalid_expert_id)
        with self.assertRaisesRegex(ValueError, "hidden_states: expected a CUDA tensor"):
            dispatcher.dispatch(hidden.cpu(), ids, weights)
        with self.assertRaisesRegex(TypeError, "topk_ids: expected dtype torch.int32"):
            dispatcher.dispatch(hidden, ids.long(), weights)
        with self.assertRaisesRegex(ValueError, r"topk_weights: expected shape \[8, 4\]"):
            dispatcher.dispatch(hidden, ids, weights[:4])
        with self.assertRaisesRegex(ValueError, "hidden_states: must be C-contiguous"):
            dispatcher.dispatch(hidden.t().contiguous().t(), ids, weights)
        with self.assertRaisesRegex(ValueError, "local_tokens: expected shape"):
            self.worker.sync_token_counts_async(torch.zeros(2, dtype=torch.int64, device="cuda"))

    def test_z_graph_is_stale_after_the_group_reforms(self) -> None:
        # Last (names sort): re-forms the group under the other tests.
        token = self.worker.graph_token()
        self.assertTrue(self.worker.check_graph(token))
        form_group([self.worker.address])
        self.worker.wait_ready(timeout_s=60)
        self.assertFalse(self.worker.check_graph(token))
        self.assertTrue(self.worker.check_graph(self.worker.graph_token()))


@unittest.skipIf(_skip_reason() is not None, _skip_reason() or "")
class OneSidedOneGpuTest(SteadyStateCase, unittest.TestCase):
    """The steady state on the one-sided plane, EP 1 on cuda:0 (its combine
    reads this rank's rows in place unless out overlaps them)."""

    @classmethod
    def setUpClass(cls) -> None:
        start_one_gpu(cls, "one-sided", "--onesided-receive-buffers")

    def test_dispatch_into_the_receive_buffers(self) -> None:
        # receive_output(): torch tensors over the window's receive buffers,
        # N = CAPACITY rows a source; a dispatch into them fills slots below
        # R as into buffers of the engine's own, slots [R, N) are left alone.
        out = self.worker.receive_output()
        self.assertEqual(tuple(out.hidden_states.shape), (1, CAPACITY, HIDDEN))
        self.assertEqual(out.hidden_states.dtype, torch.bfloat16)
        self.assertEqual(tuple(out.topk_ids.shape), (1, CAPACITY, TOP_K))
        rows, hidden_address, _, _ = self.worker.receive_buffers()
        self.assertEqual((rows, out.hidden_states.data_ptr()), (CAPACITY, hidden_address))
        invalid = self.info.invalid_expert_id
        tokens = 24
        _, r = self.worker.sync_token_counts(tokens)
        self.assertLess(r, CAPACITY)
        self.worker.commit_geometry(700, r, tokens)
        out.hidden_states.fill_(7.0)
        beyond = out.hidden_states[0, r:].clone()
        y = torch.empty(tokens, HIDDEN, dtype=torch.bfloat16, device="cuda:0")
        for seed in (71, 72):
            h, i, w = random_inputs(tokens, seed, "cuda:0", invalid)
            self.assertIs(self.worker.dispatch(h, i, w, recv_rows=CAPACITY, out=out), out)
            routed = (i != invalid).any(dim=1)
            n = int(routed.sum().item())
            self.assertEqual(out.num_recv_tokens_per_source.tolist(), [n], f"seed {seed}")
            self.assertTrue(torch.equal(out.hidden_states[0, :n], h[routed]), f"seed {seed}")
            self.assertTrue(torch.equal(out.topk_ids[0, :n], i[routed]), f"seed {seed}")
            self.assertTrue(torch.equal(out.hidden_states[0, n:r],
                                        torch.zeros_like(out.hidden_states[0, n:r])))
            self.assertTrue(torch.equal(out.hidden_states[0, r:], beyond), "slots past R")
            self.assertIs(self.worker.combine(self.experts(out), out=y), y)
            assert_close(self, f"seed {seed}", y, run_experts(h, i, w, self.w, 0, NUM_EXPERTS))
        self.worker.check_step()

    @classmethod
    def tearDownClass(cls) -> None:
        if cls.worker is not None:
            cls.worker.stop()


def _rank_main(rank: int, ranks: int) -> int:
    """One rank of the multi-GPU case: a worker on cuda:rank, torch experts on
    the received rows, combined output against the dense reference."""
    from moe_ep_client.engine import Dispatcher, Worker

    device = f"cuda:{rank}"
    torch.cuda.set_device(rank)
    with Worker(["--listen=127.0.0.1:0", "--backend=nccl", f"--device={rank}",
                 "--log-level=warn"]) as worker:
        print(f"ADDRESS {worker.address}", flush=True)
        if sys.stdin.readline().strip() != "GO":
            return 1
        worker.wait_ready(timeout_s=60)
        info = worker.info(refresh=True)
        w = expert_weights(device)
        dispatcher = Dispatcher(worker)
        for step in range(3):
            tokens = (11 + 13 * rank + 7 * step) % CAPACITY
            hidden, ids, weights = random_inputs(tokens, 1000 * rank + step, device,
                                                 info.invalid_expert_id)
            out = dispatcher.dispatch(hidden, ids, weights)
            y = run_experts(out.hidden_states, out.topk_ids, out.topk_weights, w,
                            info.first_expert, info.num_local_experts)
            combined = dispatcher.combine(y)
            want = run_experts(hidden, ids, weights, w, 0, NUM_EXPERTS)
            err = (combined.float() - want.float()).abs().max().item() if tokens else 0.0
            scale = want.float().abs().max().item() if tokens else 0.0
            if err > 2e-2 * scale + 1e-3:
                print(f"MISMATCH rank {rank} step {step}: {err} (scale {scale})", flush=True)
                return 1
        worker.check_step()
        print(f"rank {rank}: ok", flush=True)
        return 0


class MultiGpuTest(unittest.TestCase):
    """One process per GPU, the group formed by `moe-ep up --targets`."""

    def run_ranks(self, ranks: int) -> None:
        reason = _skip_reason(ranks)
        if reason:
            self.skipTest(reason)
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(r),
                                   "--ranks", str(ranks)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for r in range(ranks)]
        try:
            targets = [p.stdout.readline().split()[1] for p in procs]
            form_group(targets)
            for p in procs:
                p.stdin.write("GO\n")
                p.stdin.flush()
            outputs = [p.communicate(timeout=300)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for r, (p, text) in enumerate(zip(procs, outputs)):
            self.assertEqual(p.returncode, 0, f"rank {r}: {text}")

    def test_two_gpus(self) -> None:
        self.run_ranks(2)

    def test_four_gpus(self) -> None:
        self.run_ranks(4)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        sys.exit(_rank_main(int(sys.argv[2]), int(sys.argv[4])))
    unittest.main(verbosity=2)
