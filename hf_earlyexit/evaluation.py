"""How well each exit answers: exact-match accuracy of `generate` forced to exit after each exit point."""

import torch

from .data import ImageTextCollator
from .modeling.exit_controllers import FixedLayerExit


def normalize_answer(text: str) -> str:
    return " ".join(text.lower().strip().rstrip(".?!").split())


@torch.no_grad()
def exit_layer_accuracy(
    model,
    processor,
    dataset,
    image_column: str = "image",
    text_column: str | None = "question",
    target_column: str = "answer",
    prompt: str = " what does the image describe?",
    batch_size: int = 64,
    max_new_tokens: int = 4,
) -> dict[int, float]:
    """Greedy answers with every token exiting after layer k, for each exit point k and the full model (the last
    layer): the fraction equal to the target (lower-cased, stripped). Keys are 1-based decoder layers."""
    model.eval()
    layers = [*model.config.exit_points, model.config.decoder_layers]
    correct = dict.fromkeys(layers, 0)
    collator = ImageTextCollator(processor, image_column, text_column, target_column, prompt)
    for start in range(0, len(dataset), batch_size):
        rows = [dataset[index] for index in range(start, min(start + batch_size, len(dataset)))]
        inputs = {name: value.to(model.device) for name, value in collator(rows).items() if name != "labels"}
        targets = [normalize_answer(row[target_column]) for row in rows]
        for layer in layers:
            knobs = {"exit_controller": FixedLayerExit(layer)} if layer < model.config.decoder_layers else {}
            sequences = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, **knobs)
            answers = processor.batch_decode(sequences, skip_special_tokens=True)
            correct[layer] += sum(normalize_answer(a) == t for a, t in zip(answers, targets, strict=True))
    return {layer: count / len(dataset) for layer, count in correct.items()}


__all__ = ["exit_layer_accuracy", "normalize_answer"]
