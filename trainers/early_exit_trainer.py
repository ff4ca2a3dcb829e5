"""EarlyExitTrainer: trains OFA's exits the way each seed method does, with the stock Trainer loop.

The losses, one pure function per `exit_loss`, are in `losses`, with their formulas:

    layerwise          L = Σ_l w_l · CE(head(h_l), y)                     l over the exits and the last layer (MuE)
    deep_supervision   L = Σ_l w_l · CE(head(adapter_l(h_l)), y) / Σ_l w_l                                (DEED)
    distill            L = Σ_e w_e · T² · KL(p_last^T ‖ p_e^T)                              no labels needed
    adversarial        L = Σ_e w_e · task_e + a · Σ_e BCE(D_e(f_e), real)     task_e = CE with labels, else KL
                       L_D = Σ_e mean_n BCE(D_e(f_last), real) + mean_n BCE(D_e(f_e), fake), its own optimizer
    none               L = w · CE(head(h_last), y)

Every loss term of the model is a sum over target tokens, divided by the target tokens of the whole accumulated batch
on every process (the count the Trainer makes for `num_items_in_batch`, from the decoder's mask for the label-free
losses), so gradient accumulation and data parallelism give the update of one large batch. Each such term, as a
per-token mean over the tokens since the last log, is logged as `loss_exit_{layer}`, `loss_final` and
`loss_adv_{layer}`. The discriminators' L_D is a mean over each micro-batch's tokens already, divided by the
accumulation steps, and logged as `loss_disc`, its mean over the micro-batches since the last log.

The discriminators and the exits alternate, as in FREE: the discriminators step first, on the features just
computed (at each optimizer step, like the model: they follow gradient accumulation), and the generators' loss is
then taken against the discriminators as they now are.
With `freeze_backbone`, the backbone runs as at inference (no dropout or drop-path, BatchNorm statistics kept), so
it stays bit-identical.

With `encoder_exit_sampling`, a fraction of the rows see the encoder stopped after a random layer, so the same
losses also teach the decoder to work from the states that encoder exits leave.

`head` is the shared final LayerNorm + output projection; `f` are the features it reads (after that LayerNorm);
`w` the `exit_loss_weights`; p^T a softmax at temperature T; the last layer's distribution and features are
detached wherever they serve as the target.
"""

import contextlib
import json
import os
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Seq2SeqTrainer

from ..model_cards import NOT_MEASURED, measured_table, read_benchmark, render_model_card
from ..modeling.exit_controllers import FixedLayerExit
from ..modeling.exit_knobs import EXIT_KNOBS, encoder_exit_parts, non_default_knobs
from ..modeling.generation_early_exit import EarlyExitSettings
from ..modeling.modeling_ofa import EXIT_HEAD_MODULES, in_exit_head
from .discriminator import ExitDiscriminators
from .early_exit_config import LABEL_FREE_LOSSES, EarlyExitTrainingArguments
from .losses import (
    adversarial_loss,
    deep_supervision_loss,
    discriminator_loss,
    distillation_loss,
    final_layer_loss,
    layerwise_loss,
)

DISCRIMINATORS_NAME = "discriminators.pt"


HEAD_LOSSES = ("deep_supervision", "adversarial")  # the losses that train exit heads (DEED's adapters, BLIPEE's layers)


# How a model was trained, beside its weights: the trainer's card cites it, `hf-earlyexit publish` carries it on.
RECIPE_FILE = "training_recipe.json"


class EarlyExitTrainer(Seq2SeqTrainer):
    """A `Seq2SeqTrainer` whose loss is `args.exit_loss` (see the module docstring for the math).

    Takes every `Seq2SeqTrainer` argument; `args` must be an [`EarlyExitTrainingArguments`]. The model may be a PEFT
    model. For "adversarial" the trainer owns the discriminators (`self.discriminators`, outside the model): it
    prepares them with Accelerate, steps them before each generator loss and saves them in every checkpoint.
    """

    # `compute_loss` normalises by the accumulated batch's tokens (or divides by the accumulation steps itself).
    loss_is_scaled_for_ga = True

    def __init__(self, model: nn.Module | None = None, args: EarlyExitTrainingArguments | None = None, **kwargs):
        if not isinstance(args, EarlyExitTrainingArguments):
            raise ValueError(f"`args` must be EarlyExitTrainingArguments, got {type(args).__name__}.")
        # Seq2SeqTrainer makes `args.generation_config` the model's, saved with it: the settings of an evaluation
        # (exit knobs, lengths) would become the model's defaults, and its special tokens and calibrated exits would
        # be lost. Here it serves the evaluation's `generate` alone, over the model's own.
        evaluation_config, args.generation_config = args.generation_config, None
        try:
            super().__init__(model=model, args=args, **kwargs)
        finally:
            args.generation_config = evaluation_config
        self.evaluation_generation_config = (
            None if evaluation_config is None else self.load_generation_config(evaluation_config)
        )
        # Our forward takes no loss kwargs, but compute_loss does: this makes the Trainer count the label tokens.
        self.model_accepts_loss_kwargs = True
        if model is not None:  # a model from `model_init` was prepared as it was made
            self.prepare_model(model)
        # The Trainer writes `args.use_cache` (False) into the config, which would then be saved with the model;
        # the losses never use the cache (compute_loss says so), and `generate` after training should.
        self.model.config.use_cache = True
        self.discriminators = self.discriminator_optimizer = None
        if args.exit_loss == "adversarial":  # in float32 on the training device, whatever the model's dtype
            config = self.model.config
            self.discriminators = ExitDiscriminators(
                len(config.exit_points), config.d_model, args.discriminator_hidden_size
            ).to(args.device)
        # Per logged term, since the last log, per optimizer step: (its token sum, the tokens) of each micro-batch.
        self._exit_metrics: dict[str, dict[int, list[torch.Tensor]]] = defaultdict(lambda: defaultdict(list))

    def call_model_init(self, trial: Any = None) -> nn.Module:
        """The Trainer's (`model_init`, at construction and again at each `train`), prepared as a given model is."""
        model = super().call_model_init(trial)
        self.prepare_model(model)
        return model

    def prepare_model(self, model: nn.Module) -> None:
        """Check `model`'s exit heads against the loss, freeze its backbone (`freeze_backbone`), and warn of saved
        exit defaults that this training will make stale."""
        args, config = self.args, model.config
        self.exit_points = config.exit_points
        self.num_layers = config.decoder_layers
        self.loss_weights = self.resolve_loss_weights()
        self.check_exit_heads(config)
        if args.freeze_backbone and hasattr(model, "peft_config"):
            raise ValueError(
                "`freeze_backbone` on a PEFT model would freeze its adapters too, and PEFT saves only its own "
                "modules, so the trained exit heads would be lost: freeze with PEFT instead and list the exit heads "
                "in `modules_to_save`."
            )
        if args.freeze_backbone:
            for name, parameter in model.named_parameters():
                parameter.requires_grad_(in_exit_head(name))
        moving = [
            name for name, parameter in model.named_parameters() if parameter.requires_grad and not in_exit_head(name)
        ]
        if args.exit_loss in LABEL_FREE_LOSSES and moving:
            # A review measured it: 40 steps of "distill" on the embedded model, unfrozen, took VQA from 0.92 to 0.51.
            raise ValueError(
                f"exit_loss={args.exit_loss!r} trains no term at the last layer (it is the exits' teacher, or has "
                f"none), so training the backbone ({moving[0]}, ...) would drift it away from the full model: set "
                "`freeze_backbone=True` (`--freeze-backbone`; the config needs exit heads, `exit_adapter_dim` or "
                "`exit_transformer_layers`), or with PEFT train the exit heads alone, as BLIPEE trains."
            )
        heads = [parameter for name, parameter in model.named_parameters() if in_exit_head(name)]
        if args.exit_loss in HEAD_LOSSES and not any(parameter.requires_grad for parameter in heads):
            names = [f"{module}.{index}" for module in EXIT_HEAD_MODULES for index in range(len(self.exit_points))]
            raise ValueError(
                f"exit_loss={args.exit_loss!r} trains the exit heads, but every one of them is frozen (a PEFT model "
                f"freezes all but its adapters): list them in PEFT's `modules_to_save` (those of {names} it has)."
            )
        generation_config = model.generation_config  # read as saved: `generate` checks it against the model
        saved = non_default_knobs({name: getattr(generation_config, name, value) for name, value in EXIT_KNOBS.items()})
        saved.pop("draft_vocabulary", None)  # counted in the data's references, not chosen for the weights
        if saved:  # e.g. a calibration's thresholds, which training moves away from
            warnings.warn(
                f"The model's saved exit defaults {saved} were chosen for its weights before this training: "
                "recalibrate (`hf-earlyexit calibrate MODEL_DIR --write`) before relying on them.",
                UserWarning,
                stacklevel=3,
            )

    # --- set-up checks --------------------------------------------------------------------------------------------

    def loss_layers(self) -> list[int]:
        """The 1-based decoder layer of each loss term, in the order of `exit_loss_weights`."""
        if self.args.exit_loss == "none":
            return [self.num_layers]
        if self.args.exit_loss in ("layerwise", "deep_supervision"):
            return [*self.exit_points, self.num_layers]
        return list(self.exit_points)

    def resolve_loss_weights(self) -> list[float]:
        layers = self.loss_layers()
        weights = self.args.explicit_weights()
        if weights is None:
            if self.args.exit_loss_weights == "uniform":
                return [1.0] * len(layers)
            return [layer / self.num_layers for layer in layers]
        if len(weights) != len(layers):
            raise ValueError(
                f"`exit_loss_weights` has {len(weights)} weights, but exit_loss={self.args.exit_loss!r} has "
                f"{len(layers)} loss terms (after decoder layers {layers})."
            )
        return weights

    def check_exit_heads(self, config) -> None:
        exit_loss = self.args.exit_loss
        if exit_loss == "deep_supervision" and config.exit_adapter_dim is None:
            raise ValueError(
                "exit_loss='deep_supervision' trains DEED's adaptation modules: set `exit_adapter_dim` in the config."
            )
        if exit_loss == "adversarial" and config.exit_transformer_layers is None:
            raise ValueError(
                "exit_loss='adversarial' trains BLIPEE's exit layers: set `exit_transformer_layers` in the config."
            )
        if exit_loss == "adversarial" and self.args.fp16:
            raise ValueError(
                "exit_loss='adversarial' with fp16: the discriminators' optimizer would share the model's gradient "
                "scaler, which then updates twice a step; train in bf16 or float32."
            )
        if self.args.encoder_exit_sampling > 0 and config.encoder_layerdrop > 0:
            raise ValueError(
                "`encoder_exit_sampling` stops the encoder after a layer it counts, which `encoder_layerdrop` "
                f"({config.encoder_layerdrop}) would skip at random: set one of them to 0."
            )
        has_heads = config.exit_adapter_dim is not None or config.exit_transformer_layers is not None
        if self.args.freeze_backbone and (not has_heads or exit_loss == "none"):
            raise ValueError(
                "`freeze_backbone=True` leaves only the exit heads to train: the config needs `exit_adapter_dim` or "
                "`exit_transformer_layers`, and `exit_loss` must not be 'none'."
            )

    # --- loss -----------------------------------------------------------------------------------------------------

    def sampled_encoder_exits(self, inputs: dict[str, Any]) -> EarlyExitSettings | None:
        """Per row, an encoder depth: the full depth, or with probability `encoder_exit_sampling` a layer drawn
        uniformly from 1..L-1 (independently per stream of a decomposed encoder)."""
        fraction = self.args.encoder_exit_sampling
        config = self.accelerator.unwrap_model(self.model).config
        if fraction == 0 or config.encoder_layers < 2:
            return None
        ids = inputs.get("input_ids", inputs.get("pixel_values"))
        batch, device, layers = ids.shape[0], ids.device, config.encoder_layers

        def sampled_exit() -> FixedLayerExit:
            shallow = torch.randint(1, layers, (batch,), device=device)
            depth = torch.where(torch.rand(batch, device=device) < fraction, shallow, layers)  # [batch]
            return FixedLayerExit(lambda state: depth[state.rows])

        parts = encoder_exit_parts(config)
        # Training runs forward and backward over every row it keeps in a layer: rows that stopped leave (the
        # same outputs as keeping them), and no clock decides the plan, as `row_exit="auto"` would.
        return EarlyExitSettings(**{part: sampled_exit() for part in parts}, row_exit="compact")

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        labels = inputs.get("labels")
        if labels is None and self.args.exit_loss not in LABEL_FREE_LOSSES:
            raise ValueError(
                f"exit_loss={self.args.exit_loss!r} needs `labels`; 'distill' and 'adversarial' do without."
            )
        training = model.training
        if training and self.args.freeze_backbone:
            self.backbone_as_at_inference(model)
        model_inputs = {name: value for name, value in inputs.items() if name != "labels"}
        if labels is not None and "decoder_input_ids" not in model_inputs:  # the losses are ours: no model loss
            decoder_start = self.accelerator.unwrap_model(model).prepare_decoder_input_ids_from_labels
            model_inputs["decoder_input_ids"] = decoder_start(labels)
        outputs = model(
            **model_inputs,
            use_cache=False,
            output_exit_hidden_states=self.args.exit_loss != "none",
            exit_settings=self.sampled_encoder_exits(inputs) if training else None,
        )
        # The target tokens: every loss reads the model's outputs there only, [batch, length] -> [N, ...].
        if labels is not None:
            mask = labels.ne(-100)
        else:
            mask = decoder_targets(inputs)
        targets = labels[mask] if labels is not None else None
        loss, terms = self.exit_loss_and_terms(model, outputs, mask, targets, training)
        tokens = mask.sum()
        loss = self.normalise(loss, training, num_items_in_batch, tokens)
        if training:
            for name, term in terms.items():
                self.record_term(name, term.detach(), tokens.to(term.dtype))
        return (loss, outputs) if return_outputs else loss

    def backbone_as_at_inference(self, model: nn.Module) -> None:
        """`freeze_backbone`: every module in eval mode (no dropout or drop-path, BatchNorm statistics kept) but the
        exit heads, which train."""
        for name, module in self.accelerator.unwrap_model(model).named_modules():
            module.train(in_exit_head(name))

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        """The Trainer's, with `num_items_in_batch` counted for the label-free losses too: the decoder's target tokens
        (its attention mask) of the accumulated batch on every process, as the Trainer counts label tokens."""
        batches, num_items_in_batch = super().get_batch_samples(epoch_iterator, num_batches, device)
        if num_items_in_batch is None and batches and "labels" not in batches[0]:
            num_items_in_batch = sum(decoder_targets(batch).sum() for batch in batches).to(device)
            if self.args.average_tokens_across_devices and self.args.world_size > 1:
                num_items_in_batch = self.accelerator.gather(num_items_in_batch).sum()
        return batches, num_items_in_batch

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **gen_kwargs,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """Seq2SeqTrainer's, with the loss training minimises (`compute_loss`) as `eval_loss` also when it generates
        (its generating step takes the final layer's cross-entropy alone, which made `eval_loss` change meaning) and
        when a label-free loss has no labels (the Trainer computes a loss only from labels); generating under
        `args.generation_config`, if given, over the model's own."""
        if self.evaluation_generation_config is not None:
            gen_kwargs = {
                "generation_config": self.evaluation_generation_config,
                **(gen_kwargs or getattr(self, "_gen_kwargs", {})),
            }
        loss, generated, labels = super().prediction_step(
            model, inputs, prediction_loss_only, ignore_keys, **gen_kwargs
        )
        generated_instead = self.args.predict_with_generate and not prediction_loss_only and loss is not None
        label_free = loss is None and inputs.get("labels") is None and self.args.exit_loss in LABEL_FREE_LOSSES
        if generated_instead or label_free:
            with torch.no_grad(), self.compute_loss_context_manager():
                loss = self.compute_loss(model, self._prepare_inputs(inputs)).detach().mean()
        return loss, generated, labels

    def exit_loss_and_terms(
        self, model: nn.Module, outputs: Any, mask: torch.Tensor, targets: torch.Tensor | None, training: bool
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`args.exit_loss` on the target tokens (`mask` [batch, length], `targets` [N] or None): the loss summed
        over them and its terms (see `losses`). In `training`, the discriminators step first."""
        args, weights, smoothing = self.args, self.loss_weights, self.args.label_smoothing_factor
        final_logits = outputs.logits[mask]  # [N, V]
        if args.exit_loss == "none":
            return final_layer_loss(final_logits, targets, weights, smoothing)
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        *features, last = (states[mask] for states in outputs.exit_hidden_states)  # each exit's [N, d], the last's
        exits = dict(zip(self.exit_points, features, strict=True))
        match args.exit_loss:
            case "layerwise":
                return layerwise_loss(exits, head, final_logits, targets, weights, smoothing)
            case "deep_supervision":
                return deep_supervision_loss(
                    layerwise_loss(exits, head, final_logits, targets, weights, smoothing), weights
                )
            case "distill":
                return distillation_loss(exits, head, final_logits, weights, args.distill_temperature)
        # "adversarial": the discriminators judge the exits' features, after their own step on them.
        fake = torch.stack(features)  # [exits, N, d]
        if training:
            self.discriminator_step(last.detach(), fake.detach())
        return adversarial_loss(
            exits,
            head,
            final_logits,
            targets,
            self.frozen_discriminator_logits(fake),
            weights,
            args.adversarial_weight,
            smoothing,
            args.distill_temperature,
        )

    def frozen_discriminator_logits(self, features: torch.Tensor) -> torch.Tensor:
        """The discriminators' logits [exits, N] on `features` [exits, N, d], the discriminators held constant: the
        generators' loss sends no gradient into them and fires no DDP hook."""
        discriminators = self.accelerator.unwrap_model(self.discriminators)
        frozen = {name: parameter.detach() for name, parameter in discriminators.named_parameters()}
        return torch.func.functional_call(discriminators, frozen, (features,))

    def normalise(
        self, loss: torch.Tensor, training: bool, num_items_in_batch: torch.Tensor | int | None, tokens: torch.Tensor
    ) -> torch.Tensor:
        """The token sum `loss` divided, in training, by the target tokens of every process's accumulated batch when
        the Trainer counted them (`num_items_in_batch`), else by this batch's `tokens`: evaluation averages each
        process's per-token losses itself, so a count summed over processes would shrink them."""
        if training and num_items_in_batch is not None:
            # DDP averages the gradients over processes, which the global count already accounted for.
            scale = self.accelerator.num_processes if self.args.average_tokens_across_devices else 1
            return loss / num_items_in_batch * scale
        return loss / tokens

    # --- the discriminators' step -------------------------------------------------------------------------------

    def discriminator_step(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        """One step of the discriminators on this micro-batch's detached features, the last layer's `real` [N, d] and
        the exits' `fake` [exits, N, d] (they follow gradient accumulation: the prepared optimizer steps only at the
        accumulation boundary)."""
        self.discriminators.train()
        syncing = self.accelerator.sync_gradients
        with contextlib.nullcontext() if syncing else self.accelerator.no_sync(self.discriminators):
            real_logits = self.discriminators(real.expand(fake.shape[0], -1, -1))
            loss = discriminator_loss(real_logits, self.discriminators(fake))
            self.accelerator.backward(loss / self.current_gradient_accumulation_steps)
        self.discriminator_optimizer.step()
        self.discriminator_optimizer.zero_grad()
        self.record_term("loss_disc", loss.detach(), torch.ones_like(loss.detach()))

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        optimizer = super().create_optimizer(model)
        if self.discriminators is not None and self.discriminator_optimizer is None:
            self.discriminators, self.discriminator_optimizer = self.accelerator.prepare(
                self.discriminators,
                torch.optim.AdamW(self.discriminators.parameters(), lr=self.args.discriminator_learning_rate),
            )
        return optimizer

    # --- checkpoints and logs -------------------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.discriminators is not None and self.args.should_save:
            state = {
                "discriminators": self.accelerator.unwrap_model(self.discriminators).state_dict(),
                "optimizer": self.discriminator_optimizer.state_dict(),
            }
            torch.save(state, os.path.join(output_dir, DISCRIMINATORS_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.discriminators is None:
            return
        path = os.path.join(checkpoint, DISCRIMINATORS_NAME)
        if not os.path.isfile(path):
            raise ValueError(
                f"{checkpoint} has no {DISCRIMINATORS_NAME}: it was not saved by adversarial training, or was saved "
                "with `save_only_model=True`, which keeps no optimizer states to resume from."
            )
        # On the host, as the Trainer loads its own state: `args.device` (e.g. "cpu:0" in a process group) is not a
        # location torch can restore to. Loading the states moves them to the discriminators' device.
        state = torch.load(path, map_location="cpu", weights_only=True)
        self.accelerator.unwrap_model(self.discriminators).load_state_dict(state["discriminators"])
        self.discriminator_optimizer.load_state_dict(state["optimizer"])

    def create_model_card(
        self,
        model_name: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        finetuned_from: str | None = None,
        dataset: str | list[str] | None = None,
        **unused,
    ) -> None:
        """The card `hf-earlyexit publish` writes (`model_cards/`), with this run's arguments as the recipe, instead
        of the stock training summary; `push_to_hub` calls it on the main process only. Its table holds measured
        numbers once the output folder has a `benchmark.jsonl` (`hf-earlyexit bench --json`)."""
        if not self.is_world_process_zero():
            return
        output = Path(self.args.output_dir)
        benchmark = output / "benchmark.jsonl"
        args = self.args
        names = ("exit_loss", "exit_loss_weights", "encoder_exit_sampling", "freeze_backbone", "learning_rate")
        options = {name: getattr(args, name) for name in names}
        if type(self).exit_loss_and_terms is not EarlyExitTrainer.exit_loss_and_terms:  # a subclass's own loss
            options["exit_loss"] = f"{type(self).__name__}.exit_loss_and_terms (on {args.exit_loss!r})"
        options |= {
            "steps": self.state.global_step,
            "batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size,
            "seed": args.seed,
        }
        model = self.accelerator.unwrap_model(self.model)
        # The card cites the recipe file, which `hf-earlyexit publish` carries on: a script's own is kept, and shown.
        recipe_file = output / RECIPE_FILE
        if recipe_file.is_file():
            recipe = json.loads(recipe_file.read_text())
        else:
            recipe = {"script": "EarlyExitTrainer", "options": options, "parameters": model.num_parameters()}
            recipe_file.write_text(json.dumps(recipe, indent=2, default=str) + "\n")
        card = render_model_card(
            self.hub_model_id or model_name or output.name,
            model.config.to_dict(),
            model.generation_config.to_dict(),
            measured_table(read_benchmark(benchmark)) if benchmark.is_file() else NOT_MEASURED,
            recipe=recipe,
            datasets=[dataset] if isinstance(dataset, str) else dataset,
            base_model=finetuned_from,
            license=license,
            tags=[tags] if isinstance(tags, str) else tags or (),
        )
        (output / "README.md").write_text(card)

    def record_term(self, name: str, total: torch.Tensor, count: torch.Tensor) -> None:
        """A micro-batch's `total` of the logged term `name` over its `count` (tokens), in this optimizer step."""
        self._exit_metrics[name][self.state.global_step].append(torch.stack([total, count]))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds each loss term to the training logs as the Trainer logs `loss`: per optimizer step, the term's
        per-token mean over every process's accumulated batch; averaged over the steps since the last log."""
        if "loss" in logs and self._exit_metrics:
            names = sorted(self._exit_metrics)
            per_step = [
                [torch.stack(batches).sum(dim=0) for batches in self._exit_metrics[name].values()] for name in names
            ]
            sums = self.accelerator.reduce(torch.stack([torch.stack(steps) for steps in per_step]), reduction="sum")
            means = (sums[..., 0] / sums[..., 1].clamp(min=1)).mean(dim=1).tolist()  # [terms, steps, 2] -> [terms]
            logs.update({name: float(value) for name, value in zip(names, means, strict=True)})
            self._exit_metrics.clear()
        super().log(logs, start_time)


def decoder_targets(inputs: dict[str, Any]) -> torch.Tensor:
    """[batch, length] bool: the decoder's target tokens without labels (its attention mask, else every token)."""
    return inputs.get("decoder_attention_mask", torch.ones_like(inputs["decoder_input_ids"])).bool()


__all__ = ["RECIPE_FILE", "EarlyExitTrainer"]
