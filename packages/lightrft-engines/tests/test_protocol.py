"""The engine protocol's neutral pieces: sampling validation, prompts, the sleep state
machine every adapter enforces the same way."""

from __future__ import annotations

from typing import Any

import pytest

from lightrft.engines import (
    EngineError,
    SamplingError,
    SamplingParams,
    SleepState,
    prompt_token_ids,
)
from lightrft.engines.protocol import (
    SGLANG_SAMPLING_KEYS,
    VLLM_SAMPLING_KEYS,
    as_sampling_params,
)


def test_sampling_defaults_and_native_passthrough() -> None:
    params = SamplingParams(native={"repetition_penalty": 1.1}, stop_token_ids=[3, 4])  # type: ignore[arg-type]
    assert (params.max_new_tokens, params.temperature, params.top_k, params.n) == (256, 1.0, -1, 1)
    assert params.stop_token_ids == (3, 4)
    assert params.native == {"repetition_penalty": 1.1}


@pytest.mark.parametrize(
    ("field", "value", "accepted"),
    [
        ("max_new_tokens", 0, "an int >= 1"),
        ("max_new_tokens", 2.5, "an int >= 1"),
        ("temperature", -0.1, "a number >= 0"),
        ("top_p", 0.0, r"a number in \(0, 1\]"),
        ("top_p", 1.5, r"a number in \(0, 1\]"),
        ("top_k", 0, r"-1 \(off\) or an int >= 1"),
        ("n", 0, "an int >= 1"),
        ("n", True, "an int >= 1"),
        ("seed", -1, "None or an int >= 0"),
        ("stop_token_ids", (1, -2), r"token ids \(ints >= 0\)"),
    ],
)
def test_bad_sampling_values_name_field_value_and_range(
    field: str, value: object, accepted: str
) -> None:
    with pytest.raises(
        SamplingError, match=rf"SamplingParams {field}=.* is invalid; accepted: {accepted}"
    ):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_prompts_as_lists_or_dicts() -> None:
    assert prompt_token_ids([1, 2]) == [1, 2]
    image = {"prompt_token_ids": [5, 6], "multi_modal_data": {"image": [object()]}}
    assert prompt_token_ids(image) == [5, 6]
    with pytest.raises(SamplingError, match="needs 'prompt_token_ids'"):
        prompt_token_ids({"prompt": "text"})
    with pytest.raises(SamplingError, match="non-empty list of token ids"):
        prompt_token_ids([])
    with pytest.raises(SamplingError, match="got -3 at position 1"):
        prompt_token_ids([1, -3])


def test_level1_sleep_wakes_weights_then_kv_and_keeps_weights() -> None:
    state = SleepState()
    state.sleep(1)
    with pytest.raises(EngineError, match="generate while weights, kv_cache asleep"):
        state.check_generate()
    with pytest.raises(EngineError, match="update_weights while the weights are asleep"):
        state.check_update()
    state.wake_up(["weights"])
    state.check_update()  # allowed: sync before waking the KV cache
    with pytest.raises(EngineError, match="generate while kv_cache asleep"):
        state.check_generate()
    state.wake_up(["kv_cache"])
    state.check_generate()
    assert state.level is None and not state.weights_stale


def test_level2_sleep_makes_weights_stale_until_synced() -> None:
    state = SleepState()
    state.sleep(2)
    state.wake_up()
    with pytest.raises(EngineError, match="stale weights: a level-2 sleep discarded them"):
        state.check_generate()
    state.weights_synced()
    state.check_generate()


def test_a_sync_applied_in_part_refuses_generation_until_one_finishes() -> None:
    state = SleepState()
    state.weights_changing()  # an adapter applied the first layers of a sync
    with pytest.raises(
        EngineError, match="stale weights: a sync replaced some of them and did not finish"
    ):
        state.check_generate()
    state.weights_synced()
    state.check_generate()
    # a level-2 sleep's reason is kept when a sync then applies part of the weights
    state.sleep(2)
    state.wake_up(["weights"])
    state.weights_changing()
    state.wake_up(["kv_cache"])
    with pytest.raises(EngineError, match="a level-2 sleep discarded them"):
        state.check_generate()


@pytest.mark.parametrize("call", ["sleep", "wake_up"])
def test_a_failed_engine_call_puts_the_state_back(call: str) -> None:
    """The adapters change the state, then call the engine: when the engine call raises
    (out of memory while re-mapping, say), the state must not claim what failed."""
    state = SleepState()
    if call == "wake_up":
        state.sleep(2)
    before = dict(vars(state))

    def change(engine_call: Any) -> None:  # an adapter's sleep or wake_up
        with state.rollback_on_error():
            state.sleep(1) if call == "sleep" else state.wake_up()
            engine_call()

    def out_of_memory() -> None:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        change(out_of_memory)
    assert vars(state) == before
    change(lambda: None)  # a call that succeeds keeps the change
    assert state.asleep is (call == "sleep")


def test_a_failed_level_2_sleep_leaves_the_weights_stale() -> None:
    """The engine may have released the weights before its sleep call failed: the state
    goes back to awake, but generation waits for a sync."""
    state = SleepState()

    def sleep_that_fails() -> None:
        with state.rollback_on_error():
            state.sleep(2)
            raise RuntimeError("failed after releasing the weights")

    with pytest.raises(RuntimeError, match="after releasing"):
        sleep_that_fails()
    assert not state.asleep and state.weights_stale
    with pytest.raises(EngineError, match="a level-2 sleep discarded them"):
        state.check_generate()


@pytest.mark.parametrize(
    ("action", "expected"),
    [
        (lambda s: s.sleep(3), "sleep level 3 is invalid; accepted: 1 or 2"),
        (lambda s: (s.sleep(1), s.sleep(1)), r"already asleep \(level 1\)"),
        (lambda s: s.wake_up(["kv"]), r"wake_up tags \['kv'\] are invalid"),
    ],
)
def test_invalid_transitions_raise(action: object, expected: str) -> None:
    with pytest.raises(EngineError, match=expected):
        action(SleepState())  # type: ignore[operator]


def test_an_engine_without_sleep_refuses_it() -> None:
    with pytest.raises(EngineError, match="does not support sleep"):
        SleepState(supports_sleep=False).sleep(1)


def test_an_sglang_dict_maps_our_keys_and_hands_the_rest_to_the_engine() -> None:
    """Upstream's FastExperienceMaker builds this dict for SGLang."""
    upstream = {
        "n": 1, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "max_new_tokens": 12,
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "skip_special_tokens": False, "spaces_between_special_tokens": True,
        "ignore_eos": False, "sampling_seed": 5,
    }  # fmt: skip
    params = as_sampling_params(upstream)
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 0.7, 0.9, -1)
    assert (params.max_new_tokens, params.seed) == (12, 5)
    assert params.native == {
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
        "skip_special_tokens": False, "spaces_between_special_tokens": True, "ignore_eos": False,
    }  # fmt: skip


def test_vllm_spellings_in_a_dict_mean_ours() -> None:
    params = as_sampling_params({"max_tokens": 7, "top_k": 0, "logprobs": 0, "min_tokens": 2})
    assert (params.max_new_tokens, params.top_k, params.logprobs) == (7, -1, True)
    assert params.native == {"min_tokens": 2}


def test_a_key_no_engine_knows_is_refused_by_name() -> None:
    with pytest.raises(SamplingError, match=r"\['temprature'\] are not known") as info:
        as_sampling_params({"temprature": 0.5, "top_p": 0.5})
    assert "vLLM's SamplingParams or SGLang's sampling dict" in str(info.value)


def test_the_known_engine_keys_do_not_shadow_ours() -> None:
    """Every key both engines spell as we do is ours; the rest go to native."""
    ours = {"max_new_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop_token_ids",
            "logprobs"}  # fmt: skip
    assert ours <= (VLLM_SAMPLING_KEYS | SGLANG_SAMPLING_KEYS | {"seed", "max_new_tokens"})
