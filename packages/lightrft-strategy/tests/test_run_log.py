"""The run log: metrics.jsonl, TensorBoard scalars, the plot, rank 0 only, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightrft.strategy.run_log import RunLog, plot_metrics, read_metrics


def _scalars(directory: Path, key: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()
    return {e.step: e.value for e in events.Scalars(key)}


def test_rank_0_writes_jsonl_and_tensorboard_and_a_resume_rewrites_the_tail(tmp_path: Path) -> None:
    log = RunLog(tmp_path, rank=0, steps=4, tensorboard=True)
    log.log(0, {"accuracy": 0.0})  # a row before the first step (an evaluation)
    for step in (1, 2, 3):
        log.log(step, {"reward": step / 10, "phase": "rl", "ok": True})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[3] == {"step": 3, "reward": 0.3, "phase": "rl",
                                                          "ok": True}  # fmt: skip
    assert _scalars(tmp_path / "tensorboard", "reward") == pytest.approx({1: 0.1, 2: 0.2, 3: 0.3})
    # resumed after step 1: steps 2 and 3 are rewritten, once each
    log = RunLog(tmp_path, rank=0, steps=4, first=2, tensorboard=True)
    for step in (2, 3, 4):
        log.log(step, {"reward": step})
    log.close()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("reward")) for r in rows] == [
        (0, None),
        (1, 0.1),
        (2, 2),
        (3, 3),
        (4, 4),
    ]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    log = RunLog(tmp_path / "run", rank=1, steps=2, tensorboard=True)
    log.log(1, {"reward": 1.0})
    log.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_takes_a_directory_as_upstreams_use_tensorboard(tmp_path: Path) -> None:
    log = RunLog(tmp_path, rank=0, steps=1, tensorboard=str(tmp_path / "tb"))
    log.log(1, {"loss": 0.5})
    log.close()
    assert log.tensorboard_dir == tmp_path / "tb"
    assert _scalars(tmp_path / "tb", "loss") == {1: 0.5}


def test_plot_has_one_panel_per_kind_with_a_legend(tmp_path: Path) -> None:
    rows = [{"step": s, "reward": s / 10, "kl": 0.01 * s} for s in range(1, 6)]
    rows[-1]["held_out_accuracy"] = 0.5
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = plot_metrics(read_metrics(tmp_path / "m.jsonl"), tmp_path / "plot.png",
                        {"fraction": ["reward", "held_out_accuracy"], "KL": ["kl"],
                         "absent": ["nothing"]})  # fmt: skip
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from matplotlib import image

    height, width, _ = image.imread(path).shape
    assert (width, height) == (1200, 300)  # two panels side by side: the absent one dropped


def test_samples_go_to_jsonl_and_tensorboard_text_and_a_resume_drops_the_later_ones(
    tmp_path: Path,
) -> None:
    log = RunLog(tmp_path, rank=0, steps=3, tensorboard=True)
    for step in (1, 2, 3):
        log.log_samples(step, [{"prompt": "1+1=", "completion": f"{step} | x", "reward": 0.0}])
    log.close()
    rows = read_metrics(tmp_path / "samples.jsonl")
    assert [(r["step"], r["kind"], r["completion"]) for r in rows] == [
        (1, "rollout", "1 | x"), (2, "rollout", "2 | x"), (3, "rollout", "3 | x")
    ]  # fmt: skip
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    text = events.Tensors("samples/rollout/text_summary")
    assert [e.step for e in text] == [1, 2, 3]
    table = text[0].tensor_proto.string_val[0].decode()
    assert "| prompt | completion | reward |" in table and "1 \\| x" in table
    resumed = RunLog(tmp_path, rank=0, steps=3, first=2)
    resumed.close()
    assert [r["step"] for r in read_metrics(tmp_path / "samples.jsonl")] == [1]


def test_evaluations_are_markers_without_a_line_and_log_panels_are_log_scaled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from matplotlib.figure import Figure

    drawn: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: drawn.append(self))
    # a warm-up (steps 1-14, its loss) then RL (steps 15-20): each phase's own metrics are
    # lines over their span; the evaluations (every 5 steps) markers
    rows = [{"step": s, "sft_loss": 1 / s} for s in range(1, 15)]
    rows += [{"step": s, "reward": s / 10, "rollout_kl": 1e-11 * s} for s in range(15, 21)]
    for row in rows[::5]:
        row["held_out_accuracy"] = 0.5
    plot_metrics(rows, tmp_path / "plot.png",
                 {"fraction": ["reward", "held_out_accuracy"], "mismatch": ["rollout_kl"]},
                 log_scale=["mismatch"])  # fmt: skip
    fraction, mismatch = drawn[0].axes
    lines = {line.get_label(): line for line in fraction.get_lines()}
    assert lines["reward"].get_linestyle() == "-"
    assert lines["held_out_accuracy"].get_linestyle() == "None"
    assert lines["held_out_accuracy"].get_marker() not in (None, "None", "")
    assert (fraction.get_yscale(), mismatch.get_yscale()) == ("linear", "log")
