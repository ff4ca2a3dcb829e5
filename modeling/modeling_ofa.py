"""PyTorch OFA (One For All) for Transformers 5, the backbone of hf-earlyexit.

A faithful re-implementation of the official OFA: a ResNet image stem, an encoder over
`[image patches ; text tokens]` and a text decoder, both built from NormFormer pre-LN layers. Positions never
enter the token embeddings; every attention logit instead gets an absolute bias (separate q/k projections of
LayerNorm'd position embeddings, shared by all layers) plus a per-layer, per-head relative bias (1D log buckets
for text, 2D offsets for image patches). Parameter names follow the official checkpoints, so converted weights
load strictly.

Two deliberate differences from the official port, both invisible on its inputs:
- text positions are counted from the first attended token, so left-padded rows equal unpadded ones
  (right-padded inputs, the official convention, get exactly the official positions);
- relative-position buckets are computed from position ids instead of stored as 1024x1024 / 1765x1765 buffers.
"""

import functools
import inspect
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, ModelOutput, Seq2SeqLMOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_ofa import PATCH_STEM, RESNET_LAYERS, OFAEarlyExitConfig
from .early_exit_cache import EarlyExitCache
from .exit_controllers import ExitState, checked_decision
from .exit_knobs import ENCODER_PARTS, EXIT_KNOBS, check_thresholds, saved_knobs
from .generation_early_exit import EarlyExitGenerationMixin, EarlyExitSettings, new_cache, with_cross_attention_cache
from .row_exits import ActiveRows, LayerCosts, RowExits, random_state_kept, select_rows

# ---------------------------------------------------------------------------------------------------------------
# Positions
# ---------------------------------------------------------------------------------------------------------------


def check_one_of(ids: torch.Tensor | None, embeds: torch.Tensor | None, ids_name: str, embeds_name: str) -> None:
    """Token ids or their embeddings, not both (as every Transformers model takes them)."""
    if ids is not None and embeds is not None:
        raise ValueError(f"Pass either `{ids_name}` or `{embeds_name}`, not both.")


def check_positions(count: int, config: OFAEarlyExitConfig, what: str) -> None:
    """ValueError when `count` positions are more than the relative position buckets cover (else an `IndexError` deep
    in an embedding)."""
    if count > config.max_position_embeddings:
        raise ValueError(
            f"{what} {count} positions, but this model covers at most {config.max_position_embeddings} "
            "(`max_position_embeddings`)."
        )


def position_ids_from_mask(attention_mask: torch.Tensor | None, length: int, device: torch.device) -> torch.Tensor:
    """Positions 0, 1, ... counted from each row's first attended token: [batch or 1, length].

    Later pads (right or mid-sequence) keep counting, exactly as OFA's `0..L-1`; leading pads are clamped to 0.
    """
    positions = torch.arange(length, device=device)[None]
    if attention_mask is None:
        return positions
    leading_pads = attention_mask.long().argmax(dim=-1, keepdim=True)
    return (positions - leading_pads).clamp(min=0)


def causal_mask(query_slots: slice | torch.Tensor, length: int, device: torch.device) -> torch.Tensor | None:
    """[..., q, length]: True at the key slots after each query's slot (`query_slots` a slice, or [..., q]), which
    also hides a static cache's slots not yet written; None where no key lies after a query (a step's one token at
    the last slot)."""
    if isinstance(query_slots, slice):
        if length <= query_slots.start + 1:
            return None
        query_slots = torch.arange(query_slots.start, query_slots.stop, device=device)
    return torch.arange(length, device=device) > query_slots[..., None]


def cache_span(self_cache: Cache | None, query_length: int) -> tuple[int | torch.Tensor, int]:
    """The tokens before a step's queries (`past`) and the key slots they attend (`length`). A cache that grows
    holds past + q keys; a `StaticCache` always its whole length, and it counts its past in a device tensor, so that
    a compiled step does not specialise on it (cloned here: each layer's write advances the cache's own)."""
    if self_cache is None:
        return 0, query_length
    past = self_cache.get_seq_length()
    length, _ = self_cache.get_mask_sizes(query_length, 0)
    return (past.clone() if isinstance(past, torch.Tensor) else past), length


def token_relative_buckets(relative: torch.Tensor, bucket_size: int, max_position: int) -> torch.Tensor:
    """OFA's 1D relative-position bucket index in [0, 2 * bucket_size - 2] for signed distances `query - key`.

    Exact up to |distance| = bucket_size // 2, log-spaced beyond (the formula of `make_token_bucket_position`).
    """
    mid = bucket_size // 2
    sign = torch.sign(relative)
    abs_pos = torch.where((relative < mid) & (relative > -mid), mid - 1, relative.abs())
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    bucket = torch.where(abs_pos.le(mid), relative, log_pos.int() * sign)
    return bucket.long() + bucket_size - 1


def image_relative_buckets(height: int, width: int, bucket_size: int, device: torch.device) -> torch.Tensor:
    """OFA's 2D relative-position bucket index between the patches of a height x width grid: [N, N], N = h * w."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    row_delta = rows[:, None] - rows[None, :] + bucket_size - 1
    col_delta = cols[:, None] - cols[None, :] + bucket_size - 1
    return row_delta * (2 * bucket_size - 1) + col_delta


def image_position_ids(height: int, width: int, bucket_size: int, device: torch.device) -> torch.Tensor:
    """Row-major patch ids `r * bucket_size + c + 1` into the image position table (id 0 is reserved): [N]."""
    rows = torch.arange(height, device=device).repeat_interleave(width)
    cols = torch.arange(width, device=device).repeat(height)
    return rows * bucket_size + cols + 1


def drop_path(x: torch.Tensor, rate: float, training: bool) -> torch.Tensor:
    """Stochastic depth per sample (the official HF port drops per token, a bug fairseq does not have)."""
    if rate == 0.0 or not training:
        return x
    keep = 1.0 - rate
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep


@functools.cache
def forward_parameters(model_class: type) -> frozenset[str]:
    """The names `model_class.forward` takes, read once per class (not per decoding step)."""
    return frozenset(inspect.signature(model_class.forward).parameters)


def check_encoder_inputs(
    text: torch.Tensor | None, attention_mask: torch.Tensor | None, pixel_values: torch.Tensor | None
) -> None:
    """The encoder's inputs agree: a text of at least one token, a mask of its shape, images for its rows."""
    name = "`input_ids` (or `inputs_embeds`)"
    if text is not None and text.shape[1] == 0:
        raise ValueError(f"{name} has no token (shape {list(text.shape)}): leave the text out for images alone.")
    if text is not None and attention_mask is not None and attention_mask.shape != text.shape[:2]:
        raise ValueError(
            f"`attention_mask` must have the text's shape {list(text.shape[:2])}, got {list(attention_mask.shape)}."
        )
    if text is not None and pixel_values is not None and pixel_values.shape[0] != text.shape[0]:
        raise ValueError(
            f"`pixel_values` has {pixel_values.shape[0]} images for {text.shape[0]} rows of {name}: give one per row."
        )


def check_cache_fits(cache: EarlyExitCache, depth: int, batch: int) -> None:
    """An `EarlyExitCache` passed in holds a slot per decoder layer, and rows of this batch once it holds tokens."""
    if cache.num_layers != depth:
        raise ValueError(
            f"The EarlyExitCache has {cache.num_layers} layers, the decoder {depth}: build it from this model's config "
            "(`EarlyExitCache(model.config, kv_strategy)`)."
        )
    keys = cache.layers[0].keys
    if cache.get_seq_length() > 0 and keys is not None and keys.shape[0] != batch:
        raise ValueError(
            f"The cache passed in holds {keys.shape[0]} rows, this call decodes {batch} (beams and returned sequences "
            "count): continue with the call's own settings, or pass no cache."
        )


def check_no_layerdrop(name: str, layerdrop: float, training: bool) -> None:
    """Exits test and count the layers in order; LayerDrop in training skips them at random."""
    if training and layerdrop > 0:
        raise ValueError(
            f"Exits need every layer to run, but `{name}={layerdrop}` drops layers at random in training mode: call "
            f"`model.eval()` before `generate`, or set `{name}=0`."
        )


def drop_path_rates(rate: float, count: int) -> list[float]:
    """Stochastic-depth rates rising linearly from 0 to `rate` over `count` layers (torch.linspace, in Python so
    the model can be built on the meta device)."""
    return [rate * i / (count - 1) if count > 1 else 0.0 for i in range(count)]


def layers_to_run(count: int, layerdrop: float, training: bool) -> list[int]:
    """Indices of the layers one forward runs: all, minus LayerDrop's random picks in training."""
    if not training or layerdrop == 0.0:
        return list(range(count))
    return [i for i in range(count) if torch.rand(()).item() >= layerdrop]


class DropPath(nn.Module):
    def __init__(self, rate: float = 0.0):
        super().__init__()
        self.rate = rate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return drop_path(x, self.rate, self.training)


def computed_once(function: Callable[[], Any]) -> Callable[[], Any]:
    """`function()` on the first call, remembered: `functools.cache` of a function without arguments, minus the
    copying of its metadata (about 10 µs for every decoder layer that asks whether to exit)."""
    value = []

    def call() -> Any:
        if not value:
            value.append(function())
        return value[0]

    return call


def plain_modules(modules: Iterable[nn.Module]) -> bool:
    """Whether every module is a bare `nn.Linear` or `nn.LayerNorm` that nothing wraps or hooks, so that reading its
    weights gives what calling it gives. A LoRA layer (PEFT), an offload hook (Accelerate) or a user's forward hook
    must be called instead."""
    return all(
        type(module) in (nn.Linear, nn.LayerNorm)
        and not (module._forward_hooks or module._forward_pre_hooks or hasattr(module, "_hf_hook"))
        for module in modules
    )


# Every layer's projections stacked into one matmul (the cross-attention K/V at decoding's first step, `propagate`'s K/V
# of an exited state) save calls, which is what a small model's step and a GPU's launches pay for. The stack is a copy
# of those weights made for each `generate` call, and on a CPU it costs more than the calls it saves once they are
# large (2-core CPU, OFA-base: folding the self-attention projections 3-16 ms a call, saving 0.1 ms a fill; the cross
# ones stacked 4.5 ms at batch 1, 3.1 ms layer by layer; the embedded model, 0.2 ms against 0.07 ms a fill).
CPU_STACK_MAX_ELEMENTS = 2**20


def stacking_pays(weights: Sequence[torch.Tensor]) -> bool:
    """Whether stacking `weights` into one projection for a `generate` call pays (`CPU_STACK_MAX_ELEMENTS`)."""
    return weights[0].device.type != "cpu" or sum(weight.numel() for weight in weights) <= CPU_STACK_MAX_ELEMENTS


def split_heads(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[batch, length, d_model] -> [batch, heads, length, head_dim]."""
    return x.unflatten(-1, (num_heads, -1)).transpose(1, 2)


def split_layer_key_values(
    projected: torch.Tensor, num_heads: int, d_model: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A stacked projection [batch, length, layers * 2 * d_model] (per layer k then v) -> per layer (K, V), views of
    it, [batch, heads, length, head_dim] each."""
    batch, length = projected.shape[:2]
    # -> [layers, k/v, batch, heads, length, head_dim]
    per_layer = projected.view(batch, length, -1, 2, num_heads, d_model // num_heads).permute(2, 3, 0, 4, 1, 5)
    return list(zip(per_layer[:, 0], per_layer[:, 1], strict=True))


def optional_layer_norm(enabled: bool, width: int) -> nn.Module:
    return nn.LayerNorm(width) if enabled else nn.Identity()


class OFARelativePositionTable(nn.Embedding):
    """A per-layer table of relative-position biases, one value per head (zero-initialised, as in fairseq)."""


# ---------------------------------------------------------------------------------------------------------------
# Image stems
# ---------------------------------------------------------------------------------------------------------------


class OFABottleneck(nn.Module):
    """torchvision v1.5 Bottleneck (stride on the 3x3 conv), with per-sample drop path on the residual branch."""

    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: bool = False, drop_rate: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(
                nn.Conv2d(inplanes, planes * self.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * self.expansion),
            )
            if downsample
            else None
        )
        self.drop_path = DropPath(drop_rate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(identity + self.drop_path(out))


class OFAResNet(nn.Module):
    """ResNet stages 1-3 (no stage 4): [batch, 3, H, W] -> [batch, 1024, H/16, W/16]."""

    def __init__(self, blocks: tuple[int, int, int], drop_path_rate: float = 0.0):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        rates = drop_path_rates(drop_path_rate, sum(blocks))
        inplanes = 64
        for stage, (planes, count, stride) in enumerate(zip((64, 128, 256), blocks, (1, 2, 2), strict=True), start=1):
            stage_rates, rates = rates[:count], rates[count:]
            layers = []
            for i in range(count):
                layers.append(OFABottleneck(inplanes, planes, stride if i == 0 else 1, i == 0, stage_rates[i]))
                inplanes = planes * OFABottleneck.expansion
            setattr(self, f"layer{stage}", nn.Sequential(*layers))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(pixel_values))))
        return self.layer3(self.layer2(self.layer1(x)))


class OFAPatchStem(nn.Module):
    """A light stem for small models: [batch, 3, H, W] -> [batch, 256, H/16, W/16] with two strided convs."""

    patch = 16  # pixels per patch side: the smallest image it takes

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=4, stride=4)
        self.act = nn.GELU()
        self.conv2 = nn.Conv2d(64, 256, kernel_size=4, stride=4)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act(self.conv1(pixel_values)))


# ---------------------------------------------------------------------------------------------------------------
# Attention and layers
# ---------------------------------------------------------------------------------------------------------------


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scaling + bias) v as OFA computes it (the query scaled first, softmax in float32), on
    [batch, heads, length, head_dim]; `attention_mask` is the float bias, masks included. Returns the output as
    [batch, length, heads, head_dim] and the probabilities, like every attention of `ALL_ATTENTION_FUNCTIONS`."""
    weights = torch.matmul(query * scaling, key.transpose(-1, -2)) + attention_mask
    weights = F.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), weights


def attend_runs(
    attention: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    rows: ActiveRows,
    output_attentions: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`attention` of the queries of `rows` [rows, heads, q, head_dim] over their runs of the whole batch's keys and
    values [batch, ...], a view per contiguous run: [rows, q, heads, head_dim], and with `output_attentions` the
    probabilities [rows, heads, q, kv] (the runs share the batch's kv length, so they stack by row)."""
    outputs, weights, offset = [], [], 0
    for start, end in rows.runs:
        size = end - start
        run_bias = bias if bias.shape[0] == 1 else bias[offset : offset + size]
        out, run_weights = attention(
            module, query[offset : offset + size], key[start:end], value[start:end], run_bias, **kwargs
        )
        outputs.append(out)
        if output_attentions:
            weights.append(run_weights)
        offset += size
    return torch.cat(outputs), torch.cat(weights) if output_attentions else None


class OFAAttention(nn.Module):
    """Multi-head attention with an additive bias and NormFormer's per-head output scale `c_attn`.

    The caller projects (`project_kv`) and caches the keys and values; `forward` attends with them. Without
    `key_value_projections` the module only queries keys and values made elsewhere (an exit layer's attention).
    """

    def __init__(self, config: OFAEarlyExitConfig, num_heads: int, key_value_projections: bool = True):
        super().__init__()
        self.config = config
        self.num_heads = num_heads
        self.head_dim = config.d_model // num_heads
        self.scaling = (self.head_dim * config.attn_scale_factor) ** -0.5
        self.dropout = config.attention_dropout
        if key_value_projections:
            self.k_proj = nn.Linear(config.d_model, config.d_model)
            self.v_proj = nn.Linear(config.d_model, config.d_model)
        self.q_proj = nn.Linear(config.d_model, config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)
        self.c_attn = nn.Parameter(torch.ones(num_heads)) if config.normformer else None
        self.is_causal = False  # the causal mask is in the bias; SDPA must not add its own

    def project_kv(self, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, length, d_model] -> keys, values [batch, heads, length, head_dim]."""
        return split_heads(self.k_proj(source), self.num_heads), split_heads(self.v_proj(source), self.num_heads)

    def forward(
        self,
        hidden_states: torch.Tensor,
        bias: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rows: ActiveRows | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of `hidden_states` [rows, q, d] over `key`/`value` with the float `bias` (positions plus masks, so
        SDPA gets it as `attn_mask` with OFA's scale). With `rows`, the keys and values are the whole batch's and the
        queries those rows'. Attention probabilities come from the eager path, the only one that has them."""
        query = split_heads(self.q_proj(hidden_states), self.num_heads)
        implementation = "eager" if output_attentions else self.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        dropout = self.dropout if self.training else 0.0
        if rows is None:
            out, weights = attention(self, query, key, value, bias, scaling=self.scaling, dropout=dropout)
        else:
            out, weights = attend_runs(
                attention, self, query, key, value, bias, rows, output_attentions, scaling=self.scaling, dropout=dropout
            )
        if self.c_attn is not None:
            out = out * self.c_attn[:, None]  # [rows, q, heads, head_dim]
        out = out.reshape(*hidden_states.shape[:-1], -1)
        return self.out_proj(out), weights


class OFAEncoderLayer(GradientCheckpointingLayer):
    """Pre-LN NormFormer layer: x + drop_path(dropout(mid_LN(attn(LN(x))))), then the FFN block the same way.

    The decoder layer extends it with a cross-attention block; parameter names match the official checkpoints.
    """

    def __init__(
        self,
        config: OFAEarlyExitConfig,
        layer_idx: int,
        drop_path_rate: float,
        num_heads: int,
        ffn_dim: int,
        key_value_projections: bool = True,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = OFAAttention(config, num_heads, key_value_projections)
        self.self_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.self_attn_mid_layer_norm = optional_layer_norm(config.normformer, config.d_model)
        self.final_layer_norm = nn.LayerNorm(config.d_model)
        self.fc1 = nn.Linear(config.d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, config.d_model)
        self.ffn_layer_norm = optional_layer_norm(config.normformer, ffn_dim)
        self.activation = ACT2FN[config.activation_function]
        self.activation_dropout = nn.Dropout(config.activation_dropout)
        self.dropout = nn.Dropout(config.dropout)
        self.drop_path = DropPath(drop_path_rate)

    def residual(self, hidden_states: torch.Tensor, block_output: torch.Tensor) -> torch.Tensor:
        if not self.training:  # both are identities then; skipping the calls is worth it at decoding's tiny batches
            return hidden_states + block_output
        return hidden_states + self.drop_path(self.dropout(block_output))

    def feed_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = self.activation(self.fc1(self.final_layer_norm(hidden_states)))
        x = self.activation_dropout(x) if self.training else x
        return self.residual(hidden_states, self.fc2(self.ffn_layer_norm(x)))

    def forward(
        self, hidden_states: torch.Tensor, bias: torch.Tensor, output_attentions: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.self_attn_layer_norm(hidden_states)
        attn, weights = self.self_attn(x, bias, *self.self_attn.project_kv(x), output_attentions=output_attentions)
        hidden_states = self.residual(hidden_states, self.self_attn_mid_layer_norm(attn))
        return self.feed_forward(hidden_states), weights


class OFADecoderLayer(OFAEncoderLayer):
    """Causal self-attention, cross-attention over the encoder output, FFN; each as a pre-LN NormFormer block."""

    def __init__(
        self, config: OFAEarlyExitConfig, layer_idx: int, drop_path_rate: float, key_value_projections: bool = True
    ):
        heads = config.decoder_attention_heads
        super().__init__(config, layer_idx, drop_path_rate, heads, config.decoder_ffn_dim, key_value_projections)
        self.cross_attn = OFAAttention(config, heads, key_value_projections)
        self.cross_attn_layer_norm = nn.LayerNorm(config.d_model)
        self.cross_attn_mid_layer_norm = optional_layer_norm(config.normformer, config.d_model)

    def self_key_values(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's self-attention K/V of a hidden state (what `propagate` writes for skipped layers)."""
        return self.self_attn.project_kv(self.self_attn_layer_norm(hidden_states))

    def cross_key_values(
        self, encoder_hidden_states: torch.Tensor, past_key_values: EncoderDecoderCache | None, rows: ActiveRows | None
    ) -> tuple[torch.Tensor, torch.Tensor, ActiveRows | None]:
        """Cross-attention K/V and the rows of them to attend with. Cached for the whole batch on first use (a
        layer first reached at a later step fills its entry then); uncached, computed for the active rows only."""
        if past_key_values is None:
            source = encoder_hidden_states if rows is None else encoder_hidden_states[rows.index]
            return *self.cross_attn.project_kv(source), None
        if not past_key_values.is_updated.get(self.layer_idx):
            key, value = self.cross_attn.project_kv(encoder_hidden_states)
            past_key_values.cross_attention_cache.update(key, value, self.layer_idx)
            past_key_values.is_updated[self.layer_idx] = True
        layer_cache = past_key_values.cross_attention_cache.layers[self.layer_idx]
        keys, values, source = layer_cache.keys, layer_cache.values, encoder_hidden_states.shape[1]
        if keys.shape[2] != source:  # a user's `StaticCache` may hold more slots than the encoder output
            keys, values = keys[:, :, :source], values[:, :, :source]
        return keys, values, rows

    def forward(
        self,
        hidden_states: torch.Tensor,
        self_bias: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        cross_bias: torch.Tensor,
        past_key_values: EncoderDecoderCache | None = None,
        rows: ActiveRows | None = None,
        slots: slice | torch.Tensor | None = None,
        output_attentions: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """hidden_states [rows, q, d] of the batch `rows` (None: every row); with a cache, their K/V go to `slots`."""
        x = self.self_attn_layer_norm(hidden_states)
        key, value = self.self_attn.project_kv(x)
        key_rows = None
        self_cache = past_key_values.self_attention_cache if past_key_values is not None else None
        if isinstance(self_cache, EarlyExitCache):
            index = None if rows is None else rows.index
            key, value = self_cache.write(self.layer_idx, key, value, index, slots)
            key_rows = rows
        elif self_cache is not None:  # a Transformers cache (no decoder exits: every row), e.g. a StaticCache
            key, value = self_cache.update(key, value, self.layer_idx)
        attn, self_weights = self.self_attn(x, self_bias, key, value, key_rows, output_attentions)
        hidden_states = self.residual(hidden_states, self.self_attn_mid_layer_norm(attn))

        x = self.cross_attn_layer_norm(hidden_states)
        key, value, key_rows = self.cross_key_values(encoder_hidden_states, past_key_values, rows)
        attn, cross_weights = self.cross_attn(x, cross_bias, key, value, key_rows, output_attentions)
        hidden_states = self.residual(hidden_states, self.cross_attn_mid_layer_norm(attn))
        return self.feed_forward(hidden_states), self_weights, cross_weights


class ZeroInitLinear(nn.Linear):
    """A Linear initialised to zero: the last projection of an exit head's residual branch, so that an untrained
    exit head is the identity (the shared head alone) and training learns a correction."""


class OFAExitAdapter(nn.Module):
    """DEED's adaptation module: h + up(gelu(down(LN(h)))), mapping a decoder layer's output towards what the
    shared final head expects. `up` starts at zero, so an untrained adapter is the identity."""

    def __init__(self, config: OFAEarlyExitConfig):
        super().__init__()
        self.layer_norm = nn.LayerNorm(config.d_model)
        self.down = nn.Linear(config.d_model, config.exit_adapter_dim)
        self.up = ZeroInitLinear(config.exit_adapter_dim, config.d_model)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states + self.up(F.gelu(self.down(self.layer_norm(hidden_states))))


class OFAExitLayer(OFADecoderLayer):
    """BLIPEE's exit transformer layer on decoder layer `layer_idx` (0-based host): self-attention, cross-attention
    and FFN blocks like a decoder layer, whose attention queries the keys and values the host layer computed (its
    cache entries), so it keeps no cache of its own and works with every `kv_strategy`. The blocks' output
    projections start at zero, so an untrained exit layer is the identity."""

    def __init__(self, config: OFAEarlyExitConfig, layer_idx: int):
        super().__init__(config, layer_idx, drop_path_rate=0.0, key_value_projections=False)
        d_model = config.d_model
        self.self_attn.out_proj = ZeroInitLinear(d_model, d_model)
        self.cross_attn.out_proj = ZeroInitLinear(d_model, d_model)
        self.fc2 = ZeroInitLinear(config.decoder_ffn_dim, d_model)

    def forward(
        self,
        hidden_states: torch.Tensor,
        self_bias: torch.Tensor,
        host_key_values: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        cross_bias: torch.Tensor,
        rows: ActiveRows | None = None,
    ) -> torch.Tensor:
        """hidden_states [rows, q, d]: the host layer's output; `host_key_values` its self- and cross-attention
        keys and values, for the whole batch when `rows` is given, else for these rows."""
        self_key, self_value, cross_key, cross_value = host_key_values
        attn, _ = self.self_attn(self.self_attn_layer_norm(hidden_states), self_bias, self_key, self_value, rows)
        hidden_states = self.residual(hidden_states, self.self_attn_mid_layer_norm(attn))
        attn, _ = self.cross_attn(self.cross_attn_layer_norm(hidden_states), cross_bias, cross_key, cross_value, rows)
        hidden_states = self.residual(hidden_states, self.cross_attn_mid_layer_norm(attn))
        return self.feed_forward(hidden_states)


# ---------------------------------------------------------------------------------------------------------------
# Encoder and decoder
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class OFAEncoderOutput(ModelOutput):
    """Encoder output plus what the decoder's cross-attention needs besides the states.

    last_hidden_state: [batch, N_image + T, d_model] after the final LayerNorm (pad rows are not zero).
    padding_mask: [batch, N_image + T], True at text pads (image patches are never padded).
    position_embedding: [batch, N_image + T, d_model] LayerNorm'd absolute positions, the keys of the decoder's
        cross-attention position bias.
    hidden_states: embedding output and each layer's output (before the final LayerNorm), if asked.
    attentions: each layer's attention probabilities, if asked (joint encoder only).
    cross_position_keys: [batch, heads, S, head_dim], the decoder's `cross_pos_k_linear(position_embedding)`,
        filled by the decoder on its first no-grad call and reused at every later decoding step; `generate` drops
        those of an output passed in (an earlier call's, whose weights may have changed since).
    exit_layers: [batch, 2], the encoder layer each row's output comes from (image, text): its exit, full depth
        without exits (under `row_exit="keep"` a row may run deeper with the batch).
    """

    last_hidden_state: torch.FloatTensor | None = None
    padding_mask: torch.BoolTensor | None = None
    position_embedding: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    cross_position_keys: torch.FloatTensor | None = None
    exit_layers: torch.LongTensor | None = None


@dataclass
class EncoderSequence:
    """The encoder's input sequence `[image patches ; text tokens]` and its position terms.

    hidden_states [batch, S, d] (pads zeroed); position_embedding [batch, S, d] (LayerNorm'd); padding [batch, S]
    (True at text pads); absolute [batch, heads, S, S] (the absolute position bias, pads masked as keys); num_image N
    and text_length T; image_buckets [N, N] and text_buckets [batch, T, T], None for a missing modality.
    """

    hidden_states: torch.Tensor
    position_embedding: torch.Tensor
    padding: torch.Tensor
    absolute: torch.Tensor
    num_image: int
    text_length: int
    image_buckets: torch.Tensor | None
    text_buckets: torch.Tensor | None


def relative_tables(config: OFAEarlyExitConfig, num_layers: int, num_heads: int) -> tuple[nn.ModuleList, ...]:
    """Per-layer text (2 * token_bucket_size - 1 buckets) and image ((2 * image_bucket_size - 1)^2 + 3) tables."""
    text = nn.ModuleList(
        OFARelativePositionTable(2 * config.token_bucket_size - 1, num_heads) for _ in range(num_layers)
    )
    image_buckets = (2 * config.image_bucket_size - 1) ** 2 + 3
    image = nn.ModuleList(OFARelativePositionTable(image_buckets, num_heads) for _ in range(num_layers))
    return text, image


def position_bias(
    q_linear: nn.Linear, k_linear: nn.Linear, queries: torch.Tensor, keys: torch.Tensor, num_heads: int, scaling: float
) -> torch.Tensor:
    """Absolute position bias (q_linear(queries) * scaling) @ k_linear(keys)^T per head: [batch, heads, Lq, Lk]."""
    q = split_heads(q_linear(queries), num_heads) * scaling
    return torch.matmul(q, split_heads(k_linear(keys), num_heads).transpose(-1, -2))


class OFAEncoder(nn.Module):
    """Image stem + text embeddings -> Transformer layers over `[image patches ; text tokens]` -> LayerNorm."""

    main_input_name = "input_ids"

    def __init__(self, config: OFAEarlyExitConfig):
        super().__init__()
        self.config = config
        d_model, heads = config.d_model, config.encoder_attention_heads
        self.num_heads = heads
        self.embed_scale = math.sqrt(d_model) if config.scale_embedding else 1.0
        self.pos_scaling = (d_model / heads * config.attn_scale_factor) ** -0.5
        self.dropout = nn.Dropout(config.dropout)

        self.embed_tokens = nn.Embedding(config.vocab_size, d_model, config.pad_token_id)
        if config.resnet_type == PATCH_STEM:
            self.embed_images = OFAPatchStem()
        else:
            self.embed_images = OFAResNet(RESNET_LAYERS[config.resnet_type], config.resnet_drop_path_rate)
        self.image_proj = nn.Linear(config.image_feature_dim, d_model)
        self.type_embedding = nn.Embedding(2, d_model) if config.add_type_embedding else None
        self.layernorm_embedding = optional_layer_norm(config.layernorm_embedding, d_model)
        self.patch_layernorm_embedding = optional_layer_norm(config.patch_layernorm_embedding, d_model)

        self.embed_positions = nn.Embedding(config.max_position_embeddings + 2, d_model)
        self.embed_image_positions = nn.Embedding(config.image_bucket_size**2 + 1, d_model)
        self.pos_ln = nn.LayerNorm(d_model)
        self.image_pos_ln = nn.LayerNorm(d_model)
        self.pos_q_linear = nn.Linear(d_model, d_model)
        self.pos_k_linear = nn.Linear(d_model, d_model)

        rates = drop_path_rates(config.encoder_drop_path_rate, config.encoder_layers)
        self.layers = nn.ModuleList(
            OFAEncoderLayer(config, i, rates[i], heads, config.encoder_ffn_dim) for i in range(config.encoder_layers)
        )
        self.token_rel_pos_table_list, self.image_rel_pos_table_list = relative_tables(
            config, config.encoder_layers, heads
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.measured_layer_costs: dict[tuple, LayerCosts] = {}  # (batch, length, dtype, device) -> costs

    def embed_image(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]]:
        """[batch, 3, H, W] -> patch states [batch, N, d], LN'd positions [batch, N, d], grid (h, w)."""
        if pixel_values.ndim != 4 or pixel_values.shape[1] != 3:
            raise ValueError(f"`pixel_values` must be [batch, 3, height, width], got {list(pixel_values.shape)}.")
        patch = getattr(self.embed_images, "patch", 1)
        if min(pixel_values.shape[-2:]) < patch:
            raise ValueError(
                f"An image of {pixel_values.shape[-2]}x{pixel_values.shape[-1]} px is smaller than one {patch} px "
                f"patch of the `resnet_type={self.config.resnet_type!r}` stem: give images of at least {patch} px per "
                "side."
            )
        features = self.embed_images(pixel_values.to(self.image_proj.weight.dtype))  # [batch, C, h, w]
        height, width = features.shape[-2:]
        if max(height, width) > self.config.image_bucket_size:
            raise ValueError(
                f"An image of {pixel_values.shape[-2]}x{pixel_values.shape[-1]} px gives a {height}x{width} patch "
                f"grid; the model takes at most {self.config.image_bucket_size} patches per side (`image_bucket_size`)."
            )
        x = self.image_proj(features.flatten(2).transpose(1, 2)) * self.embed_scale
        if self.type_embedding is not None:
            x = x + self.type_embedding(torch.full((1,), 1, device=x.device))  # called: hooks and adapters apply
        x = self.dropout(self.patch_layernorm_embedding(x))
        ids = image_position_ids(height, width, self.config.image_bucket_size, x.device)
        positions = self.image_pos_ln(self.embed_image_positions(ids)).expand(x.shape[0], -1, -1)
        return x, positions, (height, width)

    def embed_text(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, inputs_embeds: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """[batch, T] ids (or their embeddings [batch, T, d], `get_input_embeddings()(input_ids)`) -> token states
        [batch, T, d], LN'd positions [batch, T, d], position ids, pad mask [batch, T]."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
            padding = input_ids.eq(self.config.pad_token_id) if attention_mask is None else attention_mask.eq(0)
        else:  # without a mask every embedded token is real
            padding = (
                torch.zeros(inputs_embeds.shape[:2], dtype=torch.bool, device=inputs_embeds.device)
                if attention_mask is None
                else attention_mask.eq(0)
            )
        x = inputs_embeds * self.embed_scale
        if self.type_embedding is not None:
            x = x + self.type_embedding(torch.full((1,), 0, device=x.device))  # called: hooks and adapters apply
        x = self.dropout(self.layernorm_embedding(x))
        check_positions(x.shape[1], self.config, "The text input has")
        position_ids = position_ids_from_mask(~padding, x.shape[1], x.device)
        positions = self.pos_ln(self.embed_positions(position_ids)).expand(x.shape[0], -1, -1)
        return x, positions, position_ids, padding

    def layer_bias(
        self,
        layer_idx: int,
        absolute: torch.Tensor,
        num_image: int,
        text_buckets: torch.Tensor | None,
        image_buckets: torch.Tensor | None,
    ) -> torch.Tensor:
        """Absolute bias (pads already masked) + this layer's relative biases on the text and image blocks."""
        if text_buckets is None and image_buckets is None:  # a decomposed encoder's image stream: nothing to add
            return absolute
        bias = absolute.clone()
        if text_buckets is not None:
            bias[:, :, num_image:, num_image:] += self.token_rel_pos_table_list[layer_idx](text_buckets).permute(
                0, 3, 1, 2
            )
        if image_buckets is not None:
            bias[:, :, :num_image, :num_image] += self.image_rel_pos_table_list[layer_idx](image_buckets).permute(
                2, 0, 1
            )
        return bias

    def layer_costs(self, batch: int, length: int, dtype: torch.dtype) -> LayerCosts:
        """A layer's seconds over rows of a [batch, length] sequence, for `row_exit="auto"`: measured on first use
        per batch, length (rounded up to a multiple of 32), dtype and device, then kept."""
        length, device = -(-length // 32) * 32, self.pos_ln.weight.device
        key = (batch, length, dtype, device)
        if key in self.measured_layer_costs:
            return self.measured_layer_costs[key]
        with random_state_kept(device):
            hidden = torch.randn(batch, length, self.config.d_model, device=device, dtype=dtype)
            bias = hidden.new_zeros(batch, self.num_heads, length, length)
            keep = torch.arange(batch, device=device) > 0
            self.measured_layer_costs[key] = LayerCosts.measure(
                batch,
                lambda rows: functools.partial(self.layers[0], hidden[rows], bias[rows]),
                lambda: (hidden[keep], bias[keep]),
                device,
                scattered=False,  # the encoder gathers its rows whatever their pattern
            )
        return self.measured_layer_costs[key]

    def run_layers(
        self,
        hidden_states: torch.Tensor,
        absolute: torch.Tensor,
        num_image: int,
        text_buckets: torch.Tensor | None,
        image_buckets: torch.Tensor | None,
        layers: list[int],
        output_attentions: bool,
        exit_settings: EarlyExitSettings | None = None,
        part: str = "encoder",
        real_tokens: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """The given layers over one sequence (joint, or one modality stream).

        Returns the output per row [batch, S, d], the input and each layer's states [batch, S, d] when
        `output_hidden_states` (a row that stopped holds its output from then on), each layer's attentions when
        `output_attentions` (zeros for a row that left the layers), and the layers each row's output comes from
        [batch]. With a controller for `part` in `exit_settings`, a row
        that stops keeps its output, and the plan (`row_exit`) either keeps it in the batch or takes it out of the
        layers after; the controller is first asked after layer `encoder_min_exit_layer`. `real_tokens` [batch, S]
        (True = not padding) is what the controller compares.
        """
        controller = getattr(exit_settings, part, None)
        batch, device = hidden_states.shape[0], hidden_states.device
        exits = RowExits(batch, len(layers), device)
        if controller is not None:
            costs = functools.partial(self.layer_costs, batch, hidden_states.shape[1], hidden_states.dtype)
            exits = exit_settings.row_exits(part, batch, len(layers), device, costs)
        min_exit_layer = getattr(exit_settings, "encoder_min_exit_layer", 1)
        states, attentions = [hidden_states], []
        for count, idx in enumerate(layers, start=1):
            previous = hidden_states
            bias = self.layer_bias(idx, absolute, num_image, text_buckets, image_buckets)
            hidden_states, weights = self.layers[idx](hidden_states, bias, output_attentions)
            states.append(exits.snapshot("output", hidden_states) if output_hidden_states else hidden_states)
            attentions.append(exits.spread(weights) if output_attentions else weights)
            if controller is None or count == len(layers) or count < min_exit_layer:
                continue
            state = ExitState(
                part=part,
                layer=count,
                step=0,
                hidden_states=hidden_states,
                previous_hidden_states=previous,
                rows=exits.running,
                num_layers=len(layers),
                attention_mask=real_tokens,
                waiting=exits.waiting_running,
            )
            stop = checked_decision(controller(state), state, controller)
            carried = (hidden_states, absolute, text_buckets, real_tokens)
            hidden_states, absolute, text_buckets, real_tokens = exits.stop(
                count, stop, {"output": hidden_states}, {}, carried
            )
            if exits.finished:
                break
        for _ in range(len(layers) + 1 - len(states)):  # layers no row ran: each row holds its output
            states.append(exits.snapshot("output", hidden_states))
            attentions.append(None if attentions[-1] is None else torch.zeros_like(attentions[-1]))
        final, exit_layers = exits.gather("output", hidden_states)
        return final, states, attentions, exit_layers

    def embed(
        self,
        input_ids: torch.LongTensor | None,
        attention_mask: torch.Tensor | None,
        pixel_values: torch.Tensor | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> "EncoderSequence":
        """The sequence `[image patches ; text tokens]` the layers run over, with its position terms."""
        check_encoder_inputs(input_ids if inputs_embeds is None else inputs_embeds, attention_mask, pixel_values)
        parts, positions, paddings = [], [], []
        num_image = text_length = 0
        image_buckets = text_buckets = None
        if pixel_values is not None:
            image_x, image_pos, (height, width) = self.embed_image(pixel_values)
            num_image = image_x.shape[1]
            image_buckets = image_relative_buckets(height, width, self.config.image_bucket_size, image_x.device)
            parts.append(image_x)
            positions.append(image_pos)
            paddings.append(torch.zeros(image_x.shape[:2], dtype=torch.bool, device=image_x.device))
        if input_ids is not None or inputs_embeds is not None:
            text_x, text_pos, text_position_ids, text_padding = self.embed_text(
                input_ids, attention_mask, inputs_embeds
            )
            text_length = text_x.shape[1]
            relative = text_position_ids[:, :, None] - text_position_ids[:, None, :]
            text_buckets = token_relative_buckets(
                relative, self.config.token_bucket_size, self.config.max_position_embeddings
            )
            parts.append(text_x)
            positions.append(text_pos)
            paddings.append(text_padding)

        position_embedding = torch.cat(positions, dim=1)
        padding = torch.cat(paddings, dim=1)
        hidden_states = torch.cat(parts, dim=1) * (~padding).unsqueeze(-1).to(parts[0].dtype)
        absolute = position_bias(
            self.pos_q_linear,
            self.pos_k_linear,
            position_embedding,
            position_embedding,
            self.num_heads,
            self.pos_scaling,
        )  # [batch, heads, S, S]
        # Pads are masked as keys once here; the relative biases added per layer keep them at ~finfo.min.
        absolute = absolute.masked_fill(padding[:, None, None, :], torch.finfo(absolute.dtype).min)
        return EncoderSequence(
            hidden_states, position_embedding, padding, absolute, num_image, text_length, image_buckets, text_buckets
        )

    def run_joint(
        self,
        sequence: "EncoderSequence",
        layers: list[int],
        exit_settings: EarlyExitSettings | None,
        output_attentions: bool,
        output_hidden_states: bool = False,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """OFA's encoder: image and text attend to each other. Returns what `run_layers` does, the layers per row
        for (image, text) [batch, 2]: both the joint encoder's, 0 for a missing modality."""
        final, states, attentions, exit_layers = self.run_layers(
            sequence.hidden_states,
            sequence.absolute,
            sequence.num_image,
            sequence.text_buckets,
            sequence.image_buckets,
            layers,
            output_attentions,
            exit_settings,
            part="encoder",
            real_tokens=~sequence.padding,
            output_hidden_states=output_hidden_states,
        )
        present = torch.tensor([bool(sequence.num_image), bool(sequence.text_length)], device=exit_layers.device)
        return final, states, attentions, exit_layers[:, None] * present

    def run_streams(
        self,
        sequence: "EncoderSequence",
        layers: list[int],
        exit_settings: EarlyExitSettings | None,
        output_attentions: bool,
        output_hidden_states: bool,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """MuE's decomposed encoder: each modality attends only to itself, through the same layers, and may stop on
        its own; the streams meet in the decoder's cross-attention. Returns what `run_joint` does: each layer's
        attentions over the whole sequence when `output_attentions` (zero between the streams, which never attend to
        each other), each layer's states when `output_hidden_states`."""
        n, padding = sequence.num_image, sequence.padding
        image_rel = sequence.image_buckets if self.config.decomposed_image_relative_bias else None
        streams = [
            self.run_layers(
                sequence.hidden_states[:, :n], sequence.absolute[:, :, :n, :n], n, None, image_rel, layers,
                output_attentions, exit_settings, part="encoder_image", output_hidden_states=output_hidden_states,
            ) if n else None,
            self.run_layers(
                sequence.hidden_states[:, n:], sequence.absolute[:, :, n:, n:], 0, sequence.text_buckets, None, layers,
                output_attentions, exit_settings, part="encoder_text",
                real_tokens=~padding[:, n:] if torch.compiler.is_compiling() or bool(padding.any()) else None,
                output_hidden_states=output_hidden_states,
            ) if sequence.text_length else None,
        ]  # fmt: skip
        ran = [stream for stream in streams if stream is not None]
        final = torch.cat([stream[0] for stream in ran], dim=1)
        per_layer = zip(*(stream[1] for stream in ran), strict=True)
        layer_states = [torch.cat(layer, dim=1) for layer in per_layer] if output_hidden_states else []
        layer_attentions = []
        if output_attentions:  # each stream's [batch, heads, S, S] padded to the sequence's keys, stacked by queries
            starts, length = (0, n) if len(ran) == 2 else (0,), final.shape[1]
            blocks = [
                [F.pad(weights, (start, length - start - weights.shape[-1])) for weights in stream[2]]
                for stream, start in zip(ran, starts, strict=True)
            ]
            layer_attentions = [torch.cat(layer, dim=2) for layer in zip(*blocks, strict=True)]
        no_layers = torch.zeros(padding.shape[0], dtype=torch.long, device=padding.device)
        exit_layers = torch.stack([no_layers if stream is None else stream[3] for stream in streams], dim=1)
        return final, layer_states, layer_attentions, exit_layers

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.FloatTensor | None = None,
        exit_settings: EarlyExitSettings | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        return_dict: bool = True,
        inputs_embeds: torch.FloatTensor | None = None,
    ) -> OFAEncoderOutput:
        """`exit_settings` (optional) carries the exit controllers: `encoder` for the joint encoder, or
        `encoder_image` / `encoder_text` for the streams of a decomposed one. `inputs_embeds` [batch, T, d] may
        replace `input_ids`: the text's token embeddings (`get_input_embeddings()(input_ids)`); images still enter as
        `pixel_values`. `return_dict` is taken because `generate` passes it; the output is always an
        `OFAEncoderOutput`."""
        check_one_of(input_ids, inputs_embeds, "input_ids", "inputs_embeds")
        if input_ids is None and inputs_embeds is None and pixel_values is None:
            raise ValueError("The encoder needs `input_ids` (or `inputs_embeds`), `pixel_values` or both.")
        decomposed = self.config.decompose_encoder_modalities
        if exit_settings is not None and any(getattr(exit_settings, part) is not None for part in ENCODER_PARTS):
            check_no_layerdrop("encoder_layerdrop", self.config.encoder_layerdrop, self.training)
        sequence = self.embed(input_ids, attention_mask, pixel_values, inputs_embeds)
        # One LayerDrop draw per forward, so both streams of a decomposed encoder skip the same layers.
        layers = layers_to_run(len(self.layers), self.config.encoder_layerdrop, self.training)
        if decomposed:
            final, states, attentions, exit_layers = self.run_streams(
                sequence, layers, exit_settings, output_attentions, output_hidden_states
            )
        else:
            final, states, attentions, exit_layers = self.run_joint(
                sequence, layers, exit_settings, output_attentions, output_hidden_states
            )
        return OFAEncoderOutput(
            last_hidden_state=self.layer_norm(final),
            padding_mask=sequence.padding,
            position_embedding=sequence.position_embedding,
            hidden_states=tuple(states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            exit_layers=exit_layers,
        )


@dataclass
class OFADecoderOutput(BaseModelOutputWithPastAndCrossAttentions):
    r"""
    exit_hidden_states (`tuple(torch.FloatTensor)`, with `output_exit_hidden_states=True`):
        The input of the output projection at each exit point of `config.exit_points`, then at the last layer
        (`last_hidden_state`): [batch, q, d_model] each, after the shared final LayerNorm.
    exit_layers (`torch.LongTensor` [batch]):
        The decoder layer each row's output comes from for these q tokens: its exit (all of them without a decoder
        exit; under `row_exit="keep"` a row may run deeper with the batch).
    logits (`torch.FloatTensor` [batch, 1, vocab], only when the exit head computed them):
        The output projection of `last_hidden_state`, when every row stopped at one exit whose controller asked
        for the exit head's logits (a confidence policy): they are the same, so the model does not project again.
    """

    exit_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    logits: torch.FloatTensor | None = None
    exit_layers: torch.LongTensor | None = None


@dataclass
class SlotBiases:
    """`OFADecoder.attention_biases` of queries at every slot from `first` on, [batch, ...]: a verification runs each
    layer on some of the same slots, and picks their biases here."""

    first: int
    self_absolute: torch.Tensor  # [batch, heads, Q, T]
    buckets: torch.Tensor  # [batch, Q, T]
    cross_bias: torch.Tensor  # [batch, heads, Q, S]

    def select(
        self, rows: torch.Tensor | None, slots: torch.Tensor | slice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The biases of the queries at `slots` [R, P] (-1 = padding) of `rows` [R], or at the slice `slots` of
        every row (`rows` None)."""
        if isinstance(slots, slice):
            local = slice(slots.start - self.first, slots.stop - self.first)
            return self.self_absolute[:, :, local], self.buckets[:, local], self.cross_bias[:, :, local]
        local = (slots - self.first).clamp(min=0)
        heads, length, source = self.self_absolute.shape[1], self.self_absolute.shape[-1], self.cross_bias.shape[-1]
        by_query = local[:, None, :, None]
        return (
            self.self_absolute[rows].gather(2, by_query.expand(-1, heads, -1, length)),
            self.buckets[rows].gather(1, local[:, :, None].expand(-1, -1, length)),
            self.cross_bias[rows].gather(2, by_query.expand(-1, heads, -1, source)),
        )


@dataclass
class DecoderStepBiases:
    """The position terms of one decoder step's queries.

    positions [batch or 1, T, d]: LayerNorm'd position embeddings of every token so far (None when sliced from the
    table and no catch-up reads them). position_ids [batch or 1, T]. self_absolute [batch or 1, heads, q, T]: the
    masked absolute self-attention bias. buckets [batch or 1, q, T]: relative buckets. cross_bias [batch, heads, q, S]:
    the cross-attention bias with the encoder padding mask. query_mask [batch, q] or None: the step's decoder mask.
    query_start: the slot of the first query (a device tensor with a `StaticCache`, which `narrowed` does not take).
    """

    positions: torch.Tensor | None
    position_ids: torch.Tensor
    self_absolute: torch.Tensor
    buckets: torch.Tensor
    cross_bias: torch.Tensor
    query_mask: torch.Tensor | None
    query_start: int | torch.Tensor

    def narrowed(self, start: int, count: int, length: int) -> "DecoderStepBiases":
        """The terms of `count` queries at slots `start`.. over the first `length` key slots, sliced from these
        (which cover them): one step's, from those of a speculative round computed at once."""
        first, covered = start - self.query_start, self.self_absolute.shape[2]
        if not (0 <= first and first + count <= covered and length <= self.self_absolute.shape[3]):
            raise ValueError(
                f"These position terms cover queries at slots {self.query_start}..{self.query_start + covered - 1} "
                f"over {self.self_absolute.shape[3]} key slots, not {count} at slot {start} over {length}."
            )
        queries = slice(first, first + count)
        return DecoderStepBiases(
            None if self.positions is None else self.positions[:, :length],
            self.position_ids[:, :length],
            self.self_absolute[:, :, queries, :length],
            self.buckets[:, queries, :length],
            self.cross_bias[:, :, queries],
            None if self.query_mask is None else self.query_mask[:, queries],
            start,
        )


@dataclass
class DraftVocabulary:
    """The output projection restricted to speculative mode's `draft_vocabulary`: its token `ids` [V'] and their rows
    of the projection (`weight` [V', d], `bias`), read once per call; None where the projection must be called
    (wrapped or hooked, `plain_modules`)."""

    ids: torch.Tensor
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def of(cls, projection: nn.Linear, ids: Sequence[int], device: torch.device) -> "DraftVocabulary":
        index = torch.tensor(ids, device=device)
        if not plain_modules([projection]):
            return cls(index, None, None)
        bias = None if projection.bias is None else projection.bias[index]
        return cls(index, projection.weight[index], bias)

    def logits(self, normalized: torch.Tensor, projection: nn.Linear) -> torch.Tensor:
        """[..., vocab] logits of final-LayerNorm'd states [..., d] over the draft vocabulary, -inf elsewhere: a
        draft never proposes the other tokens, and its distribution gives them no mass."""
        if self.weight is None:
            scored = projection(normalized)[..., self.ids]
        else:
            scored = F.linear(normalized, self.weight, self.bias)
        logits = scored.new_full((*scored.shape[:-1], projection.out_features), -torch.inf)
        return logits.index_copy_(-1, self.ids, scored)


@dataclass
class DecoderPositionTable:
    """The decoder's position terms for every position id 0..P-1, so that a decoding step slices (or gathers) them
    instead of recomputing them. P starts at 64 or the first power of two not below the step's length and doubles as
    decoding needs (`call_position_table`), up to the table's max_position_embeddings + 2 rows.

    positions: [P, d], the LayerNorm'd position embeddings. self_queries / self_keys / cross_queries: [heads, P,
    head_dim], the queries scaled. buckets: [P, P], the relative bucket of (query, key).
    """

    positions: torch.Tensor
    self_queries: torch.Tensor
    self_keys: torch.Tensor
    cross_queries: torch.Tensor
    buckets: torch.Tensor


class OFADecoder(nn.Module):
    """Token embeddings -> causal layers with cross-attention -> LayerNorm; `output_projection` is the LM head."""

    def __init__(self, config: OFAEarlyExitConfig):
        super().__init__()
        self.config = config
        d_model, heads = config.d_model, config.decoder_attention_heads
        self.num_heads = heads
        self.embed_scale = math.sqrt(d_model) if config.scale_embedding else 1.0
        self.pos_scaling = (d_model / heads * config.attn_scale_factor) ** -0.5
        self.dropout = nn.Dropout(config.dropout)

        self.embed_tokens = nn.Embedding(config.vocab_size, d_model, config.pad_token_id)
        self.layernorm_embedding = optional_layer_norm(config.layernorm_embedding, d_model)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + 2, d_model)
        self.pos_ln = nn.LayerNorm(d_model)
        self.self_pos_q_linear = nn.Linear(d_model, d_model)
        self.self_pos_k_linear = nn.Linear(d_model, d_model)
        self.cross_pos_q_linear = nn.Linear(d_model, d_model)
        self.cross_pos_k_linear = nn.Linear(d_model, d_model)
        # Image-code generation parts of OFA: unused for text, kept so official checkpoints load strictly.
        self.code_layernorm_embedding = optional_layer_norm(config.code_layernorm_embedding, d_model)
        self.embed_image_positions = nn.Embedding(config.image_bucket_size**2 + 1, d_model)
        self.image_pos_ln = nn.LayerNorm(d_model)

        rates = drop_path_rates(config.decoder_drop_path_rate, config.decoder_layers)
        self.layers = nn.ModuleList(OFADecoderLayer(config, i, rates[i]) for i in range(config.decoder_layers))
        self.token_rel_pos_table_list, self.image_rel_pos_table_list = relative_tables(
            config, config.decoder_layers, heads
        )
        self.layer_norm = nn.LayerNorm(d_model)
        self.output_projection = nn.Linear(d_model, config.vocab_size, bias=False)
        self.measured_layer_costs: dict[tuple, LayerCosts] = {}  # (batch, query, source, dtype, device) -> costs
        # Exit heads: modules between a layer's output and the shared final LayerNorm + output projection.
        self.exit_points = {layer: i for i, layer in enumerate(config.exit_points)}  # 1-based layer -> index
        self.exit_adapters = self.exit_transformer_layers = None
        if config.exit_adapter_dim is not None:
            self.exit_adapters = nn.ModuleList(OFAExitAdapter(config) for _ in config.exit_points)
        elif config.exit_transformer_layers is not None:
            self.exit_transformer_layers = nn.ModuleList(
                OFAExitLayer(config, layer - 1) for layer in config.exit_transformer_layers
            )

    def cross_position_keys(self, encoder_outputs: OFAEncoderOutput) -> torch.Tensor:
        """Keys of the cross-attention position bias, [batch, heads, S, head_dim].

        They depend only on the encoder output and the weights, so during generation (no grad) they are computed
        once and kept on the encoder output (for one `generate` call: see `OFAEncoderOutput`); with grad they are
        always recomputed, so training never reads stale weights.
        """
        if encoder_outputs.cross_position_keys is not None and not torch.is_grad_enabled():
            return encoder_outputs.cross_position_keys
        keys = split_heads(self.cross_pos_k_linear(encoder_outputs.position_embedding), self.num_heads)
        if not torch.is_grad_enabled():
            encoder_outputs.cross_position_keys = keys
        return keys

    def attention_biases(
        self,
        positions: torch.Tensor,
        position_ids: torch.Tensor,
        query_slots: torch.Tensor,
        attention_mask: torch.Tensor | None,
        encoder_outputs: OFAEncoderOutput,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Biases of queries at `query_slots` [R or 1, Q] (cache slots, i.e. indices into the T tokens so far).

        positions [R or 1, T, d] (LayerNorm'd position embeddings), position_ids [R or 1, T], attention_mask
        [R, T] or None, and `rows` the R batch rows of the encoder output (None: all). Returns the self-attention
        absolute bias with the causal and padding masks [R or 1, heads, Q, T], the relative buckets [R or 1, Q, T]
        and the cross-attention bias with the encoder padding mask [R, heads, Q, S].
        """
        count = max(positions.shape[0], query_slots.shape[0])
        query_slots = query_slots.expand(count, -1)
        query_positions = positions.expand(count, -1, -1).gather(
            1, query_slots[..., None].expand(-1, -1, positions.shape[-1])
        )  # [R or 1, Q, d]
        query_ids = position_ids.expand(count, -1).gather(1, query_slots)
        self_absolute = position_bias(
            self.self_pos_q_linear, self.self_pos_k_linear, query_positions, positions, self.num_heads, self.pos_scaling
        )
        masked = causal_mask(query_slots, positions.shape[1], positions.device)[:, None]  # [R or 1, 1, Q, T]
        if attention_mask is not None:
            masked = masked | attention_mask.eq(0)[:, None, None, :]
        # Masked once here; the relative biases added per layer keep them at ~finfo.min.
        self_absolute = self_absolute.masked_fill(masked, torch.finfo(self_absolute.dtype).min)
        buckets = token_relative_buckets(
            query_ids[:, :, None] - position_ids[:, None, :],
            self.config.token_bucket_size,
            self.config.max_position_embeddings,
        )

        cross_keys, padding = self.cross_position_keys(encoder_outputs), encoder_outputs.padding_mask
        if rows is not None:
            cross_keys, padding = cross_keys[rows], padding[rows]
        cross_bias = torch.matmul(
            split_heads(self.cross_pos_q_linear(query_positions), self.num_heads) * self.pos_scaling,
            cross_keys.transpose(-1, -2),
        )
        cross_bias = cross_bias.masked_fill(padding[:, None, None, :], torch.finfo(cross_bias.dtype).min)
        return self_absolute, buckets, cross_bias

    def position_table(self, size: int, device: torch.device) -> DecoderPositionTable:
        """The `DecoderPositionTable` of position ids 0..`size`-1 (no grad), through the modules' own calls (an
        adapter or hook on them applies)."""
        ids = torch.arange(size, device=device)
        positions = self.pos_ln(self.embed_positions(ids))[None]  # [1, size, d]
        return DecoderPositionTable(
            positions=positions[0],
            self_queries=split_heads(self.self_pos_q_linear(positions), self.num_heads)[0] * self.pos_scaling,
            self_keys=split_heads(self.self_pos_k_linear(positions), self.num_heads)[0],
            cross_queries=split_heads(self.cross_pos_q_linear(positions), self.num_heads)[0] * self.pos_scaling,
            buckets=token_relative_buckets(
                ids[:, None] - ids[None, :], self.config.token_bucket_size, self.config.max_position_embeddings
            ),
        )

    def call_position_table(
        self, self_cache: EarlyExitCache, length: int, device: torch.device
    ) -> DecoderPositionTable:
        """The call's `position_table`, covering at least `length` positions: made at the first step and remade
        twice as long when a longer step needs it (a whole table of OFA-base costs more than a few steps)."""
        size = min(self.embed_positions.num_embeddings, max(64, 1 << (length - 1).bit_length()))
        return self_cache.derived(
            "position_table",
            lambda: self.position_table(size, device),
            fits=lambda table: len(table.positions) >= length,
        )

    def table_attention_biases(
        self,
        query_slots: slice | torch.Tensor,
        length: int,
        encoder_outputs: OFAEncoderOutput,
        table: DecoderPositionTable,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`attention_biases` of new tokens at `query_slots` (a slice, or [q] on the device) of `length` key slots,
        read from the `position_table`: sliced for rows at positions 0, 1, ... (`position_ids` None; then the first
        two tensors have a batch of 1), gathered at each row's `position_ids` [batch, length] otherwise (a decoder
        mask, or a speculative batch's rows skipping their rejected drafts), with the `attention_mask` [batch,
        length]."""
        if position_ids is None:
            queries, keys = table.self_queries[None, :, query_slots], table.self_keys[None, :, :length]
            cross_queries, buckets = (
                table.cross_queries[None, :, query_slots],
                table.buckets[None, query_slots, :length],
            )
        else:
            query_ids = position_ids[:, query_slots]  # [batch, q]
            queries, keys = (
                table.self_queries[:, query_ids].transpose(0, 1),
                table.self_keys[:, position_ids].transpose(0, 1),
            )
            cross_queries = table.cross_queries[:, query_ids].transpose(0, 1)  # [batch, heads, q, head_dim]
            buckets = table.buckets[query_ids[:, :, None], position_ids[:, None, :]]
        self_absolute = torch.matmul(queries, keys.transpose(-1, -2))  # [batch or 1, heads, q, T]
        masked = causal_mask(query_slots, length, self_absolute.device)
        if attention_mask is not None:
            padding = attention_mask.eq(0)[:, None, None, :]
            masked = padding if masked is None else masked | padding
        if masked is not None:
            self_absolute = self_absolute.masked_fill(masked, torch.finfo(self_absolute.dtype).min)
        cross_bias = torch.matmul(cross_queries, self.cross_position_keys(encoder_outputs).transpose(-1, -2))
        padding = encoder_outputs.padding_mask[:, None, None, :]
        cross_bias = cross_bias.masked_fill(padding, torch.finfo(cross_bias.dtype).min)  # [batch, heads, q, S]
        return self_absolute, buckets, cross_bias

    def layer_self_bias(self, layer_idx: int, self_absolute: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
        """A layer's self-attention bias: the masked absolute bias plus its relative bias, [R or 1, heads, Q, T]."""
        return self_absolute + self.token_rel_pos_table_list[layer_idx](buckets).permute(0, 3, 1, 2)

    def layer_costs(self, batch: int, query: int, source: int, dtype: torch.dtype) -> LayerCosts:
        """A layer's seconds over rows of a step of `query` tokens per row attending to `source` encoder states, with
        the cache, for `row_exit="auto"`: measured on first use per batch, query length, source length (rounded up
        to a multiple of 32), dtype and device, then kept."""
        source, device = -(-source // 32) * 32, self.pos_ln.weight.device
        key = (batch, query, source, dtype, device)
        if key in self.measured_layer_costs:
            return self.measured_layer_costs[key]
        with random_state_kept(device):
            hidden = torch.randn(batch, query, self.config.d_model, device=device, dtype=dtype)
            encoder_hidden_states = torch.randn(batch, source, self.config.d_model, device=device, dtype=dtype)
            cache = new_cache(self.config, None)
            slots = cache.self_attention_cache.open_slots(hidden, self.num_heads)
            self_bias = hidden.new_zeros(1, self.num_heads, query, query)
            cross_bias = hidden.new_zeros(1, self.num_heads, query, source)
            keep = torch.arange(batch, device=device) > 0
            crossing = hidden.new_zeros(batch, self.num_heads, query, source)  # a per-row bias the loop carries

            def layer_on(rows: torch.Tensor) -> Callable[[], object]:
                active = None if len(rows) == batch else ActiveRows.of(rows)
                layer = self.layers[0]
                return functools.partial(layer, hidden[rows], self_bias, encoder_hidden_states, cross_bias, cache,
                                         active, slots)  # fmt: skip

            self.measured_layer_costs[key] = LayerCosts.measure(
                batch, layer_on, lambda: (hidden[keep], crossing[keep]), device
            )
        return self.measured_layer_costs[key]

    def exit_logits(self, hidden_states: torch.Tensor, vocabulary: DraftVocabulary | None = None) -> torch.Tensor:
        """Logits of exit-head inputs [..., d]: the shared final LayerNorm and output projection, over a draft's
        `vocabulary` only when given."""
        return self.projected(self.layer_norm(hidden_states), vocabulary)

    def projected(self, normalized: torch.Tensor, vocabulary: DraftVocabulary | None = None) -> torch.Tensor:
        """The output projection of final-LayerNorm'd states [..., d], over a draft's `vocabulary` only when given."""
        if vocabulary is None:
            return self.output_projection(normalized)
        return vocabulary.logits(normalized, self.output_projection)

    def draft_vocabulary(
        self, exit_settings: EarlyExitSettings | None, self_cache: EarlyExitCache | None, device: torch.device
    ) -> DraftVocabulary | None:
        """The settings' `draft_vocabulary` over the output projection, read once per call (kept in its cache)."""
        ids = exit_settings.draft_vocabulary if exit_settings is not None else None
        if ids is None:
            return None
        make = functools.partial(DraftVocabulary.of, self.output_projection, ids, device)
        return make() if self_cache is None else self_cache.derived("draft_vocabulary", make)

    def exit_hidden_states(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        layer_input: torch.Tensor,
        self_bias: torch.Tensor,
        cross_bias: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        past_key_values: EncoderDecoderCache | None,
        rows: ActiveRows | None,
    ) -> torch.Tensor:
        """The exit head's input after 1-based decoder `layer`, whose output for the running rows is
        `hidden_states` [rows, q, d]: the output itself (shared head, MuE), its adapter's (DEED) or its exit
        transformer layer's (BLIPEE). `layer_input`, the biases and the cache are the host layer's."""
        index = self.exit_points[layer]
        if self.exit_adapters is not None:
            return self.exit_adapters[index](hidden_states)
        if self.exit_transformer_layers is None:
            return hidden_states
        host = layer - 1
        if past_key_values is not None:  # the host just wrote this step's K/V into its entries
            self_keys = past_key_values.self_attention_cache.layers[host]
            cross_keys = past_key_values.cross_attention_cache.layers[host]
            host_key_values = (self_keys.keys, self_keys.values, cross_keys.keys, cross_keys.values)
        else:
            rows_source = encoder_hidden_states if rows is None else encoder_hidden_states[rows.index]
            host_layer = self.layers[host]
            host_key_values = (
                *host_layer.self_key_values(layer_input),
                *host_layer.cross_attn.project_kv(rows_source),
            )
            rows = None
        return self.exit_transformer_layers[index](hidden_states, self_bias, host_key_values, cross_bias, rows)

    def folded_key_value_projections(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer's self-attention k and v projections with its pre-attention LayerNorm's affine folded in,
        stacked, per layer k then v: weight [layers * 2 * d, d], bias [layers * 2 * d]. For n the normalised state,
        k = W_k (g * n + b) + c = (W_k g) n + (W_k b + c), so `propagate` projects an exited state into every layer
        it skipped with one LayerNorm and one matmul (no grad). None unless every module is plain (`plain_modules`)
        and stacking pays (`stacking_pays`)."""
        projections = [
            (projection, layer.self_attn_layer_norm)
            for layer in self.layers
            for projection in (layer.self_attn.k_proj, layer.self_attn.v_proj)
        ]
        if not plain_modules(module for pair in projections for module in pair):
            return None
        if not stacking_pays([projection.weight for projection, _ in projections]):
            return None
        weight = torch.cat([projection.weight * norm.weight for projection, norm in projections])
        bias = torch.cat([projection.weight @ norm.bias + projection.bias for projection, norm in projections])
        return weight, bias

    def cross_key_value_projections(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer's cross-attention k and v projections, stacked, per layer k then v: weight [layers * 2 * d, d],
        bias [layers * 2 * d] (no grad). None unless every projection is plain (`plain_modules`) and stacking pays
        (`stacking_pays`)."""
        projections = [p for layer in self.layers for p in (layer.cross_attn.k_proj, layer.cross_attn.v_proj)]
        if not plain_modules(projections) or not stacking_pays([projection.weight for projection in projections]):
            return None
        return torch.cat([p.weight for p in projections]), torch.cat([p.bias for p in projections])

    def cache_cross_key_values(self, encoder_hidden_states: torch.Tensor, past_key_values: EncoderDecoderCache) -> None:
        """Every layer's cross-attention K/V of the encoder output [batch, S, d] into the cache, in one projection
        where stacking pays (`stacking_pays`): at decoding's first step, two small matmuls per layer cost more in
        calls than in arithmetic, and a layer first reached at a later step finds its entry ready."""
        stacked = self.cross_key_value_projections()
        if stacked is None:  # each layer projects its own on first use
            return
        projected = F.linear(encoder_hidden_states, *stacked)  # [batch, S, layers * 2 * d]
        key_values = split_layer_key_values(projected, self.num_heads, self.config.d_model)
        for layer_idx, (key, value) in enumerate(key_values):
            past_key_values.cross_attention_cache.update(key, value, layer_idx)
            past_key_values.is_updated[layer_idx] = True

    def skipped_key_values(
        self,
        first: int,
        hidden_states: torch.Tensor,
        folded: Callable[[], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Self-attention K/V [rows, heads, q, head_dim] of exited states [rows, q, d] in each layer from 0-based
        `first` to the last (`kv_strategy="propagate"`): where `folded()` gives `folded_key_value_projections`, in one
        projection; else layer by layer."""
        folded = folded() if folded is not None else None
        if folded is None:
            return [layer.self_key_values(hidden_states) for layer in self.layers[first:]]
        d, norm = self.config.d_model, self.layers[first].self_attn_layer_norm
        normalized = F.layer_norm(hidden_states, norm.normalized_shape, eps=norm.eps)
        projected = F.linear(normalized, folded[0][first * 2 * d :], folded[1][first * 2 * d :])
        return split_layer_key_values(projected, self.num_heads, d)

    def catch_up(
        self,
        layer_idx: int,
        waiting: tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | slice],
        past_key_values: EncoderDecoderCache,
        positions: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        encoder_outputs: OFAEncoderOutput,
        slot_biases: "SlotBiases | None" = None,
    ) -> None:
        """`kv_strategy="recompute"`: run layer `layer_idx` on the `waiting` tokens, earlier tokens that exited below it
        (`EarlyExitCache.pending_inputs` or `planned_inputs`), so that its keys and values are complete (DEED). Their
        biases are computed here, or picked from `slot_biases`."""
        rows, hidden_states, slots = waiting  # [R] or None (all), [R, P, d], [R, P] (-1 = padding) or a slice
        if slot_biases is not None:
            self_absolute, buckets, cross_bias = slot_biases.select(rows, slots)
        else:
            query_slots = torch.arange(slots.start, slots.stop)[None] if isinstance(slots, slice) else slots
            self_absolute, buckets, cross_bias = self.attention_biases(
                select_rows(positions, rows),
                select_rows(position_ids, rows),
                query_slots.clamp(min=0).to(hidden_states.device),
                select_rows(attention_mask, rows),
                encoder_outputs,
                rows,
            )
        hidden_states, _, _ = self.layers[layer_idx](
            hidden_states,
            self.layer_self_bias(layer_idx, self_absolute, buckets),
            encoder_outputs.last_hidden_state,
            cross_bias,
            past_key_values,
            None if rows is None else ActiveRows.of(rows),
            slots,
        )
        past_key_values.self_attention_cache.advance(layer_idx, rows, slots, hidden_states)

    def layer_inputs(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        """The first layer's inputs [batch, q, d] of token embeddings [batch, q, d]: scaled, LayerNorm'd."""
        return self.dropout(self.layernorm_embedding(inputs_embeds * self.embed_scale))

    def verify(
        self,
        input_ids: torch.LongTensor | None,
        encoder_outputs: OFAEncoderOutput,
        attention_mask: torch.Tensor | None,
        past_key_values: EncoderDecoderCache,
        position_ids: torch.LongTensor | None = None,
        step_biases: DecoderStepBiases | None = None,
    ) -> None:
        """`kv_strategy="recompute"`: append `input_ids` [batch, q] to the cache as tokens waiting for the first layer,
        then run each layer once on every token waiting for it (the layers earlier tokens skipped, and all of the new
        ones'), so that every slot holds the K/V of a full-depth pass. The final-layer output of each token that ran
        here waits in the cache (`pending`): speculative decoding reads the full model's distributions there. With
        `input_ids` None, only the cache's waiting tokens run. `step_biases`: a speculative round's position terms,
        computed for its slots from `step_biases.query_start` on (else computed here); no token may wait before that
        slot, since the layers then run the round's slots only (a round starts with every slot complete)."""
        self_cache = past_key_values.self_attention_cache
        if input_ids is not None:
            hidden_states = self.layer_inputs(self.embed_tokens(input_ids))
            self_cache.wait(self_cache.open_slots(hidden_states, self.num_heads), hidden_states)
        batch, length = encoder_outputs.last_hidden_state.shape[0], self_cache.get_seq_length()
        # Every layer runs on some of the slots from the first waiting one on: their biases, computed once.
        if step_biases is not None:
            first = step_biases.query_start
        else:
            first = int((self_cache.frontier < len(self.layers)).any(dim=0).long().argmax())
        step = self.step_biases(
            first, length - first, length, attention_mask, encoder_outputs, self_cache, position_ids, step_biases
        )
        biases = (step.self_absolute, step.buckets, step.cross_bias)
        slot_biases = SlotBiases(first, *(bias.expand(batch, *bias.shape[1:]) for bias in biases))
        plan = self_cache.catch_up_plan(first)
        for layer_idx in range(len(self.layers)):
            waiting = self_cache.planned_inputs(layer_idx, plan, first)
            if waiting is not None:
                self.catch_up(
                    layer_idx, waiting, past_key_values, step.positions, step.position_ids, attention_mask,
                    encoder_outputs, slot_biases,
                )  # fmt: skip
        self_cache.waiting_layers.clear()  # every slot now holds a full-depth pass

    def complete_layer(
        self,
        layer_idx: int,
        rows: torch.Tensor,
        past_key_values: EncoderDecoderCache,
        step: "DecoderStepBiases",
        attention_mask: torch.Tensor | None,
        encoder_outputs: OFAEncoderOutput,
    ) -> None:
        """Before layer `layer_idx` reads the cache: the slots earlier tokens left empty in it are filled
        (`propagate`, `copy`), or the layer runs on their waiting states (`recompute`)."""
        self_cache = past_key_values.self_attention_cache
        self_cache.fill_skipped(layer_idx)
        waiting = self_cache.pending_inputs(layer_idx, rows) if self_cache.frontier is not None else None
        if waiting is not None:
            self.catch_up(
                layer_idx, waiting, past_key_values, step.positions, step.position_ids, attention_mask, encoder_outputs
            )

    def checked_cache(
        self,
        past_key_values: EncoderDecoderCache | None,
        exit_settings: EarlyExitSettings | None,
        batch: int,
        query_length: int,
        attention_mask: torch.Tensor | None,
        training_outputs: bool,
    ) -> tuple[Cache | None, int | torch.Tensor, int]:
        """The self-attention cache of this step (`batch` rows of `query_length` tokens), after checking the step's
        inputs against it and the exit plan, with `cache_span`'s past and key length."""
        self_cache = past_key_values.self_attention_cache if past_key_values is not None else None
        early = isinstance(self_cache, EarlyExitCache)
        if self_cache is not None and not early and exit_settings is not None and exit_settings.decoder is not None:
            raise ValueError(
                "Decoder exits need an EarlyExitCache as the self-attention cache (`EncoderDecoderCache(EarlyExitCache("
                f"config), DynamicCache())`), got {type(self_cache).__name__}: a {type(self_cache).__name__} serves "
                "the full decoder only."
            )
        if early:
            check_cache_fits(self_cache, len(self.layers), batch)
        past, length = cache_span(self_cache, query_length)
        covered = past + query_length  # a static cache's past is a device tensor: read it only outside a tracer
        if attention_mask is not None and not torch.compiler.is_compiling() and attention_mask.shape[-1] != covered:
            raise ValueError(
                f"`decoder_attention_mask` must cover the cached and new tokens ({int(covered)}), "
                f"got {attention_mask.shape[-1]}."
            )
        if exit_settings is None or exit_settings.decoder is None:
            return self_cache, past, length
        if self_cache is not None and self_cache.kv_strategy != exit_settings.kv_strategy:
            raise ValueError(
                f"`kv_strategy={exit_settings.kv_strategy!r}` but the cache passed in was built for "
                f"{self_cache.kv_strategy!r}."
            )
        if training_outputs:
            raise ValueError("`output_exit_hidden_states` (training the exits) is not available with decoder exits.")
        check_no_layerdrop("decoder_layerdrop", self.config.decoder_layerdrop, self.training)
        return self_cache, past, length

    def step_biases(
        self,
        past: int | torch.Tensor,
        query: int,
        length: int,
        attention_mask: torch.Tensor | None,
        encoder_outputs: OFAEncoderOutput,
        self_cache: EarlyExitCache | None,
        position_ids: torch.Tensor | None = None,
        computed: DecoderStepBiases | None = None,
    ) -> DecoderStepBiases:
        """The position terms of `query` queries at slots past.. of the `length` key slots (`cache_span`); read from
        the `position_table` when no gradient is needed and no tracer runs (it would trace the whole table in at every
        step): sliced when rows have no decoder mask or position ids (positions 0, 1, ...), gathered otherwise. Taken
        from `computed` when given, terms computed before for these queries among others."""
        if computed is not None:
            return computed.narrowed(past, query, length)
        device = encoder_outputs.last_hidden_state.device
        # Slots are positions, but where rows skip holes (speculative decoding): then read the positions themselves.
        skips = position_ids is not None and length > self.config.max_position_embeddings
        reached = int(position_ids.max()) + 1 if skips else length
        check_positions(reached, self.config, "The decoder's tokens (prompt and new ones) reach")
        from_table = (
            self_cache is not None
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and length <= self.embed_positions.num_embeddings
        )
        unmasked = attention_mask is None and position_ids is None
        query_mask = attention_mask[:, -query:] if attention_mask is not None else None
        if attention_mask is not None:  # a static cache's slots not yet written count as pads
            attention_mask = F.pad(attention_mask, (0, length - attention_mask.shape[-1]))
        if position_ids is None:
            position_ids = position_ids_from_mask(attention_mask, length, device)  # [batch or 1, length]
        positions = None  # LayerNorm'd position embeddings: read by the computed biases and `recompute`'s catch-up
        # Slots the host knows are sliced, not gathered (a `StaticCache` holds its length on the device).
        on_host = from_table and isinstance(past, int)
        query_slots = slice(past, past + query) if on_host else past + torch.arange(query, device=device)
        if from_table:
            table = self.call_position_table(self_cache, length, device)
            gathered = None if unmasked else position_ids.expand(len(encoder_outputs.last_hidden_state), -1)
            biases = self.table_attention_biases(query_slots, length, encoder_outputs, table, gathered, attention_mask)
            if self_cache.kv_strategy == "recompute":
                positions = table.positions[None, :length] if unmasked else table.positions[gathered]
        else:
            positions = self.pos_ln(self.embed_positions(position_ids))
            biases = self.attention_biases(positions, position_ids, query_slots[None], attention_mask, encoder_outputs)
        return DecoderStepBiases(positions, position_ids, *biases, query_mask, past)

    def exit_question(
        self,
        exit_settings: EarlyExitSettings,
        count: int,
        num_layers: int,
        new_tokens: int | torch.Tensor,
        hidden_states: torch.Tensor,
        previous: torch.Tensor,
        exits: RowExits,
        query_mask: torch.Tensor | None,
        exit_state: Callable[[], torch.Tensor],
        finished: torch.Tensor | None,
        vocabulary: DraftVocabulary | None = None,
    ) -> tuple[torch.Tensor, ExitState]:
        """Ask the decoder's controller which running rows stop after layer `count`: BoolTensor[rows] and its state.
        `new_tokens`: the tokens each row generated before this step's (`new_tokens_before`). Rows in `finished`
        [batch] stop whatever the controller says. With a draft `vocabulary`, the exit head's
        logits score its tokens only."""
        state = ExitState(
            part="decoder",
            layer=count,
            step=new_tokens if isinstance(new_tokens, int) or exits.active is None else new_tokens[exits.running],
            hidden_states=hidden_states,
            previous_hidden_states=previous,
            rows=exits.running,
            num_layers=num_layers,
            max_steps=exit_settings.max_steps,
            attention_mask=query_mask,
            logits_fn=lambda: self.exit_logits(exit_state()[:, -1], vocabulary),
            waiting=exits.waiting_running,
        )
        stop = checked_decision(exit_settings.decoder(state), state, exit_settings.decoder)
        if finished is None:
            return stop, state
        return stop | (finished if exits.active is None else finished[exits.running]), state

    @staticmethod
    def new_tokens_before(
        past: int, exit_settings: EarlyExitSettings, position_ids: torch.Tensor | None, tokens: torch.Tensor
    ) -> int | torch.Tensor:
        """The tokens generated before this step's (`tokens` [batch, q]), after the decoder prompt: by slot, one count
        for the batch; in speculative mode at batch > 1, per row (LongTensor[batch]), since rows skip the slots of
        their rejected drafts and stand at their own steps (`position_ids` count a row's real tokens). At batch 1
        speculative mode crops every rejected slot, so slots count, unless the row is what remains of a larger
        batch (its finished rows left the decoder's batch) and skips holes (`position_ids` given)."""
        prompt, batch = exit_settings.prompt_length, tokens.shape[0]
        steps = max(past + 1 - prompt, 0)
        if exit_settings.exit_mode != "speculative" or (batch == 1 and position_ids is None):
            return steps
        if position_ids is None or not 1 <= prompt <= past:  # no row skipped a slot yet
            return torch.full((batch,), steps, dtype=torch.long, device=tokens.device)
        return (position_ids[:, past] - position_ids[:, prompt - 1]).clamp(min=0)

    def finished_rows(
        self, input_ids: torch.LongTensor | None, exit_settings: EarlyExitSettings, self_cache: EarlyExitCache | None
    ) -> torch.BoolTensor | None:
        """The rows of a decoding step whose tokens are thrown away: they stop at the first exit and never hold their
        batch in deeper layers. In `generate`'s greedy and sampling loop, the rows its stopping criteria ended at an
        earlier step (the cache's `ended`: by an end token, a stop string or a user's criterion; the tokens they are
        fed alone say nothing, since a running row may emit the pad token, and a prompt's start token may be an end
        token, as in BART); in a speculative round, the rows fed the pad token (those that do not draft). None
        otherwise, and outside one-token steps."""
        if input_ids is None or input_ids.shape[1] != 1:
            return None
        if exit_settings.exit_mode == "speculative":
            pad = self.config.pad_token_id
            return None if pad is None else input_ids[:, 0] == pad
        return None if self_cache is None else self_cache.ended

    def record_skipped_slots(
        self, self_cache: EarlyExitCache, exits: RowExits, slots: slice | None, exit_outputs: torch.Tensor
    ) -> None:
        """Record the slots the stopped rows left empty; the KV strategy fills them when a later token reads them."""
        project = self.skipped_key_values
        if self_cache.kv_strategy == "propagate" and not torch.is_grad_enabled():
            # Folded at the call's first fill: a call where no later token reads a skipped layer never folds.
            folded = self_cache.derived(
                "folded_key_value_projections", lambda: computed_once(self.folded_key_value_projections)
            )
            project = functools.partial(project, folded=folded)
        self_cache.record_skipped(exits.layers_run, exits.layers_run_rows, slots, exit_outputs, project)

    def forward(
        self,
        input_ids: torch.LongTensor,
        encoder_outputs: OFAEncoderOutput,
        attention_mask: torch.Tensor | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        exit_settings: EarlyExitSettings | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        output_exit_hidden_states: bool = False,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        step_biases: DecoderStepBiases | None = None,
    ) -> "OFADecoderOutput":
        """Decode `input_ids` [batch, q], the newest q tokens after the `past_key_values` prefix.

        `attention_mask` (optional, [batch, past + q]) marks decoder pads; without it every token is attended.
        `position_ids` (optional, [batch, past + q]) are the tokens' positions where they are not their slots (a
        speculative batch's rows skip the slots of their rejected drafts); by default OFA's, from the mask.
        With `exit_settings.decoder`, each row stops after the layer its controller picks (all q tokens of a row
        together), and its output is its exit head's; `RowExits` keeps it running with the batch or takes it out
        of the layers after (`exit_settings.row_exit`). The cache then fills the layers it skipped by
        `exit_settings.kv_strategy`. `exit_layers` in the output is the layer each row exited after.
        `output_exit_hidden_states` (training the exits) returns every exit head's input after the final LayerNorm.
        `step_biases`: position terms already computed for these queries (`DecoderStepBiases.narrowed` picks them from
        those of a speculative round's drafts, computed at once), else computed here.
        """
        check_one_of(input_ids, inputs_embeds, "decoder_input_ids", "decoder_inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        tokens = inputs_embeds[..., 0]  # [batch, q]: the step's shape and device, with or without ids
        cache, past, length = self.checked_cache(
            past_key_values, exit_settings, *tokens.shape, attention_mask, output_exit_hidden_states
        )
        # The cache that exits read and fill; a Transformers cache (decoder without exits) is only written.
        self_cache = cache if isinstance(cache, EarlyExitCache) else None
        if output_exit_hidden_states and self.training and self.config.decoder_layerdrop > 0:
            raise ValueError("`output_exit_hidden_states` needs every exit layer to run: set `decoder_layerdrop=0`.")
        controller = exit_settings.decoder if exit_settings is not None else None

        hidden_states = self.layer_inputs(inputs_embeds)  # [batch, q, d]
        step = self.step_biases(
            past, tokens.shape[1], length, attention_mask, encoder_outputs, self_cache, position_ids, step_biases
        )
        slots = self_cache.open_slots(hidden_states, self.num_heads) if self_cache is not None else None
        if cache is not None and not torch.is_grad_enabled() and not any(past_key_values.is_updated.values()):
            self.cache_cross_key_values(encoder_outputs.last_hidden_state, past_key_values)

        layers = layers_to_run(len(self.layers), self.config.decoder_layerdrop, self.training)
        batch, device = tokens.shape[0], tokens.device
        finished = self.finished_rows(input_ids, exit_settings, self_cache) if controller is not None else None
        if controller is None:
            exits = RowExits(batch, len(layers), device)
        else:
            source = encoder_outputs.last_hidden_state.shape[1]
            costs = functools.partial(self.layer_costs, batch, tokens.shape[1], source, hidden_states.dtype)
            exits = exit_settings.row_exits("decoder", batch, len(layers), device, costs, finished)
        self_absolute, buckets, cross_bias, query_mask = (
            step.self_absolute,
            step.buckets,
            step.cross_bias,
            step.query_mask,
        )
        layer_outputs, exit_states, state = [(hidden_states, None, None)], [], None  # (states, attentions) per layer
        asked = exit_settings.asked_layers(self.exit_points, len(layers)) if exit_settings is not None else ()
        vocabulary = self.draft_vocabulary(exit_settings, self_cache, device) if asked else None
        new_tokens = self.new_tokens_before(past, exit_settings, position_ids, tokens) if asked else 0
        for count, idx in enumerate(layers, start=1):
            if self_cache is not None:  # earlier tokens' empty slots in this layer, before it reads them
                self.complete_layer(idx, exits.running, past_key_values, step, attention_mask, encoder_outputs)
            previous, self_bias = hidden_states, self.layer_self_bias(idx, self_absolute, buckets)
            hidden_states, self_weights, cross_weights = self.layers[idx](
                hidden_states, self_bias, encoder_outputs.last_hidden_state, cross_bias, past_key_values,
                exits.active, slots, output_attentions,
            )  # fmt: skip
            layer_outputs.append((  # a ready row holds its exit state; one that left the layers, zero attentions
                exits.snapshot("exit_state", hidden_states) if output_hidden_states else hidden_states,
                *((exits.spread(self_weights), exits.spread(cross_weights)) if output_attentions else (None, None)),
            ))  # fmt: skip
            collect = output_exit_hidden_states and idx + 1 in self.exit_points  # never with a controller
            ask = count in asked
            if not (collect or ask):
                continue
            exit_state = computed_once(  # the exit head's input, computed once, and only if needed
                functools.partial(self.exit_hidden_states, idx + 1, hidden_states, previous, self_bias, cross_bias,
                                  encoder_outputs.last_hidden_state, past_key_values, exits.active)
            )  # fmt: skip
            if collect:
                exit_states.append(self.layer_norm(exit_state()))
                continue
            stop, state = self.exit_question(
                exit_settings,
                count,
                len(layers),
                new_tokens,
                hidden_states,
                previous,
                exits,
                query_mask,
                exit_state,
                finished,
                vocabulary,
            )
            hidden_states, self_absolute, buckets, cross_bias, query_mask = exits.stop(
                count, stop, {"exit_state": exit_state}, {"output": hidden_states},
                (hidden_states, self_absolute, buckets, cross_bias, query_mask),
            )  # fmt: skip
            if exits.finished:
                break
        unrun = len(layers) + 1 - len(layer_outputs) if output_hidden_states or output_attentions else 0
        for _ in range(unrun):  # layers no row ran: each row holds its exit state
            zeros = (None if weights is None else torch.zeros_like(weights) for weights in layer_outputs[-1][1:])
            layer_outputs.append((exits.snapshot("exit_state", hidden_states), *zeros))
        exit_outputs = exits.stopped_state("output")  # the last layer output of each row that left early
        if self_cache is not None and exit_outputs is not None:
            self.record_skipped_slots(self_cache, exits, slots, exit_outputs)
        # A step whose rows all take their tokens from one exit returns its head's logits, if a controller computed
        # them.
        step_logits = state.computed_logits if exits.stopped_together and tokens.shape[1] == 1 else None
        final = exit_state() if exits.finished else hidden_states  # the last layer run, as an exit head's input
        final, exit_layers = exits.gather("exit_state", final)
        last_hidden_state = self.layer_norm(final)
        states, self_attentions, cross_attentions = zip(*layer_outputs, strict=True)
        return OFADecoderOutput(
            last_hidden_state=last_hidden_state,
            past_key_values=past_key_values,
            hidden_states=states if output_hidden_states else None,
            attentions=self_attentions[1:] if output_attentions else None,
            cross_attentions=cross_attentions[1:] if output_attentions else None,
            exit_hidden_states=(*exit_states, last_hidden_state) if output_exit_hidden_states else None,
            logits=step_logits[:, None] if step_logits is not None else None,
            exit_layers=exit_layers,
        )


# ---------------------------------------------------------------------------------------------------------------
# Pre-trained model and the generation head
# ---------------------------------------------------------------------------------------------------------------


# The auto classes a saved model names in its `auto_map`: the generic one, the seq2seq head's, and the one the
# `image-text-to-text` pipeline loads with.
AUTO_CLASSES = ("AutoModel", "AutoModelForSeq2SeqLM", "AutoModelForImageTextToText")


class OFAPreTrainedModel(PreTrainedModel):
    config_class = OFAEarlyExitConfig
    base_model_prefix = ""  # one class: the encoder and decoder sit on the generation model itself
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["OFAEncoderLayer", "OFADecoderLayer"]
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True
    _can_compile_fullgraph = False

    def _init_weights(self, module: nn.Module):
        super()._init_weights(module)
        if isinstance(module, OFARelativePositionTable):
            init.zeros_(module.weight)
        elif isinstance(module, OFAAttention) and module.c_attn is not None:
            init.ones_(module.c_attn)
        elif isinstance(module, ZeroInitLinear):
            init.zeros_(module.weight)
            init.zeros_(module.bias)


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Teacher-forcing decoder inputs: `[start] + labels[:-1]`, with the -100 ignore index turned into pads."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


@dataclass
class EarlyExitSeq2SeqLMOutput(Seq2SeqLMOutput):
    r"""
    exit_hidden_states (`tuple(torch.FloatTensor)`, with `output_exit_hidden_states=True`):
        The output projection's input at each exit point of `config.exit_points`, then at the last layer:
        [batch, tgt_len, d_model] each, after the shared final LayerNorm.
    exit_layers (`torch.LongTensor` [batch]):
        The decoder layer each row exited after for this pass's tokens (one decoding step in `generate`).
    encoder_exit_layers (`torch.LongTensor` [batch, 2]):
        The encoder layer each row exited after (image, text): both the joint encoder's, 0 for a missing modality.
    """

    exit_hidden_states: tuple[torch.FloatTensor, ...] | None = None
    exit_layers: torch.LongTensor | None = None
    encoder_exit_layers: torch.LongTensor | None = None


class EarlyExitOFAForConditionalGeneration(OFAPreTrainedModel, EarlyExitGenerationMixin):
    """OFA encoder-decoder with a tied LM head and early exits; `generate` works with greedy, sampling and beam
    search, and takes the early-exit knobs (`exit_threshold=0.9`, ...; see `exit_knobs.EXIT_KNOBS`).

    Inputs: `input_ids` / `attention_mask` [batch, T] (pad on the right, as OFA does), `pixel_values`
    [batch, 3, H, W] normalised to [-1, 1] by `OFAProcessor`, and `decoder_input_ids` or `labels`.
    """

    _tied_weights_keys = {
        "decoder.embed_tokens.weight": "encoder.embed_tokens.weight",
        "decoder.output_projection.weight": "encoder.embed_tokens.weight",
    }

    def __init__(self, config: OFAEarlyExitConfig):
        config.check()  # `from_pretrained`'s overrides arrive after the config's own checks
        super().__init__(config)
        self.encoder = OFAEncoder(config)
        self.decoder = OFADecoder(config)
        self.post_init()

    def get_encoder(self, modality: str | None = None) -> OFAEncoder:
        """The encoder, for any `modality` it reads: OFA has one encoder for image and text."""
        if modality not in (None, "image", "text"):
            raise ValueError(f"OFA encodes images and text, not {modality!r}.")
        return self.encoder

    def get_decoder(self) -> OFADecoder:
        return self.decoder

    def get_input_embeddings(self) -> nn.Embedding:
        return self.encoder.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding):
        self.encoder.embed_tokens = value
        if self.config.tie_word_embeddings:
            self.decoder.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.decoder.output_projection

    def set_output_embeddings(self, value: nn.Linear):
        self.decoder.output_projection = value

    def _resize_token_embeddings(self, new_num_tokens, pad_to_multiple_of=None, mean_resizing=True) -> nn.Embedding:
        """Transformers resizes the input embeddings (the encoder's table) and the LM head; untied, the decoder has a
        token table of its own, resized alike."""
        embeddings = super()._resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)
        own = self.decoder.embed_tokens
        if own is not embeddings:
            resized = self._get_resized_embeddings(own, embeddings.num_embeddings, mean_resizing=mean_resizing)
            self.decoder.embed_tokens = resized.requires_grad_(own.weight.requires_grad)
        return embeddings

    def save_pretrained(self, save_directory, *args, **kwargs):
        # Checked before anything is written: a knob that JSON cannot hold would fail halfway, leaving a broken folder.
        for source, config in (("config", self.config), ("generation config", self.generation_config)):
            for name in EXIT_KNOBS:
                try:
                    json.dumps(getattr(config, name, None))
                except TypeError:
                    raise ValueError(
                        f"The {source}'s `{name}` ({type(getattr(config, name)).__name__}) cannot be saved as JSON: "
                        "give it to `generate` per call, and save a JSON value (None, a number, a list) in its place."
                    ) from None
        # The thresholds a call starts from, each in its policy's range: NaN was written into the JSON.
        try:
            check_thresholds(saved_knobs(self.config, self.generation_config))
        except ValueError as error:
            raise ValueError(f"Not saved: {error}") from None
        # An auto-created generation config is saved with `_from_model_config: true`, and its unknown keys (the
        # exit knobs calibration writes there) would then be dropped on reload.
        if any(hasattr(self.generation_config, name) for name in EXIT_KNOBS):
            self.generation_config._from_model_config = False
        # `auto_map` names this class for every auto class it serves, the image-text-to-text pipeline's included.
        name = f"{type(self).__module__.rsplit('.', 1)[-1]}.{type(self).__name__}"
        self.config.auto_map = {**(getattr(self.config, "auto_map", None) or {}), **dict.fromkeys(AUTO_CLASSES, name)}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def prepare_inputs_for_generation(
        self, input_ids: torch.LongTensor, next_sequence_length: int | None = None, **kwargs
    ) -> dict:
        """One decoding step's `forward` inputs: the newest decoder tokens and what `generate` carries (cache, encoder
        outputs and mask, exit settings, ...). The stock method gives the same here, but for a remote-code model it
        also inspects `forward`'s signature at every step (about 2% of a decoding step of the embedded model)."""
        decoder_input_ids = input_ids if next_sequence_length is None else input_ids[:, -next_sequence_length:]
        # Contiguous, as the stock method makes it: a slice's stride grows with every step, which a compiled decoding
        # step would recompile for.
        decoder_input_ids = decoder_input_ids.clone(memory_format=torch.contiguous_format)
        # The encoder ran before the first step: its outputs replace the image, whatever the iteration. Transformers
        # carries more than `forward` takes among the model kwargs (tokenizers, an assistant, prefill's positions).
        # A subclass's `forward(*args, **kwargs)` that calls this one's takes what this one names.
        taken = forward_parameters(type(self)) | forward_parameters(EarlyExitOFAForConditionalGeneration)
        taken -= {"labels", "pixel_values", "decoder_input_ids"}
        return {"decoder_input_ids": decoder_input_ids, **{k: v for k, v in kwargs.items() if k in taken}}

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        pixel_values: torch.FloatTensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: OFAEncoderOutput | None = None,
        past_key_values: Cache | None = None,
        labels: torch.LongTensor | None = None,
        exit_settings: EarlyExitSettings | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        output_exit_hidden_states: bool = False,
        return_dict: bool | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        decoder_inputs_embeds: torch.FloatTensor | None = None,
    ) -> "EarlyExitSeq2SeqLMOutput | tuple":
        """Teacher-forced (or cached, one step of `generate`) pass; `loss` is the final layer's cross-entropy when
        `labels` are given. `output_exit_hidden_states=True` adds each exit head's input after the final LayerNorm
        (`exit_hidden_states`; apply `get_output_embeddings()` for that exit's logits), what the exit losses of
        `EarlyExitTrainer` train on. `inputs_embeds` / `decoder_inputs_embeds` may replace `input_ids` /
        `decoder_input_ids`: token embeddings, `get_input_embeddings()(ids)` (images still enter as `pixel_values`)."""
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        use_cache = (use_cache if use_cache is not None else self.config.use_cache) and labels is None

        if labels is not None and decoder_input_ids is None and decoder_inputs_embeds is None:
            decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError("Pass `decoder_input_ids`, `decoder_inputs_embeds` or `labels` (or call `generate`).")
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids,
                attention_mask,
                pixel_values,
                exit_settings,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                inputs_embeds=inputs_embeds,
            )
        elif not isinstance(encoder_outputs, OFAEncoderOutput):
            raise ValueError(
                "`encoder_outputs` must be the OFAEncoderOutput that `model.get_encoder()` returns (the decoder reads "
                f"its padding mask and image grid), got {type(encoder_outputs).__name__}."
            )
        if use_cache and past_key_values is None:
            past_key_values = new_cache(self.config, exit_settings)
        past_key_values = with_cross_attention_cache(past_key_values)
        if past_key_values is not None and not isinstance(past_key_values, EncoderDecoderCache):
            raise ValueError(f"`past_key_values` must be an EncoderDecoderCache, got {type(past_key_values).__name__}.")

        decoder_outputs = self.decoder(
            decoder_input_ids,
            encoder_outputs,
            decoder_attention_mask,
            past_key_values if use_cache else None,
            exit_settings,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            output_exit_hidden_states=output_exit_hidden_states,
            inputs_embeds=decoder_inputs_embeds,
        )
        logits = decoder_outputs.logits
        if logits is None:
            logits = self.decoder.output_projection(decoder_outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten().to(logits.device), ignore_index=-100)

        output = EarlyExitSeq2SeqLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
            exit_hidden_states=decoder_outputs.exit_hidden_states,
            exit_layers=decoder_outputs.exit_layers,
            encoder_exit_layers=encoder_outputs.exit_layers,
        )
        return output if return_dict else output.to_tuple()


# The decoder's exit-head modules (DEED's adapters, BLIPEE's exit layers): what a new model config may add to saved
# weights (they start as the identity), and all that training with a frozen backbone changes.
EXIT_HEAD_MODULES = ("exit_adapters", "exit_transformer_layers")


def in_exit_head(name: str) -> bool:
    """Whether the parameter or module `name` belongs to an exit head."""
    return any(part in name.split(".") for part in EXIT_HEAD_MODULES)


__all__ = [
    "EXIT_HEAD_MODULES",
    "EarlyExitOFAForConditionalGeneration",
    "EarlyExitSeq2SeqLMOutput",
    "OFAEncoderOutput",
    "OFAPreTrainedModel",
    "in_exit_head",
]

# Saving writes this file beside the weights; `auto_map` then lets the auto classes load it with
# trust_remote_code=True.
EarlyExitOFAForConditionalGeneration.register_for_auto_class(AUTO_CLASSES[0])
