"""Replays of what upstream LightRFT's trainers do to a strategy, call by call.

Upstream's code cannot ship here, so these functions make the calls its GRPO/PPO flow
(``examples/gsm8k_geo3k/train_colocate.py`` with ``SPMDPPOTrainerVL`` and
``FastExperienceMaker``, read at opendilab/LightRFT 49e62cb) and its reward-model flow
(``examples/srm_training`` with ``SRMTrainerVL``) make, with the same argument shapes,
on a :class:`UpstreamShapedActor` (upstream's actor wrapper: the Hugging Face model is
``actor.model``). Each returns facts a test asserts; every rank of a launched job calls
it (the calls are collective).

The GRPO replay, in upstream's order: ``get_strategy(args)``; the actor and the
reference model built in ``init_model_context()``;
``prepare_models_and_optimizers(actor, None, None, initial_model, args, max_steps)``;
``setup_inference_engine(args, engine_type=..., actor=actor)``; a rollout through
``gather_and_generate(sampling_params=..., all_prompt_token_ids=..., all_prompts=...,
sleep_engine=..., all_images=None, images_num=None)`` with SGLang's sampling dict (as
``FastExperienceMaker`` builds it) and with vLLM-shaped parameters;
``sp_data_processor.preprocess``/``postprocess`` around the experiences; the actor's
log-probabilities and a policy-gradient step (``backward(loss, actor, optim)``,
``optimizer_step(optim, actor, scheduler, name="actor")``); ``moving_average`` into an
EMA copy; ``update_engine_weights(actor)`` and a check that the engine now computes the
trainer's log-probabilities; ``save_ckpt(actor.model, dir, tag, max_num, max_mem,
client_states)`` and ``load_ckpt(actor.model, dir, optimizer=, scheduler=)`` (exact
resume: the step after the load equals the step after the save); and
``save_model(actor, tokenizer, dir)``, loaded back with transformers.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

#: SGLang's sampling dict as upstream's FastExperienceMaker builds it (greedy here).
SGLANG_SAMPLING = {
    "n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 4,
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    "skip_special_tokens": False, "spaces_between_special_tokens": True, "ignore_eos": False,
}  # fmt: skip


class VLLMShapedSampling:
    """Sampling parameters with the attribute names of vLLM's ``SamplingParams`` (as
    upstream builds them for vLLM), for processes where vLLM is not installed; the
    engines(vllm) session replays with the real class."""

    def __init__(self, **fields: Any) -> None:
        defaults = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16,
                    "seed": None, "stop_token_ids": None, "logprobs": None}  # fmt: skip
        self.__dict__.update({**defaults, **fields})


class UpstreamShapedActor(nn.Module):
    """Upstream's actor wrapper (``lightrft.models.ActorLanguage``'s shape): the causal LM
    is ``self.model``; ``forward(sequences, num_actions, attention_mask)`` returns the
    log-probabilities of the last ``num_actions`` tokens."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, sequences: torch.Tensor, num_actions: int, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        logits = self.model(input_ids=sequences, attention_mask=attention_mask).logits
        logp = logits[:, :-1].float().log_softmax(-1)
        taken: torch.Tensor = logp.gather(-1, sequences[:, 1:].unsqueeze(-1)).squeeze(-1)
        return taken[:, -num_actions:]


def upstream_args(model_dir: str | Path, **fields: Any) -> argparse.Namespace:
    """The namespace upstream's ``train_colocate.py`` parser builds, shrunk to a test:
    2 prompts of 2 ranks per step, fp32, the Hugging Face engine on ``model_dir``."""
    values: dict[str, Any] = {
        "seed": 7, "max_norm": 1.0, "micro_train_batch_size": 2, "train_batch_size": 4,
        "micro_rollout_batch_size": 2, "rollout_batch_size": 4, "bf16": False,
        "zero_stage": 2, "fsdp": False, "actor_learning_rate": 1e-2, "critic_learning_rate": 1e-2,
        "adam_betas": (0.9, 0.95), "l2": 0.0, "lr_warmup_ratio": 0.0, "engine_type": "hf",
        "engine_tp_size": 1, "enable_engine_sleep": False, "pretrain": str(model_dir),
        "critic_pretrain": None, "remote_rm_url": None, "max_ckpt_num": 2, "max_ckpt_mem": 1e9,
        "n_samples_per_prompt": 1, "device": "cpu", "sp_size": 1, "use_tensorboard": None,
        "meta_init": False,
    }  # fmt: skip
    values.update(fields)
    return argparse.Namespace(**values)


def tiny_tokenizer(vocab_size: int) -> Any:
    """A word-level ``PreTrainedTokenizerFast`` over ``vocab_size`` tokens, built here
    (no download), for the exports' tokenizer files."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    fast: Any = transformers.PreTrainedTokenizerFast
    return fast(tokenizer_object=inner, unk_token="t0")


def _digest(model: nn.Module, strategy: Any) -> str:
    """sha256 of the full parameters, in order (collective on sharded models)."""
    from lightrft.strategy.actor import training_module

    h = hashlib.sha256()
    for name, tensor in strategy.backend.iter_full_parameters(training_module(model)):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def _batch(outputs: list[Any]) -> tuple[torch.Tensor, int]:
    rows = [list(o.prompt_token_ids) + list(o.output_token_ids) for o in outputs]
    width = max(len(r) for r in rows)
    if any(len(r) != width for r in rows):  # equal lengths here: no eos, same prompts' sizes
        raise AssertionError(f"rollout rows of different lengths: {[len(r) for r in rows]}")
    return torch.tensor(rows), len(outputs[0].output_token_ids)


def _pg_step(strategy: Any, actor: nn.Module, optim: Any, sched: Any, seqs: torch.Tensor,
             actions: int, advantages: torch.Tensor) -> tuple[bool, float]:  # fmt: skip
    logp = actor(seqs.to(strategy.device), actions)
    loss = -(advantages.to(logp.device).unsqueeze(-1) * logp).mean()
    strategy.backward(loss, actor, optim)
    stepped = strategy.optimizer_step(optim, actor, sched, name="actor")
    return bool(stepped), float(loss.detach())


def replay_grpo(strategy_args: dict[str, Any], model_dir: str, workdir: str) -> dict[str, Any]:
    """One rank's part of upstream's GRPO flow on the strategy ``strategy_args`` select
    (``backend``: ``fsdp2``, ``deepspeed`` with ``zero_stage``, or ``fake``). Returns what
    the test asserts: the rollout outputs and their prompts, the synced names, losses,
    digests of the parameters around the checkpoint round trip, and the export's check."""
    import transformers

    from lightrft.strategy import get_strategy
    from lightrft.strategy.strategy_base import is_actor  # upstream's import path

    args = upstream_args(model_dir, **strategy_args)
    strategy = get_strategy(args)
    facts: dict[str, Any] = {"rank": strategy.get_rank()}
    with strategy.init_model_context():
        actor: Any = UpstreamShapedActor(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        )
        initial: nn.Module = UpstreamShapedActor(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        )
        ema: nn.Module = UpstreamShapedActor(
            transformers.AutoModelForCausalLM.from_pretrained(model_dir)
        )
    (actor, optim, sched), critic, _, initial = strategy.prepare_models_and_optimizers(
        actor, None, None, initial, args, 4
    )
    ema = strategy.prepare(ema, is_rlhf=True)
    facts["actor_is_wrapper"] = isinstance(actor, UpstreamShapedActor) and is_actor(actor)
    facts["critic"] = critic
    facts["config_of_unwrapped"] = type(strategy.unwrap_model(actor.model).config).__name__
    strategy.setup_inference_engine(args, engine_type=args.engine_type, actor=actor)

    # -- rollout: upstream's keyword form, SGLang's dict, then vLLM-shaped parameters
    rank = strategy.get_rank()
    prompts = [[rank + 1, 5, 9], [7, rank + 3, 2]]
    outputs = strategy.gather_and_generate(
        sampling_params=dict(SGLANG_SAMPLING), all_prompt_token_ids=prompts,
        all_prompts=None, sleep_engine=True, all_images=None, images_num=None,
    )  # fmt: skip
    again = strategy.gather_and_generate(
        VLLMShapedSampling(temperature=0.0, max_tokens=4), all_prompt_token_ids=prompts
    )
    facts["prompts"] = prompts
    facts["rollout"] = [(list(o.prompt_token_ids), list(o.output_token_ids)) for o in outputs]
    facts["rollout_vllm_form"] = [list(o.output_token_ids) for o in again]
    samples = strategy.sp_data_processor.preprocess(outputs)
    experiences = strategy.sp_data_processor.postprocess(samples)
    facts["sp_roundtrip"] = [list(o.output_token_ids) for o in experiences]

    # -- a policy-gradient step, EMA, sync and verification
    seqs, actions = _batch(experiences)
    advantages = torch.tensor([1.0, -1.0])
    stepped, loss = _pg_step(strategy, actor, optim, sched, seqs, actions, advantages)
    facts["stepped"], facts["loss"] = stepped, loss
    facts["ema_updated"] = strategy.moving_average(actor, ema, 0.5, "cuda")
    stats = strategy.update_engine_weights(actor)
    facts["synced_tensors"] = stats["tensors"]
    facts["verify"] = strategy.verify_engine_weights(actor)

    # -- checkpoint round trip with optimizer and scheduler (exact resume)
    ckpt = Path(workdir) / "ckpt" / "_actor"
    strategy.save_ckpt(actor.model, ckpt, "global_step1", args.max_ckpt_num, args.max_ckpt_mem,
                       {"consumed_samples": 4})  # fmt: skip
    facts["saved"] = _digest(actor, strategy)
    _pg_step(strategy, actor, optim, sched, seqs, actions, -advantages)
    facts["after_step2"] = _digest(actor, strategy)
    _, states = strategy.load_ckpt(actor.model, ckpt, optimizer=optim, scheduler=sched)
    facts["consumed_samples"] = states["consumed_samples"]
    facts["loaded"] = _digest(actor, strategy)
    _pg_step(strategy, actor, optim, sched, seqs, actions, -advantages)
    facts["after_step2_resumed"] = _digest(actor, strategy)

    # -- export, loaded back by transformers
    export = Path(workdir) / "hf"
    tokenizer = tiny_tokenizer(int(actor_config(strategy, actor).vocab_size))
    strategy.save_model(actor, tokenizer, export)
    with torch.no_grad():
        logits = actor.model(input_ids=EXPORT_PROBE.to(strategy.device)).logits
    facts["export"], facts["trainer_logits"] = str(export), logits.float().cpu()
    strategy.close()
    return facts


#: The input whose logits an export is compared on (:func:`export_gap`).
EXPORT_PROBE = torch.tensor([[3, 1, 4, 1, 5]])


def export_gap(facts: dict[str, Any]) -> tuple[float, list[int]]:
    """Load a replay's export with transformers (in the calling process: a loader under a
    live DeepSpeed ZeRO-3 config would partition it) and return the largest logit gap to
    the trainer's and how the exported tokenizer encodes ``"t3 t5"``."""
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(facts["export"])
    with torch.no_grad():
        theirs = loaded(input_ids=EXPORT_PROBE).logits.float()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(facts["export"])
    encoded = tokenizer("t3 t5", add_special_tokens=False)["input_ids"]
    return float((theirs - facts["trainer_logits"]).abs().max()), list(encoded)


def actor_config(strategy: Any, actor: nn.Module) -> Any:
    """``strategy.unwrap_model(actor.model).config``, as upstream's experience maker reads it."""
    return strategy.unwrap_model(actor.model).config


def replay_reward_model(
    strategy_args: dict[str, Any], model_dir: str, workdir: str
) -> dict[str, Any]:
    """One rank's part of upstream's reward-model flow (``train_srm_vl.py`` and
    ``SRMTrainerVL``): ``prepare_reward_model(model, args=args, max_steps=...)``,
    ``setup_dataloader``, ``backward``/``optimizer_step``, ``save_ckpt(model, path, tag,
    max_num, max_mem, client_states)``, ``load_ckpt(model, path)`` and ``save_model``."""
    import transformers

    from lightrft.strategy import get_strategy

    args = upstream_args(model_dir, **strategy_args)
    strategy = get_strategy(args)
    with strategy.init_model_context():
        built: nn.Module = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model, optim, sched = strategy.prepare_reward_model(built, args=args, max_steps=4)
    data = [torch.tensor([i % 7 + 1, 2, 3, 4]) for i in range(8)]
    loader = strategy.setup_dataloader(data, 2, False, True, None, True)
    losses = []
    for batch in loader:
        scores = model(input_ids=batch.to(strategy.device)).logits[:, -1, 0].float()
        loss = torch.nn.functional.logsigmoid(scores).neg().mean()
        strategy.backward(loss, model, optim)
        strategy.optimizer_step(optim, model, sched)
        losses.append(float(loss))
    client_states = {"consumed_samples": 8}
    strategy.save_ckpt(model, Path(workdir) / "rm", "global_step2", 2, 1e9, client_states)
    saved = _digest(model, strategy)
    _, states = strategy.load_ckpt(model, Path(workdir) / "rm")
    facts = {"losses": losses, "consumed_samples": states["consumed_samples"],
             "same_after_load": saved == _digest(model, strategy)}  # fmt: skip
    config: Any = strategy.unwrap_model(model).config
    vocab = int(config.vocab_size)
    strategy.save_model(model, tiny_tokenizer(vocab), Path(workdir) / "rm_hf")
    facts["exported"] = (Path(workdir) / "rm_hf" / "config.json").is_file()
    strategy.close()
    return facts
