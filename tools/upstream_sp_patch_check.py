# mypy: ignore-errors
# (drives upstream LightRFT's untyped code, which CI does not have)
"""Upstream LightRFT's own Ulysses patch on our parallel_utils (a local check, not CI).

Upstream ships a Qwen2 attention patch (``lightrft/models/monkey_patch/qwen.py``) but
never applies it. This applies it by hand on 2 gloo ranks, slices the input with our
``sp_slice_and_pad_input`` and gathers the logits with our
``gather_forward_split_backward_and_unpad``, and compares log-probabilities and the
gradients summed over the group with the unpatched model on the whole sequence. CI
cannot hold upstream's code, so run it where upstream's tree is:

    # upstream's lightrft/ without strategy/ in UPSTREAM (fetch opendilab/LightRFT),
    # our packages installed (editable) in the environment, transformers 4.5x
    PYTHONPATH=UPSTREAM python -m torch.distributed.run --nproc-per-node 2 \
        tools/upstream_sp_patch_check.py

Measured (2026-12-05, upstream 49e62cb, transformers 4.57.6): log-probabilities within
4.8e-7, summed gradients within 1.2e-6. The whole sequence's causal mask is passed in
4D: transformers 4.57 builds one for the local length, which the patch (written for
4.48-4.49) would hand to attention over the whole sequence.
"""

import torch
import torch.distributed as dist
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2 import modeling_qwen2

import lightrft.models.monkey_patch as mp  # upstream's package: must import
from lightrft.models.monkey_patch.qwen import qwen2_attn_forward
from lightrft.strategy.utils import parallel_utils as pu  # ours, upstream's names

dist.init_process_group("gloo")
rank = dist.get_rank()
pu.set_sequence_parallel_group(dist.new_group([0, 1]))
group = pu.get_sequence_parallel_group()
torch.manual_seed(0)
config = Qwen2Config(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_implementation="sdpa",
)
model = Qwen2ForCausalLM(config)
ids = torch.randint(0, 128, (1, 11), generator=torch.Generator().manual_seed(5))
pos = torch.arange(11).unsqueeze(0)


def log_probs(logits):
    return torch.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


ref = log_probs(model(input_ids=ids, position_ids=pos, use_cache=False).logits)
ref.sum().backward()
ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
model.zero_grad()

modeling_qwen2.Qwen2Attention.forward = qwen2_attn_forward  # upstream's patch, by hand
local_ids, full_pos, pad = pu.sp_slice_and_pad_input(ids, pos)
# the whole sequence's causal mask, 4D (transformers passes a 4D mask through as it is):
# 4.57 builds a mask for the local length, which upstream's patch (tested on 4.48-4.49)
# would hand to attention over the whole sequence
length = full_pos.size(1)
whole_mask = torch.ones(length, length, dtype=torch.bool).tril()[None, None]
local = model(
    input_ids=local_ids, position_ids=full_pos, attention_mask=whole_mask, use_cache=False
).logits
logits = pu.gather_forward_split_backward_and_unpad(local, group, 1, padding_size=pad, unpad_dim=1)
lp = log_probs(logits)
lp.sum().backward()
worst = 0.0
for name, param in model.named_parameters():
    grad = param.grad.clone()
    dist.all_reduce(grad)  # the split backward leaves each rank its slice's share
    worst = max(worst, float((grad - ref_grads[name]).abs().max()))
print(
    f"rank {rank}: transformers {transformers.__version__}, monkey_patch {mp.__name__} imported; "
    f"local ids {tuple(local_ids.shape)} (pad {pad}); max |log-prob diff| "
    f"{float((lp - ref).abs().max()):.2e}; max |summed grad - sp1 grad| {worst:.2e}"
)
dist.destroy_process_group()
