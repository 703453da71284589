"""Images and videos for the Hugging Face engine: prompt token ids + media -> model inputs.

A multimodal prompt holds one placeholder token per image (``image_token_id``) or video
(``video_token_id``), as vLLM takes it for token-id prompts. :class:`PlaceholderExpander`
runs the model's own image (video) processor on the prompt's items, in order, and
replaces each placeholder by as many copies as the model reads for that item (patches of
its grid / ``merge_size``²): the Qwen2-VL family (Qwen2-VL, Qwen2.5-VL). It gives the
same input ids as transformers' processor expanding ``<|image_pad|>`` in text (tested).
Another model passes its own ``media_processor`` to the engine: any callable
``(token_ids, media, where) -> (expanded_ids, model_kwargs)``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightrft.engines.multimodal import MediaError

#: modality -> (processor output with the pixels, with the grids, processor keyword)
_OUTPUTS = {
    "image": ("pixel_values", "image_grid_thw", "images"),
    "video": ("pixel_values_videos", "video_grid_thw", "videos"),
}


class PlaceholderExpander:
    """Media -> model inputs for models whose prompts hold one placeholder per item and
    whose processors report a ``(t, h, w)`` patch grid per item.

    Args:
        processors: modality -> the processor of its items (``image``: an image
            processor; ``video``: a video processor).
        token_ids: modality -> its placeholder token id.
        merge_size: patches merged into one token (``vision_config.spatial_merge_size``).
    """

    def __init__(
        self, processors: Mapping[str, Any], token_ids: Mapping[str, int], merge_size: int
    ) -> None:
        self.processors = dict(processors)
        self.token_ids = dict(token_ids)
        self.merge_size = merge_size

    @classmethod
    def from_pretrained(cls, path: str, config: Any) -> PlaceholderExpander:
        """The model's processors from its directory: ``AutoImageProcessor``, and
        ``AutoVideoProcessor`` where the model has a video token and transformers
        finds one (it builds one from the image processor's settings too)."""
        import transformers

        vision = config.vision_config
        processors: dict[str, Any] = {
            "image": transformers.AutoImageProcessor.from_pretrained(path)  # type: ignore[no-untyped-call]
        }
        token_ids = {"image": int(config.image_token_id)}
        video_token = getattr(config, "video_token_id", None)
        if video_token is not None and hasattr(transformers, "AutoVideoProcessor"):
            try:
                processors["video"] = transformers.AutoVideoProcessor.from_pretrained(path)  # type: ignore[no-untyped-call]
                token_ids["video"] = int(video_token)
            except (OSError, ValueError):  # no video processor saved: images only
                pass
        return cls(processors, token_ids, int(getattr(vision, "spatial_merge_size", 1)))

    def __call__(
        self, ids: Sequence[int], media: Mapping[str, Sequence[Any]], where: str
    ) -> tuple[list[int], dict[str, torch.Tensor]]:
        expanded = list(ids)
        kwargs: dict[str, torch.Tensor] = {}
        for name, items in media.items():
            if name not in self.processors:
                raise MediaError(
                    f"{where}: the hf engine has no processor for {name!r} items (it has "
                    f"{sorted(self.processors)})"
                )
            token = self.token_ids[name]
            places = [i for i, t in enumerate(expanded) if t == token]
            if len(places) != len(items):
                raise MediaError(
                    f"{where}: {len(places)} {name} placeholder token(s) (id {token}) for "
                    f"{len(items)} {name}(s); put one placeholder per {name}, in order"
                )
            pixels_key, grid_key, argument = _OUTPUTS[name]
            out = self.processors[name](**{argument: list(items)}, return_tensors="pt")
            grid = out[grid_key]
            lengths = [int(n) // self.merge_size**2 for n in grid.prod(dim=-1).tolist()]
            for place, length in sorted(zip(places, lengths, strict=True), reverse=True):
                expanded[place : place + 1] = [token] * length
            kwargs[pixels_key] = out[pixels_key]
            kwargs[grid_key] = grid
        return expanded, kwargs
