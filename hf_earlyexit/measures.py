"""How much an early-exit run saves, from the exit layers `generate` returns.

- Expected time reduction (MuE): the layers each part ran, weighted by that part's cost per layer, against the
  same inputs and tokens at full depth: 1 - cost(exits) / cost(full). The costs come from `PartCosts`: FLOPs from
  the config by default (`PartCosts.from_config`), or measured seconds. Per row (the papers' figure, which counts
  each row's own layers) or batch-aware (a step costs its deepest row: what a batch > 1 can give).
- Parameter speedup (BLIPEE): the decoder parameters a full-depth token uses over the average a token used.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch


def measured_ask(asks: Mapping[str, float], key: str, what: str) -> float:
    """`asks[key]`; 0 when `asks` is empty (costs that count no asks), a ValueError when only `key` is missing."""
    if not asks:
        return 0.0
    if key not in asks:
        raise ValueError(f"No measured ask cost for {what} {key!r}; measured: {sorted(asks)}.")
    return asks[key]


@dataclass(frozen=True)
class PartCosts:
    """Cost of one layer of each part (any unit: FLOPs or seconds), and what runs at any depth.

    encoder_image: one layer of the image stream per sample (for a joint encoder: one joint layer).
    encoder_text: one layer of the text stream per sample (0 for a joint encoder).
    decoder: one decoder layer per generated token.
    encoder_fixed / decoder_fixed: the image stem and embeddings per sample / embeddings and output projection
        per token.
    decoder_asks: exit policy -> one test of the decoder's controller after a layer (its exit head, if it reads one,
        and its decision) per generated token; measured costs only (FLOPs count layers, as MuE does).
    encoder_asks: encoder part ("encoder", or "encoder_image" and "encoder_text") -> one test of its controller after
        a layer per sample; measured costs only.
    decoder_exit_path: what a decoding step with a decoder controller costs per token beyond its layers and the
        controller's tests, and the full model's step does not (setting up the row exits, stopping rows, picking
        each row's state): decoding forced to stop every row at the first exit point, less the layers it ran and
        `decoder_fixed`; measured costs only.
    call_fixed: the rest of a `generate` call per sample, which no part explains and no exit saves (its set-up, the
        encoder's outputs handed to decoding): measured as the full model's seconds less what the parts explain
        (`full_depth_cost`), so that the reduction is a share of the time a user waits.
    """

    encoder_image: float
    encoder_text: float
    decoder: float
    encoder_fixed: float = 0.0
    decoder_fixed: float = 0.0
    decoder_asks: Mapping[str, float] = field(default_factory=dict)
    encoder_asks: Mapping[str, float] = field(default_factory=dict)
    decoder_exit_path: float = 0.0
    call_fixed: float = 0.0

    def ask_cost(self, policy: str | None) -> float:
        """One ask of `policy`'s controller per token; 0 for costs that count no asks (FLOPs), a ValueError for a
        policy measured costs lack."""
        return 0.0 if policy is None else measured_ask(self.decoder_asks, policy, "exit policy")

    def encoder_ask_cost(self, part: str) -> float:
        """One test of encoder `part`'s controller per sample; 0 for costs that count no asks, a ValueError for a part
        measured costs lack."""
        return measured_ask(self.encoder_asks, part, "encoder part")

    @classmethod
    def from_config(cls, config, image_tokens: int, text_tokens: int, target_tokens: int) -> "PartCosts":
        """Multiply-accumulate counts (x2 = FLOPs) of each part for inputs of these lengths; the image stem is left
        out (it runs whatever the exits). A decoder token attends to about `target_tokens` / 2 earlier ones."""
        d, vocab = config.d_model, config.vocab_size

        def layer(tokens: int, keys: int, ffn: int, cross: int = 0) -> float:
            projections = 4 * d * d + 2 * d * ffn + (2 * d * d if cross else 0)  # q, k, v, out (+ cross q, out)
            return 2.0 * tokens * (projections + 2 * d * (keys + cross))

        encoder_ffn, decoder_ffn = config.encoder_ffn_dim, config.decoder_ffn_dim
        source = image_tokens + text_tokens
        if config.decompose_encoder_modalities:
            image = layer(image_tokens, image_tokens, encoder_ffn)
            text = layer(text_tokens, text_tokens, encoder_ffn)
        else:
            image, text = layer(source, source, encoder_ffn), 0.0
        return cls(
            encoder_image=image,
            encoder_text=text,
            decoder=layer(1, max(1, target_tokens // 2), decoder_ffn, cross=source),
            encoder_fixed=2.0 * source * d,
            decoder_fixed=2.0 * d * vocab,
        )


def batch_deepest(exit_layers: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Each row's exit layers [N, C] replaced, column by column, by the deepest of its batch (consecutive groups of
    `batch_size` rows); 0 only where no row of the batch has one (no step, no modality). What the rows cost when a
    layer costs the same for any number of rows and ready rows stay in the batch: a step costs what its deepest row
    costs, for every row of the batch, a row that already finished included (`generate` runs it along as padding)."""
    deepest = [group.max(dim=0, keepdim=True).values.expand_as(group) for group in exit_layers.split(batch_size)]
    return torch.cat(deepest)


def count_asks(asked_layers: Sequence[int], exit_layers: torch.Tensor) -> torch.Tensor:
    """How many of `asked_layers` each exit layer reached ([N, C] -> [N, C]; exit layer 0, none, reached none)."""
    asked = torch.tensor(sorted(asked_layers), dtype=exit_layers.dtype, device=exit_layers.device)
    return (asked <= exit_layers[..., None]).sum(dim=-1)


def expected_time_reduction(
    encoder_exit_layers: torch.Tensor,
    decoder_exit_layers: torch.Tensor,
    costs: PartCosts,
    encoder_layers: int,
    decoder_layers: int,
    batch_size: int = 1,
    asked_layers: Sequence[int] = (),
    policy: str | None = None,
    encoder_asked_layers: Mapping[str, Sequence[int]] | None = None,
) -> float:
    """1 - cost(exits) / cost(full depth) over N samples: `encoder_exit_layers` [N, 2] (image, text; a joint encoder
    gives its depth in both), `decoder_exit_layers` [N, T] with 0 where no token was generated. With `batch_size`
    > 1 it is batch-aware: the samples ran in consecutive batches of that size, each part of a batch and each
    decoding step costing what its deepest row costs, for every row of the batch (`batch_deepest`; the full depth
    is charged on the same steps); 1 gives the per-row figure of the papers.
    `asked_layers`: the decoder layers after which `policy`'s controller was asked
    (`EarlyExitSettings.asked_layers`); a token pays one ask (`PartCosts.ask_cost`) for each of them up to its exit
    layer, or its step's deepest when batch-aware, and, with a `policy`, the exit path (`PartCosts.decoder_exit_path`).
    `encoder_asked_layers`: likewise, encoder part -> the layers after which its controller was asked; a sample pays
    the part's test (`PartCosts.encoder_ask_cost`) for each of them up to its exit layer in that part."""
    if encoder_exit_layers.ndim != 2 or encoder_exit_layers.shape[1] != 2 or decoder_exit_layers.ndim != 2:
        raise ValueError("Expected encoder exit layers [N, 2] and decoder exit layers [N, T].")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be positive, got {batch_size}.")
    if batch_size > 1:
        encoder_exit_layers = batch_deepest(encoder_exit_layers, batch_size)
        decoder_exit_layers = batch_deepest(decoder_exit_layers, batch_size)
    if bool((encoder_exit_layers > encoder_layers).any()) or bool((decoder_exit_layers > decoder_layers).any()):
        raise ValueError("An exit layer is deeper than the model.")
    samples = encoder_exit_layers.shape[0]
    tokens = int((decoder_exit_layers > 0).sum())
    image, text = encoder_exit_layers.double().sum(dim=0).tolist()
    encoder_asked_layers = encoder_asked_layers or {}
    asks = int(count_asks(asked_layers, decoder_exit_layers).sum())
    encoder_asks = sum(
        costs.encoder_ask_cost(part)
        * int(count_asks(layers, encoder_exit_layers[:, int(part == "encoder_text")]).sum())
        for part, layers in encoder_asked_layers.items()
    )
    run = (
        costs.encoder_image * image
        + costs.encoder_text * text
        + costs.decoder * float(decoder_exit_layers.double().sum())
        + (costs.encoder_fixed + costs.call_fixed) * samples
        + costs.decoder_fixed * tokens
        + costs.ask_cost(policy) * asks
        + (costs.decoder_exit_path * tokens if policy is not None else 0.0)
        + encoder_asks
    )
    full = full_depth_cost(costs, samples, tokens, encoder_layers, decoder_layers)
    return 1.0 - run / full


def full_depth_cost(costs: PartCosts, samples: int, tokens: int, encoder_layers: int, decoder_layers: int) -> float:
    """What `samples` samples and `tokens` decoded row-steps cost at full depth (`call_fixed` included)."""
    return (
        (costs.encoder_image + costs.encoder_text) * encoder_layers * samples
        + costs.decoder * decoder_layers * tokens
        + (costs.encoder_fixed + costs.call_fixed) * samples
        + costs.decoder_fixed * tokens
    )


def parameter_speedup(model, decoder_exit_layers: torch.Tensor) -> float:
    """BLIPEE's speedup: decoder parameters per full-depth token / the average per generated token, where a token
    that exits after layer k uses layers 1..k, the exit head it left through, the embeddings and the output
    projection."""
    decoder = model.get_decoder()
    layer_parameters = [sum(p.numel() for p in layer.parameters()) for layer in decoder.layers]
    cumulative = torch.tensor([0, *layer_parameters], dtype=torch.float64).cumsum(0)  # [L + 1]
    # The embeddings and the output projection (one tensor when tied, counted once).
    shared_tensors = {id(p): p for p in (*decoder.embed_tokens.parameters(), *decoder.output_projection.parameters())}
    shared = sum(p.numel() for p in shared_tensors.values())
    head = torch.zeros(len(layer_parameters) + 1, dtype=torch.float64)
    heads = decoder.exit_adapters if decoder.exit_adapters is not None else decoder.exit_transformer_layers
    if heads is not None:
        for layer, module in zip(model.config.exit_points, heads, strict=True):
            head[layer] = sum(p.numel() for p in module.parameters())
    generated = decoder_exit_layers[decoder_exit_layers > 0].long()
    if generated.numel() == 0:
        raise ValueError("No generated token to measure (every exit layer is 0).")
    used = cumulative[generated] + head[generated] + shared
    return float((cumulative[-1] + shared) / used.mean())


__all__ = [
    "PartCosts",
    "batch_deepest",
    "expected_time_reduction",
    "full_depth_cost",
    "parameter_speedup",
]
