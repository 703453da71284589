"""Multimodal prompts: upstream's nested and flat shapes give one canonical form; counts
that disagree name the prompt; modalities register without touching engine code."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lightrft.engines.multimodal import (
    MODALITIES,
    MediaError,
    Modality,
    build_multimodal_inputs,
    media_per_prompt,
    prompt_media,
    register_modality,
    unregister_modality,
)

A, B, C, D = "a.png", "b.png", "c.png", "d.png"


def test_nested_and_flat_shapes_give_the_same_lists_in_order() -> None:
    nested = media_per_prompt(3, [[A, B], [C], []], [2, 1, 0])
    flat = media_per_prompt(3, [A, B, C], [2, 1, 0])
    assert nested == flat == [[A, B], [C], []]
    assert media_per_prompt(3, [[A, B], None, [C]], None) == [[A, B], [], [C]]  # no counts
    assert media_per_prompt(2, None, None) == [[], []]
    # one list per prompt that does not match the counts, but flat does: flat wins
    # (a video given as a list of frames, one video per prompt)
    frames = [[A, B], [C, D]]
    assert media_per_prompt(2, frames, [1, 1], kind="video") == [[[A, B]], [[C, D]]]


@pytest.mark.parametrize(
    ("items", "counts", "message"),
    [
        ([[A, B], [C]], [2, 2], r"prompt 1: image count 2 but its list has 1 image"),
        ([A, B, C], [2, 2], r"prompt 1: image count 2 but only 1 image\(s\) are left of the 3"),
        ([A, B, C, D], [2, 1], r"add up to 3 but 4 image\(s\) .* 1 would belong to no prompt"),
        ([A, B, C], None, r"3 image\(s\) for 2 prompts without per-prompt counts"),
        ([[A], [B]], [1], r"1 image counts for 2 prompts"),
        ([[A], [B]], [1, -1], r"prompt 1: image count -1 is not an int >= 0"),
        (None, [0, 2], r"prompt 1: image count 2 but no images were given"),
    ],
)
def test_counts_that_disagree_name_the_prompt(items: object, counts: object, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        media_per_prompt(2, items, counts)  # type: ignore[arg-type]


def test_canonical_prompts_keep_every_item_and_the_prompt_form() -> None:
    out = build_multimodal_inputs(
        ["text", [5, 6], {"prompt_token_ids": [7], "multi_modal_data": {"image": [D]}}],
        {"image": ([[A, B], [], [C]], None), "video": ([B], [0, 1, 0])},
    )
    assert out[0] == {"prompt": "text", "multi_modal_data": {"image": [A, B]}}
    assert out[1] == {"prompt_token_ids": [5, 6], "multi_modal_data": {"video": [B]}}
    assert out[2] == {"prompt_token_ids": [7], "multi_modal_data": {"image": [C]}}
    assert prompt_media(out[0]) == {"image": [A, B]} and prompt_media([1, 2]) == {}
    with pytest.raises(MediaError, match=r"unknown modalities \['smell'\]; registered"):
        build_multimodal_inputs(["p"], {"smell": ([[A]], None)})
    with pytest.raises(MediaError, match=r"unknown modalities \['smell'\]"):
        prompt_media({"prompt": "p", "multi_modal_data": {"smell": [A]}})


@pytest.fixture
def audio() -> Iterator[Modality]:
    modality = Modality("audio", "all_audios", "audios_num", "audio_data")
    register_modality(modality)
    yield modality
    unregister_modality("audio")


def test_a_registered_modality_is_carried_like_the_built_in_ones(audio: Modality) -> None:
    out = build_multimodal_inputs(["p0", "p1"], {"audio": (["x.wav", "y.wav"], [2, 0])})
    assert out == [{"prompt": "p0", "multi_modal_data": {"audio": ["x.wav", "y.wav"]}},
                   {"prompt": "p1"}]  # fmt: skip
    assert prompt_media(out[0]) == {"audio": ["x.wav", "y.wav"]}
    with pytest.raises(
        ValueError, match=r"keyword\(s\) \['all_images'\] already belong to 'image'"
    ):
        register_modality(Modality("scan", "all_images", "scans_num"))
    with pytest.raises(ValueError, match="built in"):
        unregister_modality("image")
    assert set(MODALITIES) == {"image", "video", "audio"}
