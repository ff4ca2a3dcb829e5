"""Do the exit losses make shallow layers answer? Evidence on easy-VQA (real published splits, offline).

One small OFA (hf_earlyexit.training.SMALL_OFA, 2.4M parameters, a BPE trained on the data's text) is first
pre-trained with the final-layer loss to caption the training images ("a blue rectangle", derived from their
questions): from scratch, a VQA model sits on the answer prior for thousands of steps before it looks at the
image, while captioning grounds it quickly (without weight decay: with 0.01 it stayed on the prior for 800+
steps). The pre-trained model is then fine-tuned on easy-VQA twice, on the
same batches: with MuE's layer-wise exit loss and with the final-layer loss alone. Then BLIPEE: exit transformer
layers after decoder layers 1-3, trained adversarially (plus cross-entropy) on the frozen final-loss model, once
per seed. Every model answers the test questions with each token forced to exit after each layer (`generate` with
`FixedLayerExit`). Prints one JSON object: those accuracies, whether every adversarial loss stayed finite, and
the training-step times (interleaved, same batch).

    python examples/easy_vqa_exit_training.py --output out/easy_vqa_exit_training.json
"""

import argparse
import copy
import json
import math
import tempfile
from pathlib import Path

from hf_earlyexit import EarlyExitOFAForConditionalGeneration, EarlyExitTrainingArguments
from hf_earlyexit.benchmark import training_step_benchmark
from hf_earlyexit.data import easy_vqa, easy_vqa_captions
from hf_earlyexit.evaluation import exit_layer_accuracy
from hf_earlyexit.training import small_model_and_processor, train_exits


def arguments(output_dir: str, exit_loss: str, steps: int, batch_size: int, seed: int, learning_rate: float, **extra):
    return EarlyExitTrainingArguments(
        output_dir=output_dir,
        exit_loss=exit_loss,
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        learning_rate=learning_rate,
        warmup_steps=50,
        lr_scheduler_type="constant_with_warmup",
        logging_steps=max(1, steps // 10),
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=seed,
        disable_tqdm=True,
        **extra,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--caption-steps", type=int, default=1500, help="pre-training on the captions")
    parser.add_argument("--steps", type=int, default=1500, help="VQA fine-tuning, per exit loss")
    parser.add_argument("--adversarial-steps", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--test-questions", type=int, default=1500)
    parser.add_argument("--seeds", default="0,1,2", help="adversarial training seeds")
    parser.add_argument("--output", default="out/easy_vqa_exit_training.json")
    options = parser.parse_args()

    train, test, captions = easy_vqa("train"), easy_vqa("test"), easy_vqa_captions("train")
    test = test.shuffle(seed=0).select(range(min(options.test_questions, len(test))))
    texts = [*train["question"], *train["answer"], *captions["caption"]]
    initial, processor = small_model_and_processor(texts, seed=0, dropout=0.0)
    report = {"model": {**initial.config.to_diff_dict(), "parameters": initial.num_parameters()}, "runs": {}}
    work = tempfile.mkdtemp(prefix="easy_vqa_exits_")

    caption_args = arguments(work, "none", options.caption_steps, options.batch_size, seed=0, learning_rate=2e-3)
    train_exits(initial, processor, captions, caption_args, text_column=None, target_column="caption")
    trained = {}
    for exit_loss in ("layerwise", "none"):
        model = copy.deepcopy(initial)
        args = arguments(work, exit_loss, options.steps, options.batch_size, seed=0, learning_rate=1e-3)
        trainer = train_exits(model, processor, train, args)
        trained[exit_loss] = model
        report["runs"][exit_loss] = {
            "accuracy_by_exit_layer": exit_layer_accuracy(model, processor, test),
            "train_seconds_per_step": trainer.state.log_history[-1]["train_runtime"] / options.steps,
            "last_log": trainer.state.log_history[-2],
        }

    # BLIPEE: exit layers on the frozen backbone fine-tuned with the final-layer loss alone.
    config = trained["none"].config.to_dict() | {"exit_transformer_layers": [1, 2, 3]}
    for seed in (int(seed) for seed in options.seeds.split(",")):
        model = EarlyExitOFAForConditionalGeneration(type(initial.config).from_dict(config))
        missing, unexpected = model.load_state_dict(trained["none"].state_dict(), strict=False)
        assert not unexpected and all("exit_transformer_layers" in name for name in missing)
        args = arguments(
            work, "adversarial", options.adversarial_steps, options.batch_size, seed, 1e-3, freeze_backbone=True
        )
        trainer = train_exits(model, processor, train, args)
        logged = [entry for entry in trainer.state.log_history if "loss" in entry]
        report["runs"][f"adversarial_seed_{seed}"] = {
            "accuracy_by_exit_layer": exit_layer_accuracy(model, processor, test),
            "all_losses_finite": all(
                math.isfinite(value) for entry in logged for key, value in entry.items() if key.startswith("loss")
            ),
            "last_log": logged[-1],
        }

    report["training_step_time"] = training_step_benchmark(
        initial.config, exit_losses=("none", "layerwise"), batch_size=options.batch_size, image_size=64,
        target_length=2, repeats=20,
    )  # fmt: skip
    Path(options.output).parent.mkdir(parents=True, exist_ok=True)
    Path(options.output).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
