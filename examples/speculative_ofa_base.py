"""Speculative mode at OFA-base size on this machine, with and without a draft vocabulary (`draft_vocabulary`, FR-Spec).

The weights are random, and the decoder layers above the first are damped (their blocks' outputs scaled by
`--damping`), so that drafts from the first exit mostly agree with the full model, as a trained model's do; every step
still reads every weight. At OFA's vocabulary of 59457 tokens the output projection is about as large as the six
decoder layers, so a one-layer draft that scores every token costs well over half a full step; one that scores a
draft vocabulary does not. The draft vocabulary here holds the tokens the full model emits on these inputs and the
lowest ids up to `--vocabulary-size`: what a list of a task's most frequent reference tokens gives a trained model
(`hf-earlyexit calibrate --exit-mode speculative --draft-vocabulary-size N`), whose coverage the printed acceptance
reflects.

With `--ends-apart`, each row ends after its own number of new tokens (drawn from 6 to `--new-tokens`, seeded), as
answers and captions of a batch do: a row that has ended leaves speculative mode's decoder batch, while the full
model's loop runs it on to the longest row's end.

    python examples/speculative_ofa_base.py [--batch-sizes 1,8,16] [--damping 0.1] [--vocabulary-size 4096]
                                            [--new-tokens 16] [--ends-apart]

Prints one JSON object: per batch size, milliseconds per new token of the full model, of speculative mode and of
speculative mode with the draft vocabulary (paired round by round, medians), their
speedups over the full model, the share of drafts accepted, and whether each gave the full model's tokens.
"""

import argparse
import json

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_earlyexit import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
from hf_earlyexit.benchmark import random_inputs, round_seconds
from hf_earlyexit.modeling.exit_controllers import FixedLayerExit


def damped(model: EarlyExitOFAForConditionalGeneration, damping: float) -> EarlyExitOFAForConditionalGeneration:
    """The decoder layers above the first scaled down in what they add to the residual stream: the attention blocks'
    output LayerNorms (NormFormer's, after which no scale of the attention matters) and the feed-forward's output."""
    with torch.no_grad():
        for layer in model.get_decoder().layers[1:]:
            for module in (layer.self_attn_mid_layer_norm, layer.cross_attn_mid_layer_norm, layer.fc2):
                module.weight.mul_(damping)
                module.bias.mul_(damping)
    return model


class RowLengths(StoppingCriteria):
    """Row r ends once it has `lengths[r]` new tokens after the decoder's `start` tokens."""

    def __init__(self, lengths: list[int], start: int = 1):
        self.lengths, self.start = torch.tensor(lengths), start

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.BoolTensor:
        return input_ids.shape[1] - self.start >= self.lengths.to(input_ids.device)


def measure(model, batch: int, args: argparse.Namespace) -> dict:
    inputs = random_inputs(model.config, batch, args.image_size, model.device, model.dtype)
    with torch.no_grad():
        encoder_outputs = model.get_encoder()(**inputs)
    if args.ends_apart:
        seeded = torch.Generator().manual_seed(batch)
        lengths = torch.randint(min(6, args.new_tokens), args.new_tokens + 1, (batch,), generator=seeded)
        ends = dict(stopping_criteria=StoppingCriteriaList([RowLengths(lengths.tolist())]))
    else:
        ends = dict(min_new_tokens=args.new_tokens)

    def decode(**knobs):
        return model.generate(
            encoder_outputs=encoder_outputs,
            attention_mask=inputs["attention_mask"],
            max_new_tokens=args.new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            **ends,
            **knobs,
        )

    with torch.no_grad():
        full = decode().sequences
    emitted = full[:, 1:].flatten().tolist()
    vocabulary = sorted(set(emitted) | set(range(max(0, args.vocabulary_size - len(set(emitted))))))
    drafting = dict(exit_mode="speculative", exit_controller=FixedLayerExit(1), num_assistant_tokens=args.draft_tokens)
    modes = {"full": {}, "speculative": drafting, "draft_vocabulary": {**drafting, "draft_vocabulary": vocabulary}}
    outputs = {}

    def timed(name: str):
        def run(_: int) -> None:
            outputs[name] = decode(**modes[name])

        return run

    with torch.no_grad():
        rounds = round_seconds({name: timed(name) for name in modes}, 0, args.repeats, model.device)
    milliseconds = {name: sorted(values)[len(values) // 2] * 1e3 / args.new_tokens for name, values in rounds.items()}
    report = {"full_ms_per_token": round(milliseconds["full"], 2)}
    for name in ("speculative", "draft_vocabulary"):
        out = outputs[name]
        report[name] = {
            "ms_per_token": round(milliseconds[name], 2),
            "speedup_over_full": round(milliseconds["full"] / milliseconds[name], 3),
            "acceptance_rate": round(float(out.accepted_tokens.sum() / out.drafted_tokens.sum().clamp(min=1)), 3),
            "same_outputs_as_full": torch.equal(out.sequences, full),
        }
    report["draft_vocabulary"]["size"] = len(vocabulary)
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="base")
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--damping", type=float, default=0.1)
    parser.add_argument("--vocabulary-size", type=int, default=4096)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ends-apart", action="store_true", help="each row ends after its own number of tokens")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = damped(EarlyExitOFAForConditionalGeneration(OFAEarlyExitConfig.from_preset(args.preset)), args.damping)
    report = {
        "model": f"OFA-{args.preset} (random weights, decoder layers above the first damped by {args.damping})",
        "draft": "FixedLayerExit(1)",
        "draft_tokens": args.draft_tokens,
        "new_tokens": args.new_tokens,
        "ends_apart": args.ends_apart,
        "threads": args.threads,
        "batches": {f"batch_{size}": measure(model.eval(), int(size), args) for size in args.batch_sizes.split(",")},
    }
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
