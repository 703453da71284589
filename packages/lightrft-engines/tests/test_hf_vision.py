"""The HF engine on a tiny random vision-language model (Qwen2-VL, built from a config):
images reach the model in order, and generation equals transformers' own processor +
generate on the same prompt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightrft.engines import SamplingParams, build_engine
from lightrft.engines.hf import HFEngine
from lightrft.engines.multimodal import MediaError

IMAGE, START, END = 500, 502, 503
GREEDY = SamplingParams(max_new_tokens=6, temperature=0, logprobs=True)


def _image(seed: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(56, 56, 3) * 255).astype("uint8")


def _prompt(images: int) -> list[int]:
    return [5, *[t for _ in range(images) for t in (START, IMAGE, END)], 7, 8]


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lightrft.testing.models import save_tiny_qwen2_vl

    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))


def _engine(path: Path) -> HFEngine:
    engine = build_engine({"engine_type": "hf", "pretrain": str(path), "bf16": False,
                           "device": "cpu"})  # fmt: skip
    assert isinstance(engine, HFEngine) and engine.media_processor is not None
    return engine


def _transformers_reference(path: Path, images: list[np.ndarray], state: Any = None) -> Any:
    """transformers' Qwen2VLProcessor (a word-level tokenizer over the same ids) expands
    the text prompt's <|image_pad|>s; the model generates greedily."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        AutoImageProcessor,
        PreTrainedTokenizerFast,
        Qwen2VLForConditionalGeneration,
        Qwen2VLProcessor,
    )
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    special = {"<|image_pad|>": 500, "<|video_pad|>": 501, "<|vision_start|>": 502,
               "<|vision_end|>": 503}  # fmt: skip
    vocab = {**{f"t{i}": i for i in range(500)}, **special, "[UNK]": 504}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]",
                                   additional_special_tokens=list(special))  # fmt: skip
    images_processor = AutoImageProcessor.from_pretrained(path)
    processor = Qwen2VLProcessor(image_processor=images_processor, tokenizer=fast,
                                 video_processor=Qwen2VLVideoProcessor())  # fmt: skip
    text = " ".join(["t5", *["<|vision_start|> <|image_pad|> <|vision_end|>"] * len(images),
                     "t7", "t8"])  # fmt: skip
    inputs = processor(text=[text], images=images, return_tensors="pt")
    model: Any = Qwen2VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    if state is not None:
        model.load_state_dict(state)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_images_reach_the_model_as_transformers_processor_gives_them(vl_dir: Path) -> None:
    engine = _engine(vl_dir)
    one = {"prompt_token_ids": _prompt(1), "multi_modal_data": {"image": [_image(0)]}}
    two = {"prompt_token_ids": _prompt(2), "multi_modal_data": {"image": [_image(0), _image(1)]}}
    other = {"prompt_token_ids": _prompt(1), "multi_modal_data": {"image": [_image(2)]}}
    outs = engine.generate([one, [1, 2, 3], two, other], GREEDY)
    tokens = [o.output_token_ids for o in outs]
    assert tokens[0] == _transformers_reference(vl_dir, [_image(0)])
    assert tokens[2] == _transformers_reference(vl_dir, [_image(0), _image(1)])
    assert tokens[2] != tokens[0], "the second image changed nothing"
    assert tokens[3] != tokens[0], "another image changed nothing"
    assert [o.prompt_token_ids for o in outs] == [_prompt(1), [1, 2, 3], _prompt(2), _prompt(1)]
    assert all(o.logprobs is not None and len(o.logprobs) == 6 for o in outs)


def test_n_seeded_samples_of_a_prompt_with_images(vl_dir: Path) -> None:
    engine = _engine(vl_dir)
    prompt = {"prompt_token_ids": _prompt(1), "multi_modal_data": {"image": [_image(0)]}}
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=4)
    first = [o.output_token_ids for o in engine.generate([prompt], sampling)]
    assert len(first) == 3 and len({tuple(t) for t in first}) > 1
    assert [o.output_token_ids for o in engine.generate([prompt], sampling)] == first


def test_placeholders_that_do_not_match_the_images_name_the_prompt(vl_dir: Path) -> None:
    engine = _engine(vl_dir)
    bad = {"prompt_token_ids": _prompt(1), "multi_modal_data": {"image": [_image(0), _image(1)]}}
    with pytest.raises(MediaError, match=r"prompt 1: 1 image placeholder token\(s\) \(id 500\) "
                       r"for 2 image\(s\); put one placeholder per image"):  # fmt: skip
        engine.generate([[1], bad], GREEDY)
    from lightrft.engines.multimodal import Modality, register_modality, unregister_modality

    register_modality(Modality("audio", "all_audios", "audios_num"))
    try:
        sound = {"prompt_token_ids": [5], "multi_modal_data": {"audio": ["x.wav"]}}
        with pytest.raises(MediaError, match=r"prompt 0: the hf engine has no processor for "
                           r"'audio' items \(it has \['image', 'video'\]\)"):  # fmt: skip
            engine.generate([sound], GREEDY)
    finally:
        unregister_modality("audio")


def test_videos_reach_the_model_too(vl_dir: Path) -> None:
    engine = _engine(vl_dir)

    def video(seed: int) -> dict[str, Any]:
        frames = [_image(seed), _image(seed + 1)]  # two frames: one temporal patch
        return {
            "prompt_token_ids": [5, START, 501, END, 7],
            "multi_modal_data": {"video": [frames]},
        }

    outs = engine.generate([video(0), video(5), video(0)], GREEDY)
    tokens = [o.output_token_ids for o in outs]
    assert tokens[0] == tokens[2] and tokens[0] != tokens[1], "the video changed nothing"


def test_a_weight_sync_reaches_the_vision_tower_too(vl_dir: Path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    engine = _engine(vl_dir)
    prompt = {"prompt_token_ids": _prompt(1), "multi_modal_data": {"image": [_image(0)]}}
    before = engine.generate([prompt], GREEDY)[0].output_token_ids
    trained: Any = Qwen2VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in trained.named_parameters():
            if "visual" in name:  # only the vision tower changes
                param.add_(0.5 * torch.randn(param.shape, generator=generator))
    named = list(trained.named_parameters())
    assert any("visual" in n for n, _ in named) and set(engine.weight_shapes()) == {
        n for n, _ in named
    }
    for start in range(0, len(named), 10):
        engine.update_weights([(n, p.detach()) for n, p in named[start : start + 10]])
    engine.finish_weight_update()
    after = engine.generate([prompt], GREEDY)[0].output_token_ids
    assert after != before, "the vision tower's new weights changed nothing"
    assert after == _transformers_reference(vl_dir, [_image(0)], trained.state_dict())
