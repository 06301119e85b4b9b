"""The README shows what the code produces: examples/train.py's output, its tables, their bytes.

The README's output block and results tables sit between markers naming the command and the
JAX version that produced them::

    <!-- train.py ARGS output jax=0.10.2 -->   examples/train.py's whole output, fenced
    <!-- train.py ARGS table jax=0.10.2 -->    its results table
    <!-- end -->

Two tests keep them true, both marked slow. The inter-node bytes of every table (bytes per step, the
ratio to gradient_allreduce, the run average) are compared with what ``communication_stats`` reads
from the compiled steps: deterministic, on any JAX. The transformer's steps are compiled here, with
nothing trained (~30 s of CPU); the CNN's bytes are the table of the session's one run of the
default command (conftest's ``train_py_default_run``, which fills them from the same
``communication_stats``), so its steps are not compiled twice. The default command's output and
table are compared with a fresh run of it on the JAX version they were recorded with (~1 minute on 2
cores): every line alike, but for what training decides (the losses and the test accuracy), held
within ``LOSS_TOLERANCE`` and ``ACCURACY_POINTS``; steps per second are left out, they are timings.
Training amplifies float differences: the same code and JAX on another machine's CPU, or with
another numpy or Flax release, moved ByteGrad's losses by up to 14% and its accuracy by one of 360
test images, while a broken algorithm moves them by many times that.

After a change that moves the figures (a new default, an algorithm's fix), rewrite the blocks of
the running JAX version with, from the root of the repository::

    PYTHONPATH=$PWD python tests/test_readme.py                       # the CNN, ~1 minute
    PYTHONPATH=$PWD python tests/test_readme.py --model transformer   # ~5 minutes on 2 cores

once with each Python whose JAX the README records (3.11: JAX 0.10.2; 3.12: JAX 0.12).
"""

import dataclasses
import math
import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import run_train, table_rows

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
import configs  # noqa: E402
import report  # noqa: E402

MARKER = re.compile(
    r"<!-- train\.py (?P<args>[^>]*?) ?(?P<what>output|table) jax=(?P<version>\S+) -->\n"
    r"(?P<body>.*?)<!-- end -->\n",
    re.S,
)
# The columns of report.results_table that communication_stats decides.
BYTE_COLUMNS = ("inter-node bytes/step", "vs gradient_allreduce", "run average")


def blocks(text: str) -> list[re.Match]:
    """The README's marked blocks, in order."""
    return list(MARKER.finditer(text))


# What training decides, and how far two machines' runs of the same code may part on it.
LOSS_TOLERANCE = dict(rel_tol=0.25, abs_tol=0.002)
ACCURACY_POINTS = 1.0
TRAINED_COLUMNS = ("test accuracy", "test loss", "final train loss")
PROGRESS_LOSS = re.compile(r"(?<= loss )[\d.]+$")


def figures(text: str) -> tuple[list[str], list[tuple[str, float]]]:
    """The lines of ``text`` with what training decides replaced by ``#`` and the steps/s cell by
    ``-`` (a timing); and the replaced figures, each as ``(kind, value)``."""
    lines, found, header = [], [], None
    for line in text.strip().splitlines():
        line = line.rstrip()
        if line.startswith("| algorithm |"):
            header = [cell.strip() for cell in line.strip("|").split("|")]
        elif header and line.startswith("| ") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            for i, column in enumerate(header):
                if column in TRAINED_COLUMNS:
                    found.append((column, float(cells[i].rstrip("%"))))
                    cells[i] = "#"
                elif column == "steps/s":
                    cells[i] = "-"
            line = "| " + " | ".join(cells) + " |"
        elif PROGRESS_LOSS.search(line):
            found.append(("loss", float(PROGRESS_LOSS.search(line)[0])))
            line = PROGRESS_LOSS.sub("#", line)
        lines.append(line)
    return lines, found


def figures_apart(stated: str, fresh: str) -> str | None:
    """Where ``fresh`` differs from ``stated`` beyond what another machine's run would, or None."""
    stated_lines, stated_figures = figures(stated)
    fresh_lines, fresh_figures = figures(fresh)
    if stated_lines != fresh_lines:
        diff = [(a, b) for a, b in zip(stated_lines, fresh_lines, strict=False) if a != b]
        return f"the lines differ (stated, fresh): {diff[:3] or (stated_lines, fresh_lines)}"
    for (kind, a), (_, b) in zip(stated_figures, fresh_figures, strict=True):
        near = (
            abs(a - b) <= ACCURACY_POINTS
            if kind == "test accuracy"
            else math.isclose(a, b, **LOSS_TOLERANCE)
        )
        if not near:
            return f"{kind} {a} stated, {b} now"
    return None


def fresh_blocks(stdout: str) -> dict[str, str]:
    """What the README's ``output`` and ``table`` blocks hold for a run that printed ``stdout``."""
    table = "\n".join(line for line in stdout.splitlines() if line.startswith("|"))
    return {"output": f"```\n{stdout.strip()}\n```\n", "table": f"{table}\n"}


def rewrite(text: str, args: str, version: str, fresh: dict[str, str]) -> tuple[str, int]:
    """``text`` with the blocks of command ``args`` on JAX ``version`` replaced; and how many."""
    count = 0

    def replace(match):
        nonlocal count
        if match["args"] != args or match["version"] != version:
            return match[0]
        count += 1
        return match[0].replace(match["body"], fresh[match["what"]], 1)

    return MARKER.sub(replace, text), count


# The bytes of every table ------------------------------------------------------------------------


def compiled_table(model: str) -> dict[str, dict[str, str]]:
    """The byte columns of ``model``'s default run, from its compiled steps (nothing is run)."""
    import train
    from flax import nnx

    config = configs.Config(model=model, nodes=2, devices_per_node=4, progress=False)
    mesh = train.resolve_mesh(config)
    data = train.datasets.load(config.get("dataset"))
    net = train.models.create(
        model, num_classes=data.num_classes, seq_len=config.seq_len, seed=config.seed
    )
    graphdef, params, rest = nnx.split(net, nnx.Param, ...)
    params = jax.device_get(params)
    loss_fn = train.make_loss_fn(graphdef, rest)
    batch = train.window_batches(config, data, config.get("batch_size"))()
    steps = np.asarray(config.get("steps"), np.int64)
    results, baseline = [], None
    for name in sorted(set(configs.ALGORITHMS) - {"async"}, key=lambda n: n != configs.BASELINE):
        run = dataclasses.replace(config, algorithm=name)
        with train.build_step(run, name, loss_fn, mesh) as step:
            state = step.init(params)
            phases = step.communication_stats(state, batch)
            counts = step.phase_counts(state._replace(step=steps))  # reads only the count
            per_step, average = train.node_bytes(phases, counts)
        baseline = per_step if baseline is None else baseline
        results.append(
            report.Result(name, model, [0.0], 0.0, 0.0, per_step, average, baseline, 0.0, 0, "")
        )
    return table_rows(report.results_table(results))


def test_the_readme_has_its_blocks():
    # A parser that found nothing would pass every other test here.
    found = {(m["args"], m["what"]) for m in blocks(README.read_text())}
    assert {("", "output"), ("", "table"), ("--model transformer", "table")} <= found, found


@pytest.mark.slow  # the transformer compiles 5 steps: ~30 s of CPU
@pytest.mark.parametrize("model", ["cnn", "transformer"])
def test_the_readme_states_the_bytes_the_compiled_steps_send(model, request):
    args = "" if model == "cnn" else f"--model {model}"
    tables = [m for m in blocks(README.read_text()) if m["what"] == "table" and m["args"] == args]
    assert tables, f"README.md has no table of train.py {args}"
    if model == "cnn":
        # The README's command, run once per session: its byte columns are communication_stats
        # of the same compiled steps (a 300-step count, as compiled_table's), on this JAX.
        compiled = table_rows(request.getfixturevalue("train_py_default_run"))
    else:
        compiled = compiled_table(model)
    for match in tables:
        stated = table_rows(match["body"])
        assert set(stated) == set(compiled), (match["version"], set(stated))
        for name, row in stated.items():
            got = {c: row[c] for c in BYTE_COLUMNS}
            want = {c: compiled[name][c] for c in BYTE_COLUMNS}
            assert got == want, (
                f"README.md's {model} table (JAX {match['version']}) says {name} sends {got}; the "
                f"compiled step sends {want}. Rewrite it: see tests/test_readme.py's docstring"
            )


# The default command's output ---------------------------------------------------------------------


@pytest.mark.slow
def test_the_readme_shows_what_train_py_prints(request):
    recorded = {m["version"] for m in blocks(README.read_text()) if m["args"] == ""}
    if jax.__version__ not in recorded:
        pytest.skip(f"README.md records train.py's output on JAX {sorted(recorded)}, not this one")
    # Asked for only here: where the README records no output for this JAX, nothing is run.
    fresh = fresh_blocks(request.getfixturevalue("train_py_default_run"))
    for match in blocks(README.read_text()):
        if match["args"] == "" and match["version"] == jax.__version__:
            apart = figures_apart(match["body"], fresh[match["what"]])
            assert apart is None, (
                f"README.md's train.py {match['what']} (JAX {jax.__version__}) is not what it "
                f"prints now: {apart}; rewrite it with: PYTHONPATH=$PWD python tests/test_readme.py"
            )


def test_rewrite_replaces_only_the_blocks_of_this_command_and_version():
    text = (
        "a\n<!-- train.py table jax=1.0 -->\nold\n<!-- end -->\n"
        "<!-- train.py table jax=2.0 -->\nother\n<!-- end -->\n"
        "<!-- train.py --model x table jax=1.0 -->\nkept\n<!-- end -->\nb\n"
    )
    new, count = rewrite(text, "", "1.0", {"table": "new\n", "output": "unused\n"})
    assert count == 1
    assert [m["body"] for m in blocks(new)] == ["new\n", "other\n", "kept\n"]
    assert new.startswith("a\n") and new.endswith("b\n")


def test_figures_apart_allows_another_machines_run_and_nothing_more():
    stated = (
        "   bytegrad step   300/300 loss 0.0086\n\n"
        "| algorithm | test accuracy | test loss | final train loss | inter-node bytes/step "
        "| steps/s |\n|---|---:|---:|---:|---:|---:|\n"
        "| bytegrad | 98.33% | 0.0479 | 0.0162 | 71.1 KiB | 36.9 |\n"
    )
    # The README's run and this machine's: same lines, losses 14% apart, one test image.
    machine = stated.replace("0.0086", "0.0074").replace("98.33%", "98.05%")
    assert figures_apart(stated, machine.replace("36.9", "19.0")) is None
    assert "loss 0.0086 stated, 0.05" in figures_apart(stated, stated.replace("0.0086", "0.05"))
    assert "test accuracy" in figures_apart(stated, stated.replace("98.33%", "91.00%"))
    assert "test loss" in figures_apart(stated, stated.replace("0.0479", "0.0700"))
    assert "lines differ" in figures_apart(stated, stated.replace("71.1 KiB", "71.2 KiB"))
    assert "lines differ" in figures_apart(stated, stated.replace("300/300", "299/300"))


def main(argv: list[str]) -> int:
    """Reruns ``examples/train.py ARGV`` and rewrites its blocks of this JAX version."""
    args = " ".join(argv)
    text = README.read_text()
    new, count = rewrite(text, args, jax.__version__, fresh_blocks(run_train(argv)))
    if count == 0:
        versions = sorted({m["version"] for m in blocks(text) if m["args"] == args})
        print(
            f"README.md has no block of train.py {args or '(defaults)'} on JAX {jax.__version__}; "
            f"it has them for JAX {versions}: run this with that Python, or add the markers",
            file=sys.stderr,
        )
        return 1
    README.write_text(new)
    command = f"train.py {args or '(defaults)'} on JAX {jax.__version__}"
    print(f"rewrote {count} block(s) of README.md: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
