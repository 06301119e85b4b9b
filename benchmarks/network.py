"""Benchmark: gradient all-reduce time between hosts on shaped links.

Builds K hosts as network namespaces on one bridge (`_netns`), limits every link to a rate with
`tc` (and optionally adds latency), runs one JAX process per host with one CPU device each (mesh
(K, 1): the "node" axis is the hosts, Gloo over TCP between them; ``--devices-per-host D``: mesh
(K, D)) and times each registered operation on a gradient of ``--num-params`` parameters (25.2M
by default, about ResNet-50).

Usage (root; without root it says so and exits 0)::

    python benchmarks/network.py --hosts 2 --rates 1gbit,10gbit --plot network.png
    python benchmarks/network.py --cleanup   # remove what a crashed run left behind
    python benchmarks/network.py --prefix bgw ...   # a second run at the same time

``op:KB`` runs an op with messages of KB KiB, ``op@MB`` with buckets of MB MiB, beside the
other ops of the same run (``op@MB:KB`` both).

The table gives each op's median step, its ratio to ``psum_f32`` in the same run, the bytes
the host put on its link per step and the rate that makes (Mbit/s), the ring bound, and the
CPU seconds the host's process spent per step, all its threads (the hosts' mean; ``--json``
keeps each step's, ``cpu_s``): a collective that spun while it waited for the link would show
there.

The timed operations are the rows of a table in ``benchmarks/_network_ops.py`` (a builder
``(mesh, num_params) -> (jitted_fn, args)`` that runs in every worker process; ``--ops`` picks
them by name); ``benchmarks/_network_report.py`` prints the table and draws the plot. This
file holds the worker (one per host) and the driver.

References:
  - Bagua (Gan et al., 2021), Fig. 6: throughput on 1-25 Gbit/s links. https://arxiv.org/abs/2107.01499
  - Ring all-reduce: each host sends 2 (K-1)/K of the buffer (Patarasuk & Yuan, 2009).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _network_report as report  # noqa: E402
from _network_ops import BASELINE_OP, BUFFERS, DEFAULT_OPS, OPS, SIZES, runs_alone  # noqa: E402

DEFAULT_NUM_PARAMS = 25_200_000

# Worker: one per host ---------------------------------------------------------------------------


def _worker(args) -> int:
    from jax_bytegrad import initialize

    info = initialize()
    SIZES.update(bucket_mb=args.bucket_mb, message_kb=args.message_kb)
    BUFFERS["donate"] = args.donate
    import jax
    from jax.experimental import multihost_utils

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(jax.process_count(), jax.local_device_count()),
        ("node", "local"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    alone = [name for name in args.ops if runs_alone(_parse_op(name)[0])]  # main checked them
    built = {}
    for name in args.ops:
        op, message_kb, bucket_mb = _parse_op(name)
        # "op:KB" / "op@MB" run op with messages of KB KiB / buckets of MB MiB, in the same run
        if message_kb is not None:
            SIZES["message_kb"] = message_kb
        if bucket_mb is not None:
            SIZES["bucket_mb"] = bucket_mb
        built[name] = OPS[op](mesh, args.num_params)
        SIZES.update(bucket_mb=args.bucket_mb, message_kb=args.message_kb)
        fn, fn_args = built[name]
        for _ in range(args.warmup):
            jax.block_until_ready(fn(*fn_args))
    # Ops take turns step by step, so a burst of load from elsewhere on this shared machine
    # lands on all of them alike instead of on whichever op was running at the time.
    times = {name: [] for name in args.ops}
    tx = {name: 0 for name in args.ops}
    cpu = {name: [] for name in args.ops}
    if args.trace:
        # Each host's timed steps, for Perfetto or TensorBoard (one directory per host).
        jax.profiler.start_trace(
            str(Path(args.trace) / f"host{info.process_id}"), create_perfetto_trace=True
        )
    for step in range(args.steps):
        # With --rotate, round s starts at op s: no op always runs right after the same one.
        first = step % len(args.ops) if args.rotate else 0
        for name in args.ops[first:] + args.ops[:first]:
            fn, fn_args = built[name]
            # Start together, so one host's late start is not counted as link time (not an op
            # that runs alone: its exchange in flight would meet the barrier's collective).
            if not alone:
                multihost_utils.sync_global_devices(f"{name}-{step}")
            tx0 = _tx_bytes()
            t0, c0 = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*fn_args))
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            tx1 = _tx_bytes()
            tx[name] += (tx1 - tx0) if tx0 is not None and tx1 is not None else float("nan")
    if args.trace:
        jax.profiler.stop_trace()
    for name in alone:
        built[name][0].drain()
    results = {}
    for name in args.ops:
        # A step ends when the slowest host has its result.
        all_times = multihost_utils.process_allgather(np.asarray(times[name]))
        per_step = np.asarray(all_times).max(axis=0)
        # Bytes this host put on its link per timed step.
        sent = np.asarray(multihost_utils.process_allgather(np.asarray([tx[name] / args.steps])))
        # The process's CPU seconds in each timed step (every thread's: a collective that spun
        # while it waited for the link would show here), the hosts' mean.
        busy = np.asarray(multihost_utils.process_allgather(np.asarray(cpu[name]))).mean(axis=0)
        results[name] = {"steps_s": per_step.tolist(), "tx_bytes_per_host": float(sent.mean()),
                         "cpu_s": busy.tolist()}  # fmt: skip
        if info.process_id == 0:
            print(
                f"{name}: median {1e3 * statistics.median(per_step):.1f} ms, "
                f"{1e3 * busy.mean():.1f} ms of CPU per step",
                flush=True,
            )
    if info.process_id == 0:
        Path(args.out).write_text(json.dumps(results))
    jax.distributed.shutdown()
    return 0


def _parse_op(name: str) -> tuple[str, float | None, float | None]:
    """``op[@MB][:KB]`` -> (op, message KiB or None, bucket MiB or None)."""
    name, _, message_kb = name.partition(":")
    op, _, bucket_mb = name.partition("@")
    return (
        op,
        float(message_kb) if message_kb else None,
        float(bucket_mb) if bucket_mb else None,
    )


def _tx_bytes(dev: str = "eth0") -> int | None:
    """Bytes sent so far on this host's link (`ip netns exec` mounts the namespace's /sys)."""
    try:
        return int(Path(f"/sys/class/net/{dev}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


# Driver -----------------------------------------------------------------------------------------


def _run_config(cluster, args, mbit: float) -> dict[str, list[float]]:
    cluster.shape(mbit, args.delay)
    with tempfile.TemporaryDirectory(prefix="bgn-") as tmp:
        out = Path(tmp) / "result.json"
        worker = [
            sys.executable, str(Path(__file__).resolve()), "--worker",
            "--ops", ",".join(args.ops), "--num-params", str(args.num_params),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out),
        ]  # fmt: skip
        for flag, value in (("--bucket-mb", args.bucket_mb), ("--message-kb", args.message_kb)):
            if value is not None:
                worker += [flag, str(value)]
        worker += ["--donate"] if args.donate else []
        worker += ["--rotate"] if args.rotate else []
        worker += ["--trace", str(Path(args.trace).resolve())] if args.trace else []
        code = cluster.launch(
            worker,
            timeout=args.timeout,
            hugepages=args.hugepages,
            devices_per_proc=args.devices_per_host,
        )
        if code != 0:
            raise SystemExit(code)
        return json.loads(out.read_text())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", default="2", help="comma-separated host counts (default 2)")
    parser.add_argument(
        "--rates", default="1gbit,10gbit", help="comma-separated link rates (default 1gbit,10gbit)"
    )
    parser.add_argument("--delay", type=float, default=None, help="one-way latency in ms (netem)")
    parser.add_argument(
        "--ops",
        default=",".join(DEFAULT_OPS),
        help="comma-separated op names; op:KB sets its message size, op@MB its bucket size",
    )
    parser.add_argument("--num-params", type=int, default=DEFAULT_NUM_PARAMS)
    parser.add_argument(
        "--devices-per-host",
        type=int,
        default=1,
        help="CPU devices per host, the mesh's 'local' axis (default 1); with --pin they "
        "share the host's one CPU",
    )
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median is reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per configuration")
    parser.add_argument("--plot", default=None, help="write a PNG of time vs link rate here")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=None,
        help="ByteGrad / QAdam bucket size in MiB (default: the library's; 0: one bucket)",
    )
    parser.add_argument(
        "--message-kb",
        type=float,
        default=None,
        help="bytes per message between nodes, in KiB (default: the library's; 0: one per peer)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="host i runs on CPU i mod the CPU count, as separate machines have their own cores "
        "(default: every host may use every CPU)",
    )
    parser.add_argument(
        "--donate",
        action="store_true",
        help="train steps donate their state and carry it from step to step, as "
        "data_parallel_step does by default (train_local excepted); psum_f32, psum_bf16 and the "
        "syncs of the integer and ring wires (ar8_sync, ar4_sync, ring_sync, ...) donate the "
        "gradient and get the result back in its buffer",
    )
    parser.add_argument(
        "--rotate",
        action="store_true",
        help="start each round of steps at the next op (default: always in --ops order), so "
        "that what one op leaves behind (freed memory, a busy core) does not always land on "
        "the same next op",
    )
    parser.add_argument(
        "--no-hugepages",
        dest="hugepages",
        action="store_false",
        help="workers on 4 KiB pages (default, as the launcher: glibc.malloc.hugetlb=1)",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="write a jax.profiler trace of each host's timed steps under this directory "
        "(host{i}/; tracing costs time: take the medians from a run without it)",
    )
    parser.add_argument("--cleanup", action="store_true", help="remove leftovers and exit")
    parser.add_argument(
        "--prefix",
        default=None,
        help="name prefix of the namespaces (default bgn; a second run at once needs its own)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv=None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in args.ops if _parse_op(o)[0] not in OPS]
    if unknown:
        parser.error(f"unknown op(s) {unknown}; registered: {sorted(OPS)}")
    alone = [o for o in args.ops if runs_alone(_parse_op(o)[0])]
    if alone and len(args.ops) > 1:
        parser.error(f"{alone[0]} keeps an exchange in flight between steps: run it alone")
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    if args.devices_per_host < 1:
        parser.error(f"--devices-per-host {args.devices_per_host}: must be at least 1")

    if args.worker:
        return _worker(args)

    import _netns

    args.prefix = args.prefix or _netns.PREFIX

    if not _netns.have_root():
        print(
            "network benchmark: needs root (and ip, tc, unshare) to build namespace hosts; skipped"
        )
        return 0
    if args.cleanup:
        removed = _netns.cleanup(args.prefix)
        print(f"removed {removed}" if removed else "nothing to clean up")
        return 0
    hosts = [int(h) for h in args.hosts.split(",") if h]
    rates = [report.parse_rate(r) for r in args.rates.split(",") if r]
    if any(h < 2 for h in hosts):
        parser.error("--hosts: every host count must be at least 2")

    def on_term(signum, _frame):
        raise SystemExit(128 + signum)  # unwinds through the finally blocks that tear down

    signal.signal(signal.SIGTERM, on_term)
    rows = []
    try:
        for k in hosts:
            with _netns.Cluster(k, prefix=args.prefix, pin=args.pin) as cluster:
                for mbit in rates:
                    load = os.getloadavg()[0]
                    print(f"== {k} hosts, {report.rate_label(mbit)}, load {load:.2f}", flush=True)
                    result = _run_config(cluster, args, mbit)
                    print(f"   load average after: {os.getloadavg()[0]:.2f}", flush=True)
                    base = result.get(BASELINE_OP)
                    base = statistics.median(base["steps_s"]) if base else None
                    for op in args.ops:
                        med = statistics.median(result[op]["steps_s"])
                        rows.append(
                            {
                                "hosts": k, "devices": args.devices_per_host, "mbit": mbit,
                                "delay_ms": args.delay, "op": op,
                                "median_ms": 1e3 * med, "steps_s": result[op]["steps_s"],
                                "tx_mb": result[op]["tx_bytes_per_host"] / 1e6,
                                "cpu_ms": 1e3 * statistics.mean(result[op]["cpu_s"]),
                                "cpu_s": result[op]["cpu_s"],
                                "bound_ms": report.ring_bound_ms(op, k, args.num_params, mbit),
                                "ratio": None if base is None else med / base,
                            }
                        )  # fmt: skip
    except KeyboardInterrupt:
        print("interrupted; namespaces removed", file=sys.stderr)
        return 130
    finally:
        _netns.cleanup(args.prefix)  # also what an interrupted Cluster.__exit__ may have missed

    print(f"\n{args.num_params / 1e6:g}M parameters, {args.steps} timed steps after {args.warmup}")
    print(report.table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        report.plot(rows, args.plot)
        print(f"plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
