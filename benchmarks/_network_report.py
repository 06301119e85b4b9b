"""The report of ``benchmarks/network.py``: link rates, the ring bound, the table and the plot."""

from __future__ import annotations

import argparse
import re

from _network_ops import WIRE_BYTES_PER_PARAM


def parse_rate(text: str) -> float:
    """'1gbit', '10Gbit', '500mbit' or a plain number of Mbit/s -> Mbit/s; 'none' -> 0."""
    if text.strip().lower() in ("none", "0", "unshaped"):
        return 0.0  # no tbf: the veth at full speed, which shows the CPU-bound floor
    m = re.fullmatch(r"\s*([0-9.]+)\s*(g|m)?(bit)?(/s)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"rate {text!r}: use e.g. 1gbit, 500mbit or 1000")
    return float(m.group(1)) * (1000 if m.group(2) == "g" else 1)


def rate_label(mbit: float) -> str:
    if not mbit:
        return "unshaped"
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def ring_bound_ms(op: str, hosts: int, num_params: int, mbit: float) -> float | None:
    op = op.partition(":")[0].partition("@")[0]
    if op not in WIRE_BYTES_PER_PARAM or hosts < 2 or not mbit:
        return None
    sent = 2 * (hosts - 1) / hosts * num_params * WIRE_BYTES_PER_PARAM[op]
    return 1e3 * sent * 8 / (mbit * 1e6)


def mbit_per_s(row: dict) -> float:
    """What one host put on its link per second of the op's median step (measured tx bytes)."""
    return row["tx_mb"] * 8 / row["median_ms"] * 1e3 if row["median_ms"] else float("nan")


def table(rows: list[dict]) -> str:
    head = (
        "| hosts | link | operation | median ms | vs float32 | MB sent/host | Mbit/s "
        "| ring bound ms | CPU ms/step |"
    )
    lines = [head, "|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bound = "" if r["bound_ms"] is None else f"{r['bound_ms']:.0f}"
        cpu = "" if r.get("cpu_ms") is None else f"{r['cpu_ms']:.1f}"  # older --json: none
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.2f}"
        devices = r.get("devices", 1)  # per host; rows of older --json files have none
        hosts = f"{r['hosts']} x {devices}" if devices > 1 else f"{r['hosts']}"
        lines.append(
            f"| {hosts} | {rate_label(r['mbit'])}"
            f"{' + ' + format(r['delay_ms'], 'g') + ' ms' if r['delay_ms'] else ''} | "
            f"{r['op']} | {r['median_ms']:.1f} | {ratio} | {r['tx_mb']:.1f} | "
            f"{mbit_per_s(r):.0f} | {bound} | {cpu} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """One panel per host count, one line per op (same colour in every panel), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["mbit"]]  # unshaped runs have no place on a rate axis
    hosts = sorted({r["hosts"] for r in rows})
    ops = list(dict.fromkeys(r["op"] for r in rows))
    colors = {op: f"C{i}" for i, op in enumerate(ops)}
    fig, axes = plt.subplots(
        1, len(hosts), figsize=(4.5 * len(hosts), 4.5), sharey=True, squeeze=False
    )
    for ax, k in zip(axes[0], hosts, strict=True):
        for op in ops:
            pts = sorted(
                (r["mbit"] / 1000, r["median_ms"]) for r in rows if (r["hosts"], r["op"]) == (k, op)
            )
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", color=colors[op], label=op)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Gbit/s)")
        ax.set_title(f"{k} hosts")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("median time per step (ms)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(ops)), fontsize="small")
    fig.suptitle("Gradient sync and train steps between namespace hosts")
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(ops) - 1) // 4), 1, 1))
    fig.savefig(path, dpi=120)
