"""How the main job turns a problem's text into the token ids the engine and trainer see.

A chat model (its tokenizer has a ``chat_template``) is asked the way it was tuned to be
asked: with ``--chat-template auto`` (the default) the prompt becomes the user's turn,
after an optional system turn (``--system-prompt``), and the template's generation
prompt opens the assistant's turn; the completion is that turn. ``--chat-template none``
(or a tokenizer without a template, as the demo's tiny model's) uses the prompt as
written. Either way no special tokens are added beyond what the template writes.

The completion ends at the tokenizer's ``eos_token`` or at any end-of-sequence id the
model's ``generation_config.json`` lists (chat models often end a turn with a token of
their own, such as ``<|im_end|>`` or ``<|eot_id|>``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class PromptEncoder:
    """``encode(prompt)``: the ids of a problem's prompt as the model is to see it."""

    def __init__(self, tokenizer: Any, mode: str = "auto", system_prompt: str | None = None):
        if mode not in ("auto", "none"):
            raise ValueError(f"--chat-template {mode!r}: choose 'auto' or 'none'")
        self.tokenizer = tokenizer
        self.chat = mode == "auto" and bool(getattr(tokenizer, "chat_template", None))
        if system_prompt and not self.chat:
            raise ValueError(
                "--system-prompt needs a chat template: this tokenizer has none"
                if mode == "auto"
                else "--system-prompt is given with --chat-template none: drop one of them"
            )
        self.system_prompt = system_prompt

    def text(self, prompt: str) -> str:
        """The prompt as the model reads it (the chat template applied, or as written)."""
        if not self.chat:
            return prompt
        turns = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            turns.insert(0, {"role": "system", "content": self.system_prompt})
        return str(
            self.tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        )

    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(self.text(prompt), add_special_tokens=False).input_ids)

    def describe(self) -> str:
        if not self.chat:
            return "prompts as written (no chat template)"
        system = f", system prompt {self.system_prompt!r}" if self.system_prompt else ""
        return f"the tokenizer's chat template (prompt as the user turn{system})"


def stop_ids(tokenizer: Any, model_dir: Path) -> tuple[int, ...]:
    """The ids that end a completion: the tokenizer's eos and the model's
    ``generation_config.json`` ``eos_token_id`` (an id or a list of them)."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    config = model_dir / "generation_config.json"
    if config.is_file():
        listed = json.loads(config.read_text()).get("eos_token_id")
        ids += listed if isinstance(listed, list) else [listed] if listed is not None else []
    return tuple(dict.fromkeys(int(i) for i in ids))
