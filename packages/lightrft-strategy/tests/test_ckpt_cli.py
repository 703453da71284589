"""``lightrft ckpt`` on real FSDP2 checkpoints written by 2-rank gloo jobs, through the
installed console script in a subprocess: info, export to Hugging Face (equal to
``save_model``'s export, same logits in transformers, the tokenizer save_ckpt recorded or
``--tokenizer``'s), conversion that resumes exactly, and bad input (truncated, corrupt,
foreign, occupied OUT, killed runs, a directory without a tokenizer)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from lightrft.strategy import CheckpointError, StrategyBase
from lightrft.strategy.checkpoint.tools.staging import staged_output
from lightrft.testing.launcher import run_distributed
from tests import workers

LIGHTRFT = str(Path(sys.executable).with_name("lightrft"))


def run_cli(*args: str | Path, ok: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [LIGHTRFT, *map(str, args)], capture_output=True, text=True, timeout=600
    )
    if ok and result.returncode != 0:
        raise AssertionError(f"lightrft {args} failed:\n{result.stdout}\n{result.stderr}")
    return result


def hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def logits_of(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(directory))
    ids = torch.arange(24).reshape(2, 12) % 128
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def fsdp2_hf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A save_dir (saved with the tiny tokenizer) and save_model's export of the same
    tiny Qwen2, after 2 FSDP2 steps."""
    root = tmp_path_factory.mktemp("fsdp2_hf")
    cfg = workers.config(train_batch_size=2, micro_train_batch_size=1)
    run_distributed(
        workers.hf_checkpoint_case, 2, cfg, str(root / "ckpt"), str(root / "hf"),
        tokenizer=True, timeout=300,
    )  # fmt: skip
    return root / "ckpt", root / "hf"


def test_export_equals_save_model_and_gives_identical_logits_and_the_tokenizer(
    fsdp2_hf: tuple[Path, Path], tmp_path: Path
) -> None:
    save_dir, saved_model = fsdp2_hf
    out = tmp_path / "exported"
    result = run_cli("ckpt", "export", save_dir, "--to", "hf", out, "--no-progress")
    expected = hf_weights(saved_model)
    assert f"{len(expected)} tensors" in result.stdout
    assert "tokenizer from" in result.stdout and "no tokenizer" not in result.stderr
    (tag,) = [p for p in save_dir.iterdir() if p.is_dir()]
    workers.assert_tokenizer_of(out, tag / "tokenizer")  # OUT loads as it is
    assert f"verified {len(expected)} tensors, max abs diff 0" in result.stdout
    exported = hf_weights(out)
    assert exported.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(exported[name], tensor), name
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2"
    torch.testing.assert_close(logits_of(out), logits_of(saved_model), rtol=0, atol=0)
    assert not list(tmp_path.glob(".exported.partial-*"))  # the staging dir was renamed


def test_info_reports_tags_latest_and_incomplete_ones(
    fsdp2_hf: tuple[Path, Path], tmp_path: Path
) -> None:
    save_dir = tmp_path / "ckpt"
    shutil.copytree(fsdp2_hf[0], save_dir)
    (tag,) = [p for p in save_dir.iterdir() if p.is_dir()]
    broken = save_dir / "global_step9"
    shutil.copytree(tag, broken)
    shard = broken / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    (save_dir / ".global_step11.partial").mkdir()

    found = json.loads(run_cli("ckpt", "info", save_dir, "--json").stdout)
    assert found["latest"] == tag.name and found["latest_complete"] is True
    entries = {entry["tag"]: entry for entry in found["tags"]}
    good = entries[tag.name]
    assert good["complete"] is True
    assert (good["backend"], good["world_size"], good["global_step"]) == ("fsdp2", 2, 2)
    assert good["has_optimizer"] and good["has_scheduler"] and good["hf_config"]
    assert good["tokenizer"] is True
    assert good["model_class"] == "transformers.models.qwen2.modeling_qwen2.Qwen2ForCausalLM"
    assert good["size_bytes"] == sum(
        p.stat().st_size
        for p in tag.rglob("*")
        if p.is_file() and p.name != "lightrft_checkpoint.json"
    )
    assert entries["global_step9"]["complete"] is False
    assert "__1_0.distcp has 100 bytes" in entries["global_step9"]["problem"]
    assert found["interrupted_saves"] == ["global_step11"]
    text = run_cli("ckpt", "info", save_dir).stdout
    assert "global_step9: INCOMPLETE" in text and "an interrupted save" in text
    assert "HF config: yes; tokenizer: yes" in text


def _bad_export(source: Path, out: Path, *extra: str) -> str:
    result = run_cli("ckpt", "export", source, "--to", "hf", out, "--no-progress", *extra, ok=False)
    assert result.returncode == 1, result
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.partial-*"))
    return result.stderr


def test_truncated_corrupt_and_foreign_inputs_are_refused(
    fsdp2_hf: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    truncated = tmp_path / "truncated"
    shutil.copytree(fsdp2_hf[0], truncated)
    (tag,) = [p for p in truncated.iterdir() if p.is_dir()]
    shard = tag / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-10])
    error = _bad_export(truncated, out)
    assert "IncompleteCheckpointError" in error and "__0_0.distcp" in error
    assert "truncated" in error

    corrupt = tmp_path / "corrupt"
    shutil.copytree(fsdp2_hf[0], corrupt)
    meta = next(corrupt.glob("*/dcp/.metadata"))
    meta.write_bytes(b"\x80\x04not a pickle" + b"\0" * (meta.stat().st_size - 14))
    error = _bad_export(corrupt, out)
    assert "cannot read the DCP files" in error and "dcp" in error

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "pytorch_model.bin").write_bytes(b"x" * 10)
    error = _bad_export(foreign, out)
    assert "CheckpointNotFoundError" in error and "no 'latest' file" in error
    plain_ds = tmp_path / "plain_deepspeed"
    (plain_ds / "global_step1").mkdir(parents=True)
    (plain_ds / "global_step1" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (plain_ds / "latest").write_text("global_step1")
    error = _bad_export(plain_ds, out)
    assert "ForeignCheckpointError" in error and "plain DeepSpeed checkpoint" in error

    missing = tmp_path / "missing"
    assert "does not exist" in _bad_export(missing, out)


def test_tokenizer_option_for_a_checkpoint_without_one_and_bad_tokenizer_paths(
    fsdp2: StrategyBase, tmp_path: Path
) -> None:
    """Without a recorded tokenizer the export works and says how to add one;
    ``--tokenizer DIR`` adds it; a DIR without a tokenizer is named, with the fix, and
    nothing is written."""
    from lightrft.strategy.checkpoint.tools.export import export_hf
    from lightrft.strategy.checkpoint.tools.offline import open_checkpoint
    from lightrft.testing.models import tiny_hf_causal_lm

    model = fsdp2.prepare_model(tiny_hf_causal_lm(), is_training=True)
    save_dir = fsdp2.save_ckpt(model, tmp_path / "ckpt").parent  # one rank, no tokenizer
    plain = tmp_path / "plain"
    result = run_cli("ckpt", "export", save_dir, "--to", "hf", plain, "--no-progress")
    assert "note: no tokenizer was written" in result.stderr and "--tokenizer DIR" in result.stderr
    assert sorted(p.name for p in plain.iterdir()) == ["config.json", "model.safetensors"]

    workers.tiny_tokenizer().save_pretrained(str(tmp_path / "tok"))
    out = tmp_path / "with_tokenizer"
    result = run_cli("ckpt", "export", save_dir, "--to", "hf", out, "--no-progress",
                     "--tokenizer", tmp_path / "tok")  # fmt: skip
    assert f"tokenizer from {tmp_path / 'tok'}" in result.stdout
    assert "no tokenizer" not in result.stderr
    workers.assert_tokenizer_of(out, tmp_path / "tok")
    torch.testing.assert_close(logits_of(out), logits_of(plain), rtol=0, atol=0)

    # a model directory without a tokenizer: the error names it and the fix
    error = _bad_export(save_dir, tmp_path / "out", "--tokenizer", str(plain))
    assert f"--tokenizer {plain} holds no tokenizer" in error and "save_pretrained" in error
    source = open_checkpoint(save_dir)
    with pytest.raises(CheckpointError, match=r"--tokenizer .*nowhere: no such directory"):
        export_hf(source, tmp_path / "out", tokenizer=tmp_path / "nowhere")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"broken: transformers' AutoTokenizer cannot"):
        export_hf(source, tmp_path / "out", tokenizer=tmp_path / "broken")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_an_occupied_output_is_refused_without_force(
    fsdp2_hf: tuple[Path, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = run_cli("ckpt", "export", fsdp2_hf[0], "--to", "hf", out, ok=False)
    assert result.returncode == 1 and "--force" in result.stderr
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    run_cli("ckpt", "export", fsdp2_hf[0], "--to", "hf", out, "--force", "--no-progress")
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_a_failed_or_killed_write_leaves_no_output(tmp_path: Path) -> None:
    out = tmp_path / "out"

    def fail_half_way() -> None:
        with staged_output(out, force=False) as staging:
            (staging / "half.bin").write_bytes(b"x")
            raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        fail_half_way()
    assert not out.exists() and list(tmp_path.iterdir()) == []

    code = (
        "import os, signal, sys; from pathlib import Path\n"
        "from lightrft.strategy.checkpoint.tools.staging import staged_output\n"
        "with staged_output(Path(sys.argv[1]), force=False) as staging:\n"
        "    (staging / 'half.bin').write_bytes(b'x')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code, str(out)], timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()
    (left,) = tmp_path.iterdir()  # the killed run's staging directory, not OUT
    assert left.name.startswith(".out.partial-")
    with staged_output(out, force=False) as staging:  # the next run clears it
        (staging / "done.bin").write_bytes(b"y")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert (out / "done.bin").read_bytes() == b"y"


def test_fsdp2_conversion_resumes_exactly(tmp_path: Path) -> None:
    """N steps, save, convert (the DCP files rewritten from full tensors), M steps ==
    N+M steps; and a world-size change refuses to carry RNG state unless dropped."""
    cfg = workers.config()
    run = {"max_steps": 6, "timeout": 300}
    full = run_distributed(workers.train, 2, cfg, 6, **run)
    run_distributed(workers.train, 2, cfg, 3, save_dir=str(tmp_path / "a"), **run)
    result = run_cli("ckpt", "convert", tmp_path / "a", "--to", "fsdp2", tmp_path / "b")
    assert "max abs diff 0" in result.stdout
    second = run_distributed(workers.train, 2, cfg, 3, load_dir=str(tmp_path / "b"), **run)
    assert second[0]["losses"] == full[0]["losses"][3:]
    workers.assert_states_close(second[0]["state"], full[0]["state"], rtol=0, atol=0)
    meta = json.loads((tmp_path / "b" / "global_step3" / "lightrft_checkpoint.json").read_text())
    assert meta["converted_from"]["backend"] == "fsdp2" and meta["world_size"] == 2

    refused = run_cli(
        "ckpt",
        "convert",
        tmp_path / "a",
        "--to",
        "fsdp2",
        tmp_path / "c",
        "--world-size",
        "1",
        ok=False,
    )
    assert refused.returncode == 1 and "--drop rng" in refused.stderr
    assert not (tmp_path / "c").exists()
    assert os.listdir(tmp_path / "a")  # the source is untouched


def test_state_that_cannot_be_carried_is_named_and_refused(
    fsdp2_hf: tuple[Path, Path], tmp_path: Path
) -> None:
    """An optimizer whose state is not Adam's is refused unless dropped; dropped, the
    conversion carries the weights and says what it left behind."""
    source = tmp_path / "sgd"
    shutil.copytree(fsdp2_hf[0], source)
    meta_file = next(source.glob("*/lightrft_checkpoint.json"))
    meta = json.loads(meta_file.read_text())
    meta["optimizer"] = "torch.optim.sgd.SGD"  # as an SGD run would record it
    meta_file.write_text(json.dumps(meta))
    out = tmp_path / "out"
    refused = run_cli("ckpt", "convert", source, "--to", "fsdp2", out, ok=False)
    assert refused.returncode == 1
    assert "optimizer: the optimizer is torch.optim.sgd.SGD" in refused.stderr
    assert "--drop optimizer" in refused.stderr and not out.exists()
    done = run_cli("ckpt", "convert", source, "--to", "fsdp2", out, "--drop", "optimizer")
    assert "dropped: optimizer" in done.stdout
    info = json.loads(run_cli("ckpt", "info", out, "--json").stdout)
    assert info["tags"][0]["has_optimizer"] is False
    assert info["tags"][0]["tokenizer"] is True  # carried, and listed in the metadata
    workers.assert_tokenizer_of(out / info["tags"][0]["tag"] / "tokenizer")


def test_verification_compares_bits_not_summaries() -> None:
    from lightrft.strategy.checkpoint.tools.verify import Verification, VerificationError

    nan, inf = float("nan"), float("inf")
    check = Verification()
    check.check("same", torch.tensor([nan, 1.0, -inf]), torch.tensor([nan, 1.0, -inf]))
    assert check.problems == [] and check.max_abs_diff == 0
    check.check("nan hides nothing", torch.tensor([nan, 1.0, 2.0]), torch.tensor([nan, 1.0, 7.0]))
    check.check("inf hides nothing", torch.tensor([inf, 1.0]), torch.tensor([inf, 5.0]))
    check.check("signed zero", torch.tensor([0.0]), torch.tensor([-0.0]))
    check.check("dtype", torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    check.check("gone", torch.tensor([1.0]), None)
    assert [p.split(":")[0] for p in check.problems] == [
        "nan hides nothing",
        "inf hides nothing",
        "signed zero",
        "dtype",
        "gone",
    ]
    assert check.max_abs_diff == 5.0 and check.compared == 6
    with pytest.raises(VerificationError, match="nan hides nothing: differs by up to 5"):
        check.raise_if_failed("the test")


def test_an_output_inside_the_source_is_refused(
    fsdp2_hf: tuple[Path, Path], tmp_path: Path
) -> None:
    source = tmp_path / "ckpt"
    shutil.copytree(fsdp2_hf[0], source)
    before = sorted(str(p.relative_to(source)) for p in source.rglob("*"))
    (tag,) = [p for p in source.iterdir() if p.is_dir()]
    for out in (source, tag, tag / "exported", tmp_path):  # --force would delete the source
        result = run_cli("ckpt", "export", source, "--to", "hf", out, "--force", ok=False)
        assert result.returncode == 1 and "write to a directory outside it" in result.stderr
    assert sorted(str(p.relative_to(source)) for p in source.rglob("*")) == before
