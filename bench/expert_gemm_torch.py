# torch._grouped_mm (CUTLASS on Hopper, device-side offsets) for one EP rank's SwiGLU experts, the
# comparison side of bench/expert_bench.cc (issue 14); derived from
# ../shared/tools/anchors/expert_gemm_torch.py with the same shapes and routing (top_k distinct experts
# per token, uniform). Times gate_up + SiLU*up + down replayed from a CUDA graph: CUDA events, p50 of
# --iters after --warmup. CSV to stdout.
# usage: python3 bench/expert_gemm_torch.py [--tokens 1 16 128 512 4096] [--iters 30]
import argparse
import torch


def case(tokens, H, I, E, K, iters, warm, seed=1):
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    ids = torch.argsort(torch.rand(tokens, E, device=dev, generator=g), dim=1)[:, :K]
    counts = torch.bincount(ids.flatten(), minlength=E)
    rows = int(counts.sum())
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(rows, H, device=dev, dtype=torch.bfloat16, generator=g)
    w13 = (torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16, generator=g) * 0.02).transpose(1, 2)
    w2 = (torch.randn(E, H, I, device=dev, dtype=torch.bfloat16, generator=g) * 0.02).transpose(1, 2)

    def step():
        gu = torch._grouped_mm(x, w13, offs=offs)
        h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
        return torch._grouped_mm(h, w2, offs=offs)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        step()
    ts = []
    for i in range(warm + iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gr.replay()
        b.record()
        torch.cuda.synchronize()
        if i >= warm:
            ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    hit = int((counts > 0).sum())
    return rows, hit, ts[(len(ts) - 1) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 128, 512, 4096])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    a = p.parse_args()
    print(f"# torch {torch.__version__} on {torch.cuda.get_device_name()}")
    print("tokens,rows,experts_hit,H,I,topk,torch_graph_p50_us")
    for t in a.tokens:
        rows, hit, us = case(t, a.hidden, a.intermediate, a.experts, a.topk, a.iters, a.warmup)
        print(f"{t},{rows},{hit},{a.hidden},{a.intermediate},{a.topk},{us:.1f}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
