"""Benchmark: PyTorch DDP's gradient all-reduce and its compression hooks, on the same links.

The peers to compare ByteGrad with: PyTorch DistributedDataParallel over Gloo, plain (float32
ring all-reduce), with its fp16 compression hook, and with its PowerSGD hook. The hosts, links
and shaping are those of `network.py` (`_netns`): K network namespaces on one bridge, a tc token
bucket at the link rate on both ends of every link, one process per host.

The gradient is that of one 5020 x 5020 float32 matrix (25.2M parameters, like `network.py`'s
default), PowerSGD's best case: one square matrix, compressed to rank 4 (2 x 5020 x 4 floats
instead of 25.2M). A timed step is one backward pass of DDP on a one-row batch, which ends when
the hook's communication has finished; `local` is the same backward with no communication.

torch is not a dependency of jax_bytegrad: install it in any environment (its CPU wheel is
enough) and point ``--python`` at that interpreter.

Usage (root; without root it says so and exits 0)::

    python benchmarks/torch_peers.py --python /path/to/torch-venv/bin/python --hosts 2 \\
        --rates 1gbit

References:
  - PyTorch DDP communication hooks: https://pytorch.org/docs/stable/ddp_comm_hooks.html
  - Vogels et al., "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
    Optimization", NeurIPS 2019.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SIDE = 5020  # 5020^2 = 25.2M parameters
OPS = ("local", "ddp_f32", "ddp_fp16", "ddp_powersgd4")
PORT = 29512

# Worker: one per host -----------------------------------------------------------------------------


def _ddp_model(op: str):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = torch.nn.Linear(SIDE, SIDE, bias=False)
    if op == "local":
        return model
    ddp = DistributedDataParallel(model, bucket_cap_mb=25)
    if op == "ddp_fp16":
        ddp.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
    elif op == "ddp_powersgd4":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp


def _worker(args) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
    model = _ddp_model(args.op)
    x = torch.randn(1, SIDE, generator=torch.Generator().manual_seed(rank))
    times = []
    for step in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        dist.barrier()  # start together, so one host's late start is not counted as link time
        t0 = time.perf_counter()
        loss.backward()  # returns once DDP's hook has averaged the gradient
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    # A step ends when the slowest host has its result.
    slowest = torch.tensor(times)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(args.out).write_text(json.dumps(slowest.tolist()))
    dist.destroy_process_group()
    return 0


# Driver -------------------------------------------------------------------------------------------


def _run(cluster, args, op: str) -> list[float]:
    from jax_bytegrad.launch import launch

    with tempfile.TemporaryDirectory(prefix="bgt-") as tmp:
        out = Path(tmp) / "times.json"
        worker = [
            args.python, str(Path(__file__).resolve()), "--worker", "--op", op,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
        ]  # fmt: skip

        def command(rank: int) -> list[str]:
            env = [
                f"RANK={rank}",
                f"WORLD_SIZE={len(cluster.hosts)}",
                f"MASTER_ADDR={cluster.hosts[0].address}",
                f"MASTER_PORT={PORT}",
                "GLOO_SOCKET_IFNAME=eth0",
            ]
            return cluster.command(rank, ["env", *env, *worker])

        code = launch(command, nproc=len(cluster.hosts), timeout=args.timeout)
        if code != 0:
            raise SystemExit(code)
        return json.loads(out.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--python", default=sys.executable, help="an interpreter with torch")
    parser.add_argument("--hosts", default="2", help="comma-separated host counts (default 2)")
    parser.add_argument("--rates", default="1gbit", help="comma-separated link rates")
    parser.add_argument("--ops", default=",".join(OPS), help=f"any of {','.join(OPS)}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median is reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per op")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--prefix", default="bgt", help="name prefix of the namespaces (one per concurrent run)"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--op", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(args)

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(REPO))
    import _netns
    from _network_report import parse_rate, rate_label

    if not _netns.have_root():
        print("torch peers benchmark: needs root (and ip, tc, unshare); skipped")
        return 0
    ops = [o for o in args.ops.split(",") if o]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown op(s) {unknown}; use any of {list(OPS)}")
    rows = []
    try:
        for k in (int(h) for h in args.hosts.split(",") if h):
            with _netns.Cluster(k, prefix=args.prefix) as cluster:
                for mbit in (parse_rate(r) for r in args.rates.split(",") if r):
                    cluster.shape(mbit)
                    for op in ops:
                        times = _run(cluster, args, op)
                        med = 1e3 * statistics.median(times)
                        print(f"{k} hosts, {rate_label(mbit)}, {op}: median {med:.1f} ms")
                        rows.append({"hosts": k, "mbit": mbit, "op": op, "median_ms": med})
    finally:
        _netns.cleanup(args.prefix)
    print("\n| hosts | link | operation | median ms |\n|---:|---|---|---:|")
    for r in rows:
        print(f"| {r['hosts']} | {rate_label(r['mbit'])} | {r['op']} | {r['median_ms']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
