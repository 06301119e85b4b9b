"""The examples train for real: every algorithm learns, and ByteGrad cuts inter-node bytes ~4x.

Short runs of examples/train.py on the 2 x 4 CPU mesh of conftest.py (8 devices), in-process,
plus the command line once and the multi-process script under the local launcher. Those are
marked slow; the command line's usage errors and the loss plot's styles are not.
"""

import dataclasses
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from helpers import table_rows

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
sys.path.insert(0, EXAMPLES)
import configs  # noqa: E402
import report  # noqa: E402
import train  # noqa: E402

# Compressed algorithms: <= 0.25 x float32 for the codes, + 0.8% headers + bucket padding.
COMPRESSED = ("bytegrad", "qadam", "low_precision_decentralized")
MAX_RATIO = 0.26


# One process runs every algorithm but async (which averages across processes).
ONE_PROCESS = set(train.ALGORITHMS) - {"async"}


def _check(results, *, min_accuracy: float, max_test_loss: float, names=ONE_PROCESS) -> None:
    by_name = {r.algorithm: r for r in results}
    assert set(by_name) == set(names)
    for r in results:
        head, tail = np.mean(r.losses[:3]), np.mean(r.losses[-3:])
        assert tail < head, f"{r.algorithm}: loss went {head:.4f} -> {tail:.4f}"
        assert r.test_accuracy > min_accuracy, f"{r.algorithm}: accuracy {r.test_accuracy:.3f}"
        assert r.test_loss < max_test_loss, f"{r.algorithm}: test loss {r.test_loss:.4f}"
        assert r.node_bytes > 0
    baseline = by_name["gradient_allreduce"].node_bytes
    for name in COMPRESSED:
        if name in by_name:
            ratio = by_name[name].node_bytes / baseline
            assert ratio <= MAX_RATIO, f"{name}: {ratio:.3f}x gradient_allreduce's node bytes"


@pytest.mark.slow
def test_cnn_digits_every_algorithm(train_py_default_run):
    """The README's command (``python examples/train.py``: the CNN, 300 steps, every algorithm
    one process runs), run once per session and shared with test_readme, which holds its
    figures against the README's on the JAX versions the README records: here, on any JAX,
    every algorithm learned, and the compressed ones sent about 4x fewer bytes between nodes."""
    out = train_py_default_run
    rows = table_rows(out)
    assert set(rows) == ONE_PROCESS, out[-3000:]
    for name, row in rows.items():
        pattern = rf"^ *{name} step +\d+/\d+ loss ([\d.]+)$"
        losses = [float(x) for x in re.findall(pattern, out, re.M)]
        assert len(losses) >= 2 and losses[-1] < losses[0] / 10, (name, losses)
        assert float(row["test accuracy"].rstrip("%")) > 90.0, row  # chance is 10%
        assert float(row["test loss"]) < 0.2, row
        ratio = float(row["vs gradient_allreduce"].split("x")[0])
        assert (ratio <= MAX_RATIO) if name in COMPRESSED else (ratio >= 1.0), row


def _check_plot(fig, names):
    """Every algorithm is drawn in both panels, and none looks like another."""
    losses, ratios = fig.axes
    drawn = {line.get_label(): line for line in losses.get_lines()}
    assert sorted(drawn) == sorted(names)
    for key in (lambda line: line.get_color(), lambda line: line.get_marker()):
        looks = [key(line) for line in drawn.values()]
        assert len(set(looks)) == len(looks), looks
    # Below: each algorithm over gradient_allreduce, which is the line at 1.
    assert sorted(line.get_label() for line in ratios.get_lines()) == sorted(names)


def test_plot_styles_every_algorithm_apart(tmp_path):
    # All six, async included: each its own colour, marker and line style, in every plot.
    rng = np.random.default_rng(0)
    results = [
        train.Result(name, "cnn", list(rng.uniform(0.5, 2.0, 40)), 0.1, 0.9, 1.0, 1.0, 1.0,
                     1.0, 10, "")
        for name in train.ALGORITHMS
    ]  # fmt: skip
    fig = train.plot_losses(results, str(tmp_path / "loss.png"), "six")
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    _check_plot(fig, list(train.ALGORITHMS))
    table = train.results_table(results)
    assert table.count("\n") == len(results) + 1 and "| bytegrad |" in table
    styles = [str(report.line_style(name)["linestyle"]) for name in train.ALGORITHMS]
    assert len(set(styles)) == len(styles), styles


@pytest.mark.slow
def test_transformer_pysource_every_algorithm():
    config = train.Config(
        model="transformer", steps=12, batch_size=32, nodes=2, devices_per_node=4, progress=False
    )
    # The model is what this adds to the CNN's run of every algorithm: its embeddings, norms
    # and attention under the baseline, the compressed mean, QAdam's momentum exchange and a
    # decentralized step's own copies (the other two share those paths).
    names = ("gradient_allreduce", "bytegrad", "qadam", "low_precision_decentralized")
    results = train.compare(config, algorithms=names)
    # Uniform guessing over 256 bytes is ln 256 = 5.55 nats and 0.4% accuracy.
    _check(results, min_accuracy=0.1, max_test_loss=0.8 * math.log(256), names=names)


def _run(args, tmp_path, timeout=300):
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.slow
def test_command_line(tmp_path):
    # The script sets XLA_FLAGS itself, for its default 2 x 4 simulated mesh.
    script = os.path.join(EXAMPLES, "train.py")
    proc = _run([script, "--algorithm", "bytegrad", "--steps", "3"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mesh {'node': 2, 'local': 4}" in proc.stdout
    assert "| bytegrad |" in proc.stdout
    # The communication table of the compiled step: the default wire sums uint8 codes.
    assert re.search(r"all-reduce +node +u8 ", proc.stdout), proc.stdout


@pytest.mark.slow
def test_autotune_across_two_processes_then_from_the_cache(tmp_path):
    script = os.path.join(EXAMPLES, "multihost.py")
    args = ["-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc", "1"]
    args += ["--timeout", "240", script, "--algorithm", "bytegrad", "--steps", "5", "--autotune"]
    args += ["--no-progress", "--batch-size", "32", "--out-dir", str(tmp_path)]
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # One device per node, and the CNN is one bucket at every bucket size: the wire and, on
    # the scatter-gather wire, the message size are what there is to tune (1 + 7 trials: the
    # integer wire sends one psum per bucket, whatever the message size).
    trials = (tmp_path / "autotune_cnn_bytegrad.md").read_text()
    assert trials.count("| wire=scatter_gather bucket_bytes=32MiB message_bytes=") == 7
    assert trials.count("| wire=allreduce bucket_bytes=32MiB message_bytes=") == 1
    assert "chosen" in trials
    assert proc.stdout.count("autotune was") == 1  # process 0 reports tuning's share
    cache = (tmp_path / "autotune.json").read_text()
    assert "bytegrad mesh=node=2,local=1 processes=2" in cache

    written = (tmp_path / "autotune_cnn_bytegrad.md").stat().st_mtime_ns
    again = _run(args, tmp_path)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"autotune read {tmp_path / 'autotune.json'}" in again.stdout
    assert (tmp_path / "autotune_cnn_bytegrad.md").stat().st_mtime_ns == written  # no trials


def _table(stdout: str) -> dict[str, list[str]]:
    """Process 0's results table, by algorithm: its cells."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("[rank 0] | ") and "%" in line:
            cells = [cell.strip() for cell in line.split("|")[1:-1]]
            rows[cells[0]] = cells
    return rows


# Every algorithm on 2 processes x 2 devices, 60 steps of a global batch of 32: 89.1-92.5% test
# accuracy here (low_precision_decentralized 89.1%, async 92.5%; 88.6-92.2% at 100 steps), against
# the tests' bar of 80%. 60 steps give QAdam 12 warm-up steps, above configs.QADAM_MIN_WARMUP.
TWO_PROCESSES = ["-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc", "2"]
TWO_PROCESSES += ["--timeout", "540", os.path.join(EXAMPLES, "multihost.py"), "--steps", "60"]
TWO_PROCESSES += ["--no-progress", "--batch-size", "32"]


@pytest.fixture(scope="module")
def six_algorithms(tmp_path_factory):
    """The output of every algorithm in one launch, state replicated, and its directory."""
    out = tmp_path_factory.mktemp("six")
    proc = _run([*TWO_PROCESSES, "--out-dir", str(out)], out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, out


@pytest.mark.slow
def test_all_six_algorithms_in_one_command_across_two_processes(six_algorithms):
    # The one entry point, one loop: every algorithm, async included, in one launch.
    proc, out = six_algorithms
    stdout = proc.stdout
    assert "mesh {'node': 2, 'local': 2} on 2 process(es)" in stdout
    # Only process 0 prints the table, and only its Gloo connection lines show.
    assert stdout.count("| bytegrad |") == 1
    assert "[rank 1] [Gloo]" not in stdout + proc.stderr
    rows = _table(stdout)
    assert set(rows) == set(train.ALGORITHMS), stdout[-3000:]
    for name, row in rows.items():
        accuracy = float(row[1].rstrip("%"))
        assert accuracy > 80.0, (name, row)  # chance is 10%
    # Async's inter-node bytes are its background rounds': above zero only if they ran.
    assert float(rows["async"][4].split()[0].replace(",", "")) > 0, rows["async"]
    assert (out / "cnn_loss.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_sharded_state_across_two_processes_trains_as_the_replicated_one(six_algorithms, tmp_path):
    """--shard params on 2 processes: QAdam (both phases, its state split within the node) ends
    where the replicated run of every algorithm ended. One algorithm: this is the example's
    --shard path across processes; every algorithm sharded is checked in test_sharding.py (one
    process) and test_multiprocess_sharding.py (two, bit-identical), the skip reasons of the
    others in test_shard_with_an_algorithm_that_keeps_a_copy_per_device_is_a_usage_error, and
    the comparison's "skipped" line by test_readme's run of train.py."""
    args = [*TWO_PROCESSES, "--algorithm", "qadam", "--shard", "params"]
    proc = _run([*args, "--out-dir", str(tmp_path)], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "on 2 process(es), cpu, state sharded within each node: params;" in proc.stdout
    # Only process 0 prints.
    assert "[rank 1] |" not in proc.stdout and proc.stdout.count("| qadam |") == 1
    got, want = _table(proc.stdout), _table(six_algorithms[0].stdout)
    assert set(got) == {"qadam"}, proc.stdout[-3000:]
    row, replicated = got["qadam"], want["qadam"]
    accuracy, test_loss, train_loss = float(row[1].rstrip("%")), float(row[2]), float(row[3])
    accuracy0, test_loss0, train_loss0 = (float(replicated[i].rstrip("%")) for i in (1, 2, 3))
    # Between nodes the same bytes cross (the 4th and 5th columns).
    assert row[4:6] == replicated[4:6], (row, replicated)
    # Compressed: each device's blocks group other values than the replicated buckets, so the
    # codes differ by up to a step and the runs drift apart by Adam's steps. Measured: at 150
    # steps (ByteGrad and QAdam) final train loss 3% apart, test loss 6%, the same accuracy; at
    # 100 (QAdam) 0.1%, 0.1% and 0.8 points; at 60 (QAdam) 0.7%, 0.2% and 0.3 points.
    assert abs(accuracy - accuracy0) <= 1.5, (row, replicated)
    assert test_loss == pytest.approx(test_loss0, rel=0.15), (row, replicated)
    assert train_loss == pytest.approx(train_loss0, rel=0.1), (row, replicated)


def test_short_qadam_warmup_is_flagged():
    # 30 steps give QAdam 6 warm-up steps, after which it diverged on the CNN (13% accuracy).
    short = configs.qadam_warning(train.Config(algorithm="qadam", steps=30))
    assert "warm-up of 6 steps (20% of 30)" in short and "--steps 50 or more" in short
    assert configs.qadam_warning(train.Config(algorithm="qadam", steps=50)) is None


@pytest.mark.slow
def test_a_sharded_run_resumes_from_its_checkpoint(tmp_path):
    # The checkpoint restores onto the state's own shardings: split leaves stay split (onto
    # the mesh, replicated, the step refused the restored state).
    config = train.Config(
        algorithm="bytegrad", shard="params", steps=4, batch_size=32, nodes=2,
        devices_per_node=4, progress=False, checkpoint_dir=str(tmp_path), checkpoint_every=2,
    )  # fmt: skip
    # baseline: gradient_allreduce's bytes, which this does not check, so its step is not compiled.
    first = train.train_and_evaluate(config, baseline=1.0)
    again = train.train_and_evaluate(dataclasses.replace(config, steps=6), baseline=1.0)
    assert (len(first.losses), len(again.losses)) == (4, 2)  # resumed after step 4
    assert sorted(p.name for p in (tmp_path / "bytegrad").iterdir()) == ["2", "4", "6"]
    # It went on from the trained state, not from the start.
    assert max(again.losses) < first.losses[0], (first.losses, again.losses)


def test_shard_with_an_algorithm_that_keeps_a_copy_per_device_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--algorithm", "decentralized", "--shard", "params"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--shard params applies to gradient_allreduce, bytegrad, qadam, diloco; decen" in err
    # Without --algorithm, the comparison runs the three and says why it skips the others.
    config = train.Config(shard="optimizer")
    assert [n for n in train.ALGORITHMS if train.skip_reason(config, n) is None] == [
        "gradient_allreduce",
        "bytegrad",
        "qadam",
    ]
    for name in ("decentralized", "low_precision_decentralized"):
        assert "--shard optimizer: it keeps its own copy" in train.skip_reason(config, name)


@pytest.mark.slow  # loads the digits, compiles the baseline's step and DiLoCo's two programs
def test_diloco_runs_by_name_and_not_in_the_comparison():
    # --algorithm diloco trains; --compare (the README's table) runs Bagua's six only.
    args = train.parse_args(["--algorithm", "diloco", "--diloco-inner-steps", "2", "--steps", "4"])
    config = dataclasses.replace(train.config_from_args(args), progress=False, batch_size=64)
    assert config.algorithm == "diloco" and config.diloco_inner_steps == 2
    # The outer step docs/diloco.md recommends for small H: Nesterov 0.7 / 0.6, whose first
    # update of a pseudo-gradient g is -0.7 (1 + 0.6) g.
    outer = train.RUNNABLE["diloco"].kwargs(config)["outer_optimizer"]
    update, _ = outer.update(np.ones(3, np.float32), outer.init(np.zeros(3, np.float32)))
    np.testing.assert_allclose(update, -1.12, rtol=1e-6)
    result = train.train_and_evaluate(config)
    assert len(result.losses) == 4 and np.isfinite(result.test_loss)
    assert 0 < result.node_bytes_average < result.baseline_node_bytes  # every 2nd step only
    assert "diloco" not in train.ALGORITHMS


def test_async_needs_several_processes():
    with pytest.raises(ValueError, match="averages the model across processes"):
        train.train_and_evaluate(train.Config(algorithm="async", steps=2, progress=False))


@pytest.mark.parametrize("script", ["train.py", "multihost.py"])
def test_async_on_one_process_is_a_usage_error(script, tmp_path):
    # --help offers async; alone it gets argparse's usage error, with the command that runs it.
    proc = _run([os.path.join(EXAMPLES, script), "--algorithm", "async"], tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("usage: "), proc.stderr[-3000:]
    assert f"{script}: error: --algorithm async needs 2 or more processes" in proc.stderr
    assert "python -m jax_bytegrad.launch --nproc 2" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
