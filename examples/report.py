"""What the examples report: one run's ``Result``, the results table, the loss plot, progress.

Only process 0 prints.
"""

import dataclasses
import sys
import textwrap

import jax
import numpy as np
from configs import ALGORITHMS, BASELINE


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


# One look per algorithm, the same in every plot: colour, line style and marker all differ, so
# curves that lie on top of each other (bytegrad tracks gradient_allreduce closely) stay
# tellable apart.
_COLORS = ("black", "tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")
_LINESTYLES = ("-", "--", "-.", ":", (0, (5, 1)), (0, (3, 1, 1, 1)))
_MARKERS = ("o", "s", "^", "D", "v", "X")  # filled: each gets a white edge


def line_style(algorithm: str) -> dict:
    """Matplotlib ``plot`` keywords for ``algorithm``: its own colour, line style and marker."""
    names = list(ALGORITHMS)
    i = names.index(algorithm) if algorithm in names else len(names)
    return {
        "color": _COLORS[i % len(_COLORS)],
        "linestyle": _LINESTYLES[i % len(_LINESTYLES)],
        "marker": _MARKERS[i % len(_MARKERS)],
        # The baseline wide, the others narrow: a curve drawn over it leaves it showing.
        "linewidth": 2.4 if algorithm == BASELINE else 1.3,
        "markersize": 6,
        "markeredgecolor": "white",
        "markeredgewidth": 0.6,
    }


def _smooth(losses, width: int = 10) -> tuple[np.ndarray, np.ndarray]:
    """(steps, mean of the last ``width`` losses at each of them)."""
    losses = np.asarray(losses, np.float64)
    width = min(width, len(losses))
    mean = np.convolve(losses, np.ones(width) / width, mode="valid")
    return np.arange(width, len(losses) + 1), mean


def plot_losses(results: list[Result], path: str, title: str):
    """Writes the training-loss curves (10-step means) to a PNG, and returns the figure.

    Top: every algorithm's loss. Bottom, when gradient_allreduce is among the results: each
    other algorithm's loss divided by gradient_allreduce's, so algorithms whose curves overlap
    on top are apart there. Every algorithm has its own colour, line style and marker
    (``line_style``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    baseline = next((r for r in results if r.algorithm == BASELINE), None)
    panels = 2 if baseline is not None and len(results) > 1 else 1
    fig, axes = plt.subplots(panels, 1, figsize=(7, 3.2 * panels + 0.6), sharex=True, squeeze=False)
    curves = {r.algorithm: _smooth(r.losses) for r in results}

    def draw(ax, i, name, values):
        steps = curves[name][0]
        every = max(1, len(steps) // 8)
        # Markers at staggered steps, so those of overlapping curves do not cover each other.
        marks = (i * every // len(results), every)
        ax.plot(steps, values, label=name, markevery=marks, **line_style(name))

    top = axes[0, 0]
    for i, r in enumerate(results):
        draw(top, i, r.algorithm, curves[r.algorithm][1])
    top.set_ylabel("training loss (10-step mean)")
    top.set_yscale("log")
    top.set_title(textwrap.fill(title, 80), fontsize=9)
    top.legend(fontsize=8)
    if panels == 2:
        bottom = axes[1, 0]
        reference = curves[BASELINE][1]
        bottom.axhline(
            1.0, label=BASELINE, **{**line_style(BASELINE), "marker": None, "linewidth": 1}
        )
        for i, r in enumerate(results):
            if r.algorithm != BASELINE:
                draw(bottom, i, r.algorithm, curves[r.algorithm][1] / reference)
        bottom.set_ylabel(f"loss / {BASELINE}'s")
        bottom.set_yscale("log")  # 0.5x and 2x equally far from 1
        plain = matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}")
        bottom.yaxis.set_major_formatter(plain)
        bottom.yaxis.set_minor_formatter(plain)
    axes[-1, 0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig
