#!/usr/bin/env python3
"""Example orchestrator: form a moe-ep group, query status, agree geometry.

    PYTHONPATH=BUILD/python:python /usr/bin/python3 python/examples/form_group.py \
        --targets 127.0.0.1:50051,127.0.0.1:50052 [--tls-ca ca.crt --tls-cert c.crt \
        --tls-key c.key --auth-token-file token]

Prints one status line per worker before and after, the allocated workspace
and the agreed geometry. Exit status 0 on success, 1 on a failed operation.
"""

import argparse
import sys
from typing import List, Optional

from moe_ep_client import Group, GroupError, Security, WorkerStatus


def print_status(title: str, statuses: List[WorkerStatus]) -> None:
    print(title)
    for s in statuses:
        print(
            f"  {s.target}: state={s.state} rank={s.rank}/{s.world_size} gen={s.generation} "
            f"backend={s.backend or '-'} device={s.device_name} workspace={s.workspace_bytes} "
            f"epoch={s.geometry_epoch} R={s.runtime_max_tokens_per_rank} N={s.capacity_tokens} "
            f"errors={s.errors}"
        )


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", required=True, help="host:port,... (rank i = i-th)")
    parser.add_argument("--tls-ca")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--auth-token-file")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--num-experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity", type=int, default=16, help="N, tokens per rank")
    parser.add_argument(
        "--tokens", default="", help="local token counts, comma-separated (default 5,3,...)"
    )
    parser.add_argument("--epoch", type=int, default=1)
    args = parser.parse_args(argv)

    token = None
    if args.auth_token_file:
        with open(args.auth_token_file) as f:
            token = f.read().strip()
    security = Security(args.tls_ca, args.tls_cert, args.tls_key, token)
    targets = args.targets.split(",")
    local = (
        [int(x) for x in args.tokens.split(",")]
        if args.tokens
        else [5 if r % 2 == 0 else 3 for r in range(len(targets))]
    )
    with Group(targets, security=security) as group:
        try:
            print_status("before:", group.status())
            generation = group.form()
            print(f"formed generation {generation} with {group.world_size} ranks")
            fingerprint = group.configure(
                hidden_size=args.hidden_size,
                num_layers=1,
                num_experts=args.num_experts,
                top_k=args.top_k,
            )
            print(f"plan fingerprint {fingerprint}")
            ws = group.allocate(
                hidden_size=args.hidden_size,
                top_k=args.top_k,
                num_experts=args.num_experts,
                capacity_tokens=args.capacity,
            )
            print(
                f"workspace: {ws.allocated_bytes} bytes allocated, flashinfer-compatible "
                f"{ws.flashinfer_workspace_bytes}, dispatch {ws.dispatch_bytes_per_token} B/token"
            )
            agreed = group.agree_geometry(args.epoch, local)
            print(
                f"geometry: epoch {agreed.epoch}, counts {agreed.token_counts}, "
                f"max {agreed.max_tokens}, R {agreed.runtime_max_tokens_per_rank}"
            )
            print_status("after:", group.status())
        except GroupError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
