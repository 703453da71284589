"""Generation on the rollout engine (:mod:`lightrft.strategy.engine_link.generation`):
prompts checked and split over the engine's tensor-parallel groups, ``engine_generate_local``,
upstream's multimodal inputs and other modalities, against lightrft-testing's FakeEngine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from lightrft.engines import PromptError, SamplingParams
from lightrft.strategy.fsdp2 import FSDP2Strategy
from lightrft.testing import FakeEngine
from lightrft.testing.launcher import run_distributed

from . import workers


def test_engine_generate_local_and_bad_prompts_name_rank_index_and_limit(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    strategy.setup_inference_engine(FakeEngine(vocab_size=16))
    local = strategy.engine_generate_local(
        SamplingParams(max_new_tokens=2), prompt_token_ids=[[1], [2, 3]]
    )
    assert [o.prompt_token_ids for o in local] == [[1], [2, 3]]
    with pytest.raises(ValueError, match="exactly one of prompt_token_ids and multi_modal_inputs"):
        strategy.engine_generate_local(SamplingParams(), None, None)
    with pytest.raises(PromptError, match=r"prompt 1 of rank 0: token id 16 \(position 1\) "
                       r"is outside the vocabulary of 16"):  # fmt: skip
        strategy.gather_and_generate([[1], [2, 16]])
    with pytest.raises(PromptError, match="prompt 0 of rank 0: a prompt is a non-empty list"):
        strategy.gather_and_generate([[]])


def test_gather_and_generate_without_prompts_says_how_to_call_it(
    single: Callable[..., FSDP2Strategy],
) -> None:
    strategy = single()
    strategy.setup_inference_engine(FakeEngine())
    with pytest.raises(TypeError, match="got no prompts"):
        strategy.gather_and_generate([1, 2, 3])  # one prompt, not a list of prompts
    with pytest.raises(TypeError, match="got no prompts"):
        strategy.gather_and_generate(SamplingParams())


def test_upstream_multimodal_inputs_nested_or_flat() -> None:
    from lightrft.engines.multimodal import MediaError
    from lightrft.strategy.engine_link import build_multimodal_inputs

    a, b, c, v = "a.png", "b.png", "c.png", "v.mp4"
    nested = build_multimodal_inputs(["p0", "p1", "p2"], [[a, b], [c], None], [2, 1, 0],
                                     None, None)  # fmt: skip
    flat = build_multimodal_inputs(["p0", "p1", "p2"], [a, b, c], [2, 1, 0], [v], [0, 0, 1])
    assert nested[0] == {"prompt": "p0", "multi_modal_data": {"image": [a, b]}}
    assert nested[1] == {"prompt": "p1", "multi_modal_data": {"image": [c]}}
    assert nested[2] == {"prompt": "p2"}
    assert flat[:2] == nested[:2]
    assert flat[2] == {"prompt": "p2", "multi_modal_data": {"video": [v]}}
    # nested without counts keeps every image (upstream's code dropped them all)
    no_counts = build_multimodal_inputs(["p0", "p1"], [[a, b], [c]], None, None, None)
    assert [x["multi_modal_data"]["image"] for x in no_counts] == [[a, b], [c]]
    with pytest.raises(MediaError, match=r"prompt 1: image count 2 but only 1 image"):
        build_multimodal_inputs(["p0", "p1"], [a, b, c], [2, 2], None, None)
    # as upstream: a templated prompt left without images loses its vision placeholders
    text = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>Describe."
    assert build_multimodal_inputs([text], [None], [0], None, None) == [{"prompt": "Describe."}]


def test_another_modality_goes_through_gather_and_generate_by_its_keywords(
    single: Callable[..., FSDP2Strategy],
) -> None:
    from lightrft.engines.multimodal import Modality, register_modality, unregister_modality

    strategy = single()
    engine = strategy.setup_inference_engine(FakeEngine())
    with pytest.raises(TypeError, match=r"unexpected keyword\(s\) \['all_audios'\]"):
        strategy.gather_and_generate(SamplingParams(), all_prompt_token_ids=[[1]],
                                     all_audios=[["x.wav"]])  # fmt: skip
    register_modality(Modality("audio", "all_audios", "audios_num", "audio_data"))
    try:
        strategy.gather_and_generate(SamplingParams(), all_prompt_token_ids=[[1], [2]],
                                     all_audios=["x.wav", "y.wav"], audios_num=[0, 2])  # fmt: skip
    finally:
        unregister_modality("audio")
    assert engine.last_prompts == [
        {"prompt_token_ids": [1]},
        {"prompt_token_ids": [2], "multi_modal_data": {"audio": ["x.wav", "y.wav"]}},
    ]


@pytest.mark.distributed
def test_every_image_of_every_rank_reaches_the_engine_in_order() -> None:
    cfg = workers.config(engine_tp_size=2)
    ranks = run_distributed(workers.multimodal_gather_case, 2, cfg, init_process_group=False)
    expected = [
        {"prompt_token_ids": [1], "multi_modal_data": {"image": ["r0p0a", "r0p0b"]}},
        {"prompt_token_ids": [2], "multi_modal_data": {"image": ["r0p1a"]}},
        {"prompt_token_ids": [3], "multi_modal_data": {"image": ["r1p0a", "r1p0b", "r1p0c"]}},
    ]
    for r in ranks:  # the engine of each rank of the group got the group's prompts
        assert r["seen"] == expected
        assert r["calls_after_error"] == 0
    assert ranks[0]["mine"] == [[1], [2]] and ranks[1]["mine"] == [[3]]
    for r in ranks:  # both ranks refuse, naming rank 1
        assert "rank 1: the image counts add up to 1 but 2 image(s)" in r["error"]


@pytest.mark.distributed
def test_a_bad_prompt_is_refused_by_every_rank_of_the_tp_group_before_generating() -> None:
    cfg = workers.config(engine_tp_size=2)
    ranks = run_distributed(workers.tp_group_bad_prompt_case, 2, cfg, init_process_group=False)
    for r in ranks:
        assert r["error"] is not None and "prompt 1 of rank 1: token id 99" in r["error"]
        assert r["calls_after_error"] == 0  # nobody generated
    assert ranks[0]["prompts"] == [[4], [5]] and ranks[1]["prompts"] == [[3]]
