"""PyTorch all_to_all_single baseline for moe-ep's GPU data plane (DESIGN §10).

What a user would write instead of a dedicated data plane, on the same
payload as bench/ep_bench.cc: dispatch = permute tokens by destination rank
(one copy per distinct destination rank), exchange per-rank counts, then
all_to_all_single of hidden [*, H] bf16, ids [*, K] int32 and weights [*, K]
fp32; combine = all_to_all_single of the [*, H] bf16 results back, then an
index_add_ into the fp32 output and a cast to bf16. Identity experts (the
result is the received row), so only communication and permutation are timed.

Run: torchrun --nproc_per_node 2 bench/baseline_torch.py [--iters 50]
Prints one CSV row per configuration (rank 0), same columns as ep_bench.
"""

import argparse
import os

import torch
import torch.distributed as dist


def make_ids(gen, tokens, top_k, num_experts, skewed, device):
    if skewed:
        p = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64)
    else:
        p = torch.ones(num_experts, dtype=torch.float64)
    ids = torch.multinomial(p.expand(tokens, -1), top_k, replacement=False, generator=gen)
    return ids.to(torch.int32).to(device)


def pct(values, q):
    v = sorted(values)
    i = min(len(v) - 1, max(0, int(-(-q * len(v) // 1)) - 1))
    return v[i]


def run(args):
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    dev = torch.device("cuda")
    per_rank = args.experts // world  # contiguous placement (experts divisible by world here)
    if rank == 0:
        print("ep,routing,hidden,top_k,tokens,dispatch_p50_us,dispatch_p99_us,combine_p50_us,"
              "combine_p99_us,dispatch_logical_GBps,combine_logical_GBps")
    for routing in args.routing:
        for hidden in args.hidden:
            for top_k in args.topk:
                for tokens in args.tokens:
                    gen = torch.Generator().manual_seed(1000 + rank)
                    ids = make_ids(gen, tokens, top_k, args.experts, routing == "skewed", dev)
                    x = torch.ones(tokens, hidden, dtype=torch.bfloat16, device=dev)
                    w = torch.full((tokens, top_k), 1.0 / top_k, dtype=torch.float32, device=dev)
                    d_times, c_times = [], []
                    copies = 0
                    for it in range(args.warmup + args.iters):
                        dist.barrier()
                        e0, e1, e2, e3 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
                        e0.record()
                        # dispatch: distinct destination ranks per token, permuted by rank
                        dest = (ids.long() // per_rank)                       # [T, K]
                        mask = torch.zeros(tokens, world, dtype=torch.bool, device=dev)
                        mask.scatter_(1, dest, True)                          # [T, E]
                        rank_of_copy, token_of_copy = mask.t().nonzero(as_tuple=True)
                        send_counts = mask.sum(0).to(torch.int64)             # [E]
                        recv_counts = torch.empty_like(send_counts)
                        dist.all_to_all_single(recv_counts, send_counts)
                        send_split = send_counts.tolist()
                        recv_split = recv_counts.tolist()
                        n_recv = sum(recv_split)
                        rx = torch.empty(n_recv, hidden, dtype=torch.bfloat16, device=dev)
                        rid = torch.empty(n_recv, top_k, dtype=torch.int32, device=dev)
                        rw = torch.empty(n_recv, top_k, dtype=torch.float32, device=dev)
                        dist.all_to_all_single(rx, x[token_of_copy], recv_split, send_split)
                        dist.all_to_all_single(rid, ids[token_of_copy], recv_split, send_split)
                        dist.all_to_all_single(rw, w[token_of_copy], recv_split, send_split)
                        e1.record()
                        # identity experts: y = (sum of local weights) * x
                        local = (rid.long() // per_rank) == rank
                        y = (rx.float() * (rw * local).sum(1, keepdim=True)).to(torch.bfloat16)
                        e2.record()
                        back = torch.empty(token_of_copy.numel(), hidden, dtype=torch.bfloat16,
                                           device=dev)
                        dist.all_to_all_single(back, y, send_split, recv_split)
                        out = torch.zeros(tokens, hidden, dtype=torch.float32, device=dev)
                        out.index_add_(0, token_of_copy, back.float())
                        out = out.to(torch.bfloat16)
                        e3.record()
                        torch.cuda.synchronize()
                        if it >= args.warmup:
                            d_times.append(e0.elapsed_time(e1) * 1000.0)
                            c_times.append(e2.elapsed_time(e3) * 1000.0)
                        copies = token_of_copy.numel()
                    if rank == 0:
                        dp50, cp50 = pct(d_times, 0.5), pct(c_times, 0.5)
                        dbytes = copies * (2 * hidden + 8 * top_k)
                        cbytes = copies * 2 * hidden
                        print(f"{world},{routing},{hidden},{top_k},{tokens},{dp50:.1f},"
                              f"{pct(d_times, 0.99):.1f},{cp50:.1f},{pct(c_times, 0.99):.1f},"
                              f"{dbytes / (dp50 * 1e3):.2f},{cbytes / (cp50 * 1e3):.2f}",
                              flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512, 4096, 16384])
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168])
    p.add_argument("--topk", type=int, nargs="+", default=[2, 8])
    p.add_argument("--routing", nargs="+", default=["uniform", "skewed"])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=50)
    run(p.parse_args())
