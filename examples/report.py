"""What the examples report: one run's ``Result``, the results table, the loss plot, progress.

Only process 0 prints.
"""

import dataclasses
import sys
import textwrap

import jax
import numpy as np
from configs import BASELINE


@dataclasses.dataclass
class Result:
    """What one run measured.

    Attributes:
      algorithm: the algorithm's name.
      model: the model's name.
      losses: training loss of every step (mean over devices).
      test_loss: mean cross-entropy on the held-out set, in nats.
      test_accuracy: accuracy on the held-out set (next-character accuracy for text).
      node_bytes: bytes each device sends between nodes per step (after any warm-up).
      node_bytes_average: the same, averaged over the run (QAdam's warm-up included).
      baseline_node_bytes: gradient_allreduce's, on the same model and mesh.
      steps_per_second: after the first (compiling) step.
      num_params: model size.
      comm_table: ``communication_stats`` of each phase of the step, printable.
    """

    algorithm: str
    model: str
    losses: list[float]
    test_loss: float
    test_accuracy: float
    node_bytes: float
    node_bytes_average: float
    baseline_node_bytes: float
    steps_per_second: float
    num_params: int
    comm_table: str

    @property
    def bytes_ratio(self) -> float:
        """Inter-node bytes per step against gradient_allreduce's."""
        return self.node_bytes / self.baseline_node_bytes


def is_main_process() -> bool:
    return jax.process_index() == 0


def log(*args, **kwargs) -> None:
    """print, on process 0 only."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


class Progress:
    """A plain-stdout progress bar with the loss; a few lines instead when not on a terminal."""

    def __init__(self, total: int, label: str, enabled: bool):
        self.total, self.label = total, label
        self.enabled = enabled and is_main_process()
        self.tty = sys.stdout.isatty()
        self.next_line = 0

    def update(self, done: int, loss: float) -> None:
        if not self.enabled:
            return
        if self.tty:
            filled = int(30 * done / self.total)
            bar = "#" * filled + "." * (30 - filled)
            print(f"\r{self.label:>27} [{bar}] {done}/{self.total} loss {loss:.4f}", end="")
            sys.stdout.flush()
        elif done >= self.next_line or done == self.total:
            print(f"{self.label:>27} step {done:>5}/{self.total} loss {loss:.4f}", flush=True)
            self.next_line = done + max(1, self.total // 4)

    def close(self) -> None:
        if self.enabled and self.tty:
            print()


def _kib(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def results_table(results: list[Result]) -> str:
    """A markdown table of the results: quality, inter-node bytes, and speed."""
    rows = [
        "| algorithm | test accuracy | test loss | final train loss | inter-node bytes/step "
        "| vs gradient_allreduce | run average | steps/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        final = float(np.mean(r.losses[-10:]))
        rows.append(
            f"| {r.algorithm} | {r.test_accuracy:.2%} | {r.test_loss:.4f} | {final:.4f} "
            f"| {_kib(r.node_bytes)} | {r.bytes_ratio:.3f}x ({1 - r.bytes_ratio:.1%} saved) "
            f"| {r.node_bytes_average / r.baseline_node_bytes:.3f}x | {r.steps_per_second:.1f} |"
        )
    return "\n".join(rows)


def plot_losses(results: list[Result], path: str, title: str) -> None:
    """Writes the training-loss curves (smoothed over 10 steps) to a PNG.

    The baseline is drawn last, dashed and black, so the curves that track it closely do not
    hide it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in sorted(results, key=lambda r: r.algorithm == BASELINE):
        losses = np.asarray(r.losses)
        width = min(10, len(losses))
        smooth = np.convolve(losses, np.ones(width) / width, mode="valid")
        baseline = r.algorithm == BASELINE
        style = {"color": "black", "linestyle": "--", "zorder": 3} if baseline else {}
        ax.plot(np.arange(width, len(losses) + 1), smooth, label=r.algorithm, **style)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_yscale("log")
    ax.set_title(textwrap.fill(title, 80), fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
