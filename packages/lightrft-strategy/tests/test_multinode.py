"""A 2-node job simulated on loopback: torchrun --nnodes 2, one process per node."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lightrft.testing.launcher import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "two_node_train.py"


@pytest.mark.timeout(400)
def test_two_nodes_train_and_checkpoint(tmp_path: Path) -> None:
    nodes = run_torchrun(SCRIPT, str(tmp_path), nnodes=2, nproc_per_node=1, timeout=360)
    assert len(nodes) == 2
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["world_size"] == 2
    assert report["launcher"] == "torchrun"
    assert report["ranks"] == [0, 1]
    assert len(report["losses"]) == 2 and all(math.isfinite(x) for x in report["losses"])
    assert report["reload_identical"] is True
    assert (tmp_path / "ckpt" / report["checkpoint"] / "lightrft_checkpoint.json").is_file()
