"""EarlyExitTrainer: each loss against a hand computation, gradient accumulation, the adversarial step, resume,
LoRA, encoder exit sampling and bad arguments. (The two-process Accelerate run is in test_distributed.py.)"""

import itertools
import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import GenerationConfig

from hf_earlyexit import EarlyExitTrainer, EarlyExitTrainingArguments
from hf_earlyexit.modeling.exit_controllers import FixedLayerExit
from hf_earlyexit.modeling.generation_early_exit import EarlyExitSettings
from hf_earlyexit.trainers.early_exit_trainer import DISCRIMINATORS_NAME
from tests.helpers import tiny_inputs, tiny_model

DEPTH = 4


class TinyCaptions(torch.utils.data.Dataset):
    """Random image-text pairs whose targets end in padding (-100) of varied length, so token counts differ."""

    def __init__(self, size: int = 8, seed: int = 0, labels: bool = True, lengths: tuple[int, ...] | None = None):
        inputs = tiny_inputs(batch=size, seed=seed, pad_last=0)
        generator = torch.Generator().manual_seed(seed)
        targets = torch.randint(3, 120, (size, 5), generator=generator)
        for row in range(size):
            targets[row, lengths[row] if lengths else 5 - row % 3 :] = -100
        self.rows = [{name: value[i] for name, value in inputs.items()} for i in range(size)]
        for row, target in zip(self.rows, targets, strict=True):
            if labels:
                row["labels"] = target
            else:
                row["decoder_input_ids"] = target.clamp(min=0)
                row["decoder_attention_mask"] = target.ne(-100).long()

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def arguments(tmp_path, **overrides) -> EarlyExitTrainingArguments:
    settings = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return EarlyExitTrainingArguments(**{**settings, **overrides})


def trainer_for(tmp_path, model=None, dataset=None, **overrides) -> EarlyExitTrainer:
    model = model if model is not None else tiny_model(decoder_layers=DEPTH)
    return EarlyExitTrainer(model=model, args=arguments(tmp_path, **overrides), train_dataset=dataset or TinyCaptions())


def batch_of(dataset, size: int = 4) -> dict:
    return {name: torch.stack([dataset[i][name] for i in range(size)]) for name in dataset[0]}


def hand_logits(model, batch) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """Each exit's logits and features computed from the decoder's per-layer states, and the last layer's logits."""
    decoder = model.decoder
    out = model(**batch, output_hidden_states=True)
    features = []
    for layer in model.config.exit_points:
        state = out.decoder_hidden_states[layer]
        if decoder.exit_adapters is not None:
            adapter = decoder.exit_adapters[layer - 1]
            state = state + adapter.up(F.gelu(adapter.down(adapter.layer_norm(state))))
        features.append(decoder.layer_norm(state))
    return [decoder.output_projection(f) for f in features], out.logits, features


def mean_cross_entropy(logits, labels, smoothing=0.0):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, label_smoothing=smoothing)


def mean_kl(student, teacher, mask, temperature):
    p = F.softmax(teacher / temperature, dim=-1)
    kl = F.kl_div(F.log_softmax(student / temperature, dim=-1), p, reduction="none").sum(-1)
    return temperature**2 * kl[mask].mean()


# --- each loss equals the hand computation ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "exit_loss, overrides, weights",
    [
        ("layerwise", {}, "uniform"),
        ("layerwise", {}, "0.5,1,2,3"),
        ("layerwise", {}, "increasing"),
        ("deep_supervision", {"exit_adapter_dim": 8}, "increasing"),
        ("none", {}, "uniform"),
    ],
)
def test_task_losses_equal_a_hand_computation(tmp_path, exit_loss, overrides, weights):
    model = tiny_model(decoder_layers=DEPTH, **overrides)
    trainer = trainer_for(tmp_path, model, exit_loss=exit_loss, exit_loss_weights=weights, label_smoothing_factor=0.1)
    batch = batch_of(TinyCaptions())
    labels = batch["labels"]
    exit_logits, final_logits, _ = hand_logits(model, batch)
    layers = [1, 2, 3, 4] if exit_loss != "none" else [4]
    terms = [mean_cross_entropy(logits, labels, 0.1) for logits in [*exit_logits, final_logits][-len(layers) :]]
    w = {"uniform": [1.0] * len(layers), "increasing": [layer / DEPTH for layer in layers]}.get(weights)
    w = w or [float(x) for x in weights.split(",")]
    expected = sum(a * b for a, b in zip(w, terms, strict=True))
    if exit_loss == "deep_supervision":
        expected = expected / sum(w)
    model.eval()  # compute_loss outside training: normalised by this batch's tokens, no accumulation scaling
    torch.testing.assert_close(trainer.compute_loss(model, batch), expected, rtol=1e-5, atol=1e-6)


def test_distillation_without_labels_equals_a_hand_computation(tmp_path):
    model = tiny_model(decoder_layers=DEPTH, exit_adapter_dim=8)
    dataset = TinyCaptions(labels=False)
    trainer = trainer_for(tmp_path, model, dataset, exit_loss="distill", distill_temperature=2.0, freeze_backbone=True)
    batch = batch_of(dataset)
    exit_logits, final_logits, _ = hand_logits(model, batch)
    mask = batch["decoder_attention_mask"].bool()
    expected = sum(mean_kl(logits, final_logits, mask, 2.0) for logits in exit_logits)
    model.eval()
    torch.testing.assert_close(trainer.compute_loss(model, batch), expected, rtol=1e-5, atol=1e-6)


def test_adversarial_loss_equals_a_hand_computation(tmp_path):
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[1, 3])
    trainer = trainer_for(tmp_path, model, exit_loss="adversarial", adversarial_weight=0.3, freeze_backbone=True)
    batch = batch_of(TinyCaptions())
    labels, mask = batch["labels"], batch["labels"].ne(-100)
    model.eval()
    out = model(**batch, output_exit_hidden_states=True)
    expected = 0
    for features, discriminator in zip(out.exit_hidden_states[:-1], trainer.discriminators.discriminators, strict=True):
        logits = model.decoder.output_projection(features)
        fooled = F.binary_cross_entropy_with_logits(discriminator(features[mask]), torch.ones(int(mask.sum()), 1))
        expected = expected + mean_cross_entropy(logits, labels) + 0.3 * fooled
    torch.testing.assert_close(trainer.compute_loss(model, batch), expected, rtol=1e-5, atol=1e-6)


def test_exit_layer_features_in_training_equal_those_generate_exits_with(tmp_path):
    """The teacher-forced exit features (what the losses train) are the ones a forced exit decodes with."""
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[2])
    inputs = tiny_inputs(batch=2, seed=3, pad_last=0)
    out = model.generate(
        **inputs, max_new_tokens=5, exit_policy="confidence", exit_threshold=0.0, return_dict_in_generate=True
    )
    assert bool((out.exit_layers == 2).all())
    forward = model(**inputs, decoder_input_ids=out.sequences[:, :-1], output_exit_hidden_states=True)
    tokens = model.decoder.output_projection(forward.exit_hidden_states[0]).argmax(-1)
    assert torch.equal(tokens[:, :-1], out.sequences[:, 1:-1])  # the last token is the forced end of sequence


# --- the Trainer loop -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("labels", [True, False], ids=["layerwise", "distill_without_labels"])
def test_gradient_accumulation_gives_the_large_batch_update(tmp_path, labels):
    """Micro-batches with different numbers of target tokens: the loss is normalised by the whole batch's, counted
    from the decoder's mask when there are no labels. The logged terms are per-token means over the whole batch too:
    uniform layer-wise terms sum to the loss. (SGD: Adam's g / sqrt(v) would blow float noise on near-zero gradients
    up to full steps.)"""
    final, logged = [], []
    heads = {} if labels else {"exit_adapter_dim": 8}  # "distill" trains exit heads on a frozen backbone
    trained = "decoder.layers.0.fc1.weight" if labels else "decoder.exit_adapters.0.up.weight"
    for batch_size, accumulation in ((4, 1), (2, 2)):
        trainer = trainer_for(
            tmp_path,
            tiny_model(decoder_layers=DEPTH, **heads),
            dataset=TinyCaptions(size=4, labels=labels, lengths=(5, 5, 5, 1)),  # any two pairs: 10 and 6 tokens
            max_steps=1,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            exit_loss="layerwise" if labels else "distill",
            exit_loss_weights="uniform",
            optim="sgd",
            learning_rate=0.1,
            freeze_backbone=not labels,
        )
        trainer.train()
        final.append(dict(trainer.model.named_parameters()))
        logged.append(trainer.state.log_history[0])
    before = dict(tiny_model(decoder_layers=DEPTH, **heads).named_parameters())
    assert not torch.equal(final[0][trained], before[trained])
    for name, parameter in final[0].items():
        torch.testing.assert_close(parameter, final[1][name], rtol=0, atol=2e-6, msg=name)
    for log in logged:
        terms = sum(value for name, value in log.items() if name.startswith(("loss_exit_", "loss_final")))
        assert terms == pytest.approx(log["loss"], rel=1e-4)


def test_a_frozen_backbone_runs_as_at_inference_and_stays_bit_identical(tmp_path):
    """Its BatchNorm statistics are buffers, not parameters: a backbone in train mode would move them (and run
    dropout). The exit heads train."""
    model = tiny_model(decoder_layers=DEPTH, resnet_type="resnet50", exit_adapter_dim=8, dropout=0.3)
    norms = [module for module in model.modules() if isinstance(module, torch.nn.BatchNorm2d)]
    assert norms
    before = {name: value.detach().clone() for name, value in model.state_dict().items()}
    trainer_for(tmp_path, model, exit_loss="deep_supervision", freeze_backbone=True, max_steps=1).train()
    changed = {name for name, value in model.state_dict().items() if not torch.equal(value, before[name])}
    assert changed and all("exit_adapters" in name for name in changed), sorted(changed)[:4]


def test_a_model_from_model_init_is_frozen_and_checked_as_a_given_one(tmp_path):
    """`model_init` (as `hyperparameter_search` uses) makes a new model at each `train`: it gets the same set-up."""
    made = []

    def model_init():
        made.append(tiny_model(decoder_layers=DEPTH, exit_adapter_dim=8))
        return made[-1]

    arguments_ = arguments(tmp_path, exit_loss="deep_supervision", freeze_backbone=True, max_steps=1)
    trainer = EarlyExitTrainer(model_init=model_init, args=arguments_, train_dataset=TinyCaptions())
    before = {
        name: value.detach().clone()
        for name, value in tiny_model(decoder_layers=DEPTH, exit_adapter_dim=8).named_parameters()
    }
    trainer.train()
    assert len(made) == 2 and trainer.model is made[-1]
    changed = {name for name, value in trainer.model.named_parameters() if not torch.equal(value, before[name])}
    assert changed and all("exit_adapters" in name for name in changed), sorted(changed)[:4]
    with pytest.raises(ValueError, match="deep_supervision"):
        EarlyExitTrainer(
            model_init=lambda: tiny_model(decoder_layers=DEPTH), args=arguments_, train_dataset=TinyCaptions()
        )


def test_adversarial_training_of_a_bfloat16_model_keeps_its_discriminators_in_float32(tmp_path):
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[2]).to(torch.bfloat16)
    trainer = trainer_for(tmp_path, model, exit_loss="adversarial", freeze_backbone=True, max_steps=1)
    trainer.train()
    assert all(p.dtype == torch.float32 for p in trainer.discriminators.parameters())
    assert torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss_adv_2"]))


def test_the_discriminators_step_before_the_generators_loss_reads_them(tmp_path, monkeypatch):
    """FREE's alternation: on each micro-batch the discriminators learn from its features, then the exits' loss is
    taken against the discriminators as they now are."""
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[1, 3])
    trainer = trainer_for(tmp_path, model, exit_loss="adversarial", freeze_backbone=True, max_steps=2)
    events = []
    for name in ("discriminator_step", "frozen_discriminator_logits"):
        method = getattr(trainer, name)
        monkeypatch.setattr(trainer, name, lambda *args, _method=method, _name=name: (events.append(_name),
                                                                                    _method(*args))[1])  # fmt: skip
    trainer.train()
    assert events == ["discriminator_step", "frozen_discriminator_logits"] * 2


def test_adversarial_step_trains_exits_and_discriminators_and_leaves_the_frozen_backbone(tmp_path):
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[1, 3])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = trainer_for(tmp_path, model, exit_loss="adversarial", freeze_backbone=True, gradient_accumulation_steps=2)
    discriminators_before = [p.detach().clone() for p in trainer.discriminators.parameters()]
    trainer.train()
    for name, parameter in model.named_parameters():
        changed = not torch.equal(parameter, before[name])
        assert changed == ("exit_transformer_layers" in name), name
    discriminators = trainer.accelerator.unwrap_model(trainer.discriminators)
    assert all(not torch.equal(a, b) for a, b in zip(discriminators.parameters(), discriminators_before, strict=True))
    logged = trainer.state.log_history[0]
    for key in ("loss_exit_1", "loss_exit_3", "loss_adv_1", "loss_adv_3", "loss_disc"):
        assert key in logged and torch.isfinite(torch.tensor(logged[key])), key


def test_per_exit_losses_are_logged(tmp_path):
    trainer = trainer_for(tmp_path)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert {"loss", "loss_exit_1", "loss_exit_2", "loss_exit_3", "loss_final"} <= set(logged)
    assert logged["loss_exit_1"] > logged["loss_final"] > 0 or logged["loss_exit_1"] > 0


@pytest.mark.parametrize("accumulation", [1, 2])
def test_uniform_terms_sum_to_the_logged_loss_over_several_steps(tmp_path, accumulation):
    """The Trainer logs the mean of each step's per-token loss: the terms are averaged the same way, also when the
    steps hold different token counts."""
    dataset = TinyCaptions(size=8, lengths=(5, 5, 1, 1, 1, 1, 1, 1))
    trainer = trainer_for(
        tmp_path, dataset=dataset, max_steps=4 // accumulation, logging_steps=4 // accumulation, learning_rate=0.0,
        per_device_train_batch_size=2, gradient_accumulation_steps=accumulation, exit_loss_weights="uniform",
    )  # fmt: skip
    trainer.train()
    logged = trainer.state.log_history[0]
    terms = [logged[f"loss_exit_{layer}"] for layer in range(1, DEPTH)] + [logged["loss_final"]]
    assert sum(terms) == pytest.approx(logged["loss"], rel=1e-4)


def test_a_trained_model_generates_with_exits_and_saves_use_cache(tmp_path):
    trainer = trainer_for(tmp_path)
    trainer.train()
    trainer.save_model()
    assert trainer.model.config.use_cache is True  # the Trainer sets False; saved, it would slow plain generate
    out = trainer.model.generate(
        **tiny_inputs(batch=2), max_new_tokens=4, exit_threshold=0.5, return_dict_in_generate=True
    )
    assert out.exit_layers.shape == (2, out.sequences.shape[1] - 1)


def test_an_evaluations_generation_config_is_not_saved_as_the_models(tmp_path):
    """Seq2SeqTrainer makes `args.generation_config` the model's; an evaluation's exit knobs and lengths must not
    become the saved defaults, nor the model's special tokens and calibrated exits be lost."""
    model = tiny_model(decoder_layers=DEPTH)
    model.generation_config.encoder_exit_threshold = 0.9  # what `calibrate --write` saves
    own = model.generation_config.to_dict()
    evaluation = GenerationConfig(max_new_tokens=3, exit_threshold=0.0, exit_policy="confidence")
    layers = []
    trainer = EarlyExitTrainer(
        model=model,
        args=arguments(tmp_path, predict_with_generate=True, generation_config=evaluation),
        eval_dataset=TinyCaptions(),
        compute_metrics=lambda prediction: {"rows": float(len(prediction.label_ids))},
    )
    trainer.model.register_forward_hook(lambda module, args, output: layers.append(output.exit_layers))
    assert trainer.evaluate()["eval_rows"] == 8.0  # the model's own decoder start token: it generates
    # Three steps of `generate` (max_new_tokens), every token after layer 1 (threshold 0); the loss passes run all.
    steps = [int(step.max()) for step in layers if step is not None]
    assert steps.count(1) == 3 and set(steps) == {1, DEPTH}
    trainer.save_model()
    saved = GenerationConfig.from_pretrained(tmp_path / "out").to_dict()
    kept = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "forced_eos_token_id", "encoder_exit_threshold")
    assert {name: saved.get(name) for name in kept} == {name: own.get(name) for name in kept}
    assert saved.get("exit_threshold") is None and saved["max_new_tokens"] is None


def test_arguments_with_an_evaluation_controller_print_and_log_as_json(tmp_path):
    evaluation = GenerationConfig(max_new_tokens=3, exit_controller=FixedLayerExit(2))
    args = arguments(tmp_path, generation_config=evaluation)
    assert "'exit_controller': 'FixedLayerExit(2)'" in str(args)  # the stock text failed: JSON of the config
    assert json.loads(args.to_json_string())["generation_config"]["exit_controller"] == "FixedLayerExit(2)"
    assert "FixedLayerExit(2)" in args.to_sanitized_dict()["generation_config"]  # what TensorBoard logs
    assert args.generation_config.exit_controller.layer == 2  # what the evaluation gets is the controller itself


def test_resume_from_a_checkpoint_continues_the_same_loss_curve(tmp_path):
    def run(resume: bool):
        model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[2])
        trainer = trainer_for(
            tmp_path,
            model,
            exit_loss="adversarial",
            freeze_backbone=True,
            max_steps=4,
            save_strategy="steps",
            save_steps=2,
            per_device_train_batch_size=2,
        )
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2") if resume else None)
        return {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}

    straight = run(resume=False)
    assert (tmp_path / "out" / "checkpoint-2" / DISCRIMINATORS_NAME).is_file()
    resumed = run(resume=True)
    for step in (3, 4):
        for key in ("loss", "loss_exit_2", "loss_adv_2", "loss_disc"):
            assert resumed[step][key] == pytest.approx(straight[step][key], rel=1e-5, abs=1e-7), (step, key)


def test_lora_model_trains_its_adapters_only(tmp_path):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(
        tiny_model(decoder_layers=DEPTH),
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = trainer_for(tmp_path, model)
    trainer.train()
    for name, parameter in model.named_parameters():
        assert (not torch.equal(parameter, before[name])) == ("lora_" in name), name
    assert "loss_exit_1" in trainer.state.log_history[0]


def test_a_peft_model_trains_exit_heads_listed_in_modules_to_save_and_refuses_them_frozen(tmp_path):
    """PEFT freezes all but its adapters and saves only its own modules: heads outside `modules_to_save` would stay
    untrained (deep supervision) or be lost at saving (`freeze_backbone`), so both are refused."""
    peft = pytest.importorskip("peft")

    def lora(**extra):
        lora_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra)
        return peft.get_peft_model(tiny_model(decoder_layers=DEPTH, exit_adapter_dim=8), lora_config)

    heads = [f"exit_adapters.{index}" for index in range(DEPTH - 1)]
    with pytest.raises(ValueError, match="modules_to_save"):
        trainer_for(tmp_path, lora(), exit_loss="deep_supervision")
    with pytest.raises(ValueError, match="modules_to_save"):
        trainer_for(tmp_path, lora(modules_to_save=heads), exit_loss="deep_supervision", freeze_backbone=True)
    model = lora(modules_to_save=heads)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if "exit_adapters" in name}
    trainer_for(tmp_path, model, exit_loss="deep_supervision", max_steps=1).train()
    trained = [name for name, p in model.named_parameters() if name in before and not torch.equal(p, before[name])]
    assert trained and all("modules_to_save" in name for name in trained)


def test_the_label_free_losses_train_a_peft_models_exit_heads_alone(tmp_path):
    """`distill` moves nothing but the exit heads: PEFT's own freezing serves, and LoRA on the backbone is refused."""
    peft = pytest.importorskip("peft")
    heads = [f"exit_adapters.{index}" for index in range(DEPTH - 1)]

    def adapted(targets: list[str], saved: list[str] | None = None):
        config = peft.LoraConfig(r=4, target_modules=targets, modules_to_save=saved)
        return peft.get_peft_model(tiny_model(decoder_layers=DEPTH, exit_adapter_dim=8), config)

    dataset = TinyCaptions(labels=False)
    # Was refused either way: `freeze_backbone` on a PEFT model, and the label-free losses without it.
    trainer_for(tmp_path, adapted(["down", "up"]), dataset, exit_loss="distill", max_steps=1).train()  # in the heads
    with pytest.raises(ValueError, match="training the backbone .*lora.* would drift"):
        trainer_for(tmp_path, adapted(["q_proj", "v_proj"], heads), dataset, exit_loss="distill")


# --- evaluation ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exit_loss", ["distill", "adversarial"])
def test_label_free_losses_report_the_loss_they_train_as_eval_loss(tmp_path, exit_loss):
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[2])
    dataset = TinyCaptions(labels=False)
    trainer = trainer_for(
        tmp_path, model, dataset=dataset, exit_loss=exit_loss, per_device_eval_batch_size=8, freeze_backbone=True
    )
    metrics = trainer.evaluate(eval_dataset=dataset)
    with torch.no_grad():
        expected = float(trainer.compute_loss(model.eval(), batch_of(dataset, size=8)))
    assert metrics["eval_loss"] == pytest.approx(expected, rel=1e-5)


def test_an_evaluation_loss_is_this_batchs_per_token_mean_whatever_count_the_trainer_passes(tmp_path):
    """The Trainer passes evaluation a count summed over every process, then averages the processes' losses."""
    trainer = trainer_for(tmp_path)
    batch = batch_of(TinyCaptions())
    with torch.no_grad():
        own = float(trainer.compute_loss(trainer.model.eval(), batch))
        counted = float(trainer.compute_loss(trainer.model, batch, num_items_in_batch=torch.tensor(1000)))
    assert counted == pytest.approx(own)


def adversarial_trainer(tmp_path, max_steps: int) -> EarlyExitTrainer:
    """BLIPEE's training of a tiny model, checkpointing every 2 steps."""
    model = tiny_model(decoder_layers=DEPTH, exit_transformer_layers=[2])
    return trainer_for(
        tmp_path,
        model,
        exit_loss="adversarial",
        freeze_backbone=True,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=2,
    )


def test_resuming_on_a_numbered_host_device_restores_the_discriminators(tmp_path, monkeypatch):
    """A process group on CPUs gives `args.device` "cpu:0", which `torch.load` cannot restore to."""

    adversarial_trainer(tmp_path, 2).train()
    resumed = adversarial_trainer(tmp_path, 3)
    monkeypatch.setattr(EarlyExitTrainingArguments, "device", property(lambda self: torch.device("cpu", 0)))
    resumed.create_optimizer_and_scheduler(num_training_steps=3)
    resumed._load_optimizer_and_scheduler(str(tmp_path / "out" / "checkpoint-2"))
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / DISCRIMINATORS_NAME, weights_only=True)
    for name, value in resumed.discriminators.state_dict().items():
        assert torch.equal(value, saved["discriminators"][name]), name


def test_training_a_model_with_saved_exit_defaults_says_to_recalibrate(tmp_path):
    model = tiny_model(decoder_layers=DEPTH)
    model.generation_config.draft_vocabulary = list(range(3, 60))  # the references' tokens: as good after training
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer_for(tmp_path, model)
    assert not [warning for warning in caught if "recalibrate" in str(warning.message)]
    model.generation_config.exit_threshold = 0.8  # what `calibrate --write` saves
    with pytest.warns(UserWarning, match=r"\{'exit_threshold': 0.8\} were chosen .* recalibrate"):
        trainer_for(tmp_path, model)


# --- bad arguments ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(exit_loss="early"), "Unknown `exit_loss`"),
        (dict(exit_loss_weights="1,x"), "comma-separated list"),
        (dict(exit_loss_weights=[1.0, -1.0]), "non-negative"),
        (dict(distill_temperature=0.0), "distill_temperature"),
        (dict(encoder_exit_sampling=1.5), "encoder_exit_sampling"),
        # NaN passes `x < 0` and `x <= 0`, and one step with it, inf, or weights that sum to 0 left NaN parameters.
        (dict(exit_loss_weights="nan,1,1,1"), "exit_loss_weights"),
        (dict(exit_loss_weights="inf,1,1,1"), "exit_loss_weights"),
        (dict(exit_loss_weights="0,0,0,0"), "not all zero"),
        (dict(exit_loss_weights=None), "exit_loss_weights"),
        (dict(distill_temperature=float("nan")), "distill_temperature"),
        (dict(adversarial_weight=float("inf")), "adversarial_weight"),
        (dict(discriminator_learning_rate=float("nan")), "discriminator_learning_rate"),
    ],
)
def test_bad_arguments_raise(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        arguments(tmp_path, **overrides)


@pytest.mark.parametrize(
    "config, overrides, message",
    [
        ({}, dict(exit_loss_weights="1,1"), "has 2 weights, but exit_loss='layerwise' has 4 loss terms"),
        ({}, dict(exit_loss="adversarial"), "set `exit_transformer_layers`"),
        ({}, dict(exit_loss="deep_supervision"), "set `exit_adapter_dim`"),
        ({}, dict(freeze_backbone=True), "leaves only the exit heads"),
        ({"exit_adapter_dim": 8}, dict(exit_loss="none", freeze_backbone=True), "leaves only the exit heads"),
        # No term at the last layer: a trainable backbone drifts from the full model (was trained, silently).
        ({}, dict(exit_loss="distill"), "exit_loss='distill' trains no term at the last layer.*freeze_backbone=True"),
        ({"exit_transformer_layers": [2]}, dict(exit_loss="adversarial"), "'adversarial' trains no term"),
        ({"encoder_layerdrop": 0.5}, dict(encoder_exit_sampling=0.5), "`encoder_layerdrop` \\(0.5\\) would skip"),
    ],
)
def test_arguments_that_do_not_fit_the_model_raise(tmp_path, config, overrides, message):
    with pytest.raises(ValueError, match=message):
        trainer_for(tmp_path, tiny_model(decoder_layers=DEPTH, **config), **overrides)


def test_task_loss_without_labels_raises(tmp_path):
    dataset = TinyCaptions(labels=False)
    trainer = trainer_for(tmp_path, dataset=dataset)
    with pytest.raises(ValueError, match="needs `labels`"):
        trainer.compute_loss(trainer.model, batch_of(dataset))


def test_resuming_adversarial_training_from_a_checkpoint_without_discriminators_raises(tmp_path):
    adversarial_trainer(tmp_path, 2).train()
    (tmp_path / "out" / "checkpoint-2" / DISCRIMINATORS_NAME).unlink()
    with pytest.raises(ValueError, match=f"{DISCRIMINATORS_NAME}.*save_only_model=True"):
        adversarial_trainer(tmp_path, 3).train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


@pytest.mark.parametrize("decomposed", [False, True])
def test_encoder_exit_sampling_trains_on_shallower_encoder_states(tmp_path, decomposed):
    """With sampling 1.0 a one-row batch's loss is the loss at some encoder depth 1..L-1 (never the full depth),
    and different steps draw different depths; with 0.0 it is the full model's loss."""
    model = tiny_model(decoder_layers=DEPTH, encoder_layers=4, decompose_encoder_modalities=decomposed)
    batch = batch_of(TinyCaptions(), size=1)
    parts = ("encoder_image", "encoder_text") if decomposed else ("encoder",)

    def loss_at(depths: tuple[int, ...]) -> float:
        settings = EarlyExitSettings(**{part: FixedLayerExit(d) for part, d in zip(parts, depths, strict=True)})
        with torch.no_grad():
            encoder_outputs = model.eval().get_encoder()(
                batch["input_ids"], batch["attention_mask"], batch["pixel_values"], settings
            )
            return float(trainer.compute_loss(model, {**batch, "encoder_outputs": encoder_outputs}))

    def sampled_loss() -> float:
        with torch.no_grad():
            return float(trainer.compute_loss(model.train(), batch, num_items_in_batch=tokens))

    trainer = trainer_for(tmp_path, model, encoder_exit_sampling=1.0, exit_loss="layerwise")
    shallow = {depths: loss_at(depths) for depths in itertools.product(range(1, 4), repeat=len(parts))}
    full = loss_at((4,) * len(parts))
    tokens = int(batch["labels"].ne(-100).sum())
    drawn = [sampled_loss() for _ in range(8)]
    matched = [min(shallow, key=lambda depths, loss=loss: abs(shallow[depths] - loss)) for loss in drawn]
    for loss, depths in zip(drawn, matched, strict=True):
        assert loss == pytest.approx(shallow[depths], rel=1e-5) and loss != pytest.approx(full, rel=1e-5)
    assert len(set(matched)) > 1

    trainer.args.encoder_exit_sampling = 0.0
    assert sampled_loss() == pytest.approx(full, rel=1e-5)


def test_encoder_exit_sampling_times_nothing_in_the_training_loop(tmp_path):
    """Rows stopping at their sampled layers leave the batch: no plan chosen by a clock (`row_exit="auto"`), which
    timed layers inside training steps and could pick another path on another run."""
    model = tiny_model(decoder_layers=DEPTH, encoder_layers=4)
    trainer = trainer_for(tmp_path, model, encoder_exit_sampling=1.0, exit_loss="layerwise")
    trainer.compute_loss(model.train(), batch_of(TinyCaptions(), size=4)).backward()
    assert not model.encoder.measured_layer_costs


def test_push_to_hub_uploads_remote_code_and_the_early_exit_card_from_the_main_process(tmp_path):
    from unittest import mock

    from huggingface_hub import ModelCard

    api = mock.MagicMock()
    api.create_repo.return_value.repo_id = "someone/tiny-ee"
    with mock.patch("transformers.trainer.hf_api", return_value=api):
        trainer = trainer_for(tmp_path, push_to_hub=True, hub_model_id="someone/tiny-ee", hub_token="hf_test")
        trainer.train()
        trainer.push_to_hub(license="mit", finetuned_from="someone/ofa-base", tags=["shapes", "early-exit"])
    api.create_repo.assert_called_once_with("someone/tiny-ee", token="hf_test", private=None, exist_ok=True)
    upload = api.upload_folder.call_args.kwargs
    assert (upload["repo_id"], upload["folder_path"]) == ("someone/tiny-ee", str(tmp_path / "out"))
    output = tmp_path / "out"
    assert {"modeling_ofa.py", "configuration_ofa.py", "exit_controllers.py"} <= {p.name for p in output.iterdir()}
    assert "AutoModel" in json.loads((output / "config.json").read_text())["auto_map"]
    card = ModelCard.load(output / "README.md")
    metadata = (card.data.library_name, card.data.base_model, card.data.license)
    assert metadata == ("transformers", "someone/ofa-base", "mit")
    assert card.data.tags[-2:] == ["custom_code", "shapes"]  # the user's tags after the library's, once each
    assert "`exit_loss`: layerwise" in card.text and "`steps`: 2" in card.text
    assert "Not measured yet" in card.text  # no benchmark.jsonl in the output folder yet
    # What the card says of its defaults and recipe is true: none calibrated, and the recipe file it cites is there.
    assert "calibrated on held-out" not in card.text and "saves no exit defaults" in card.text
    assert "`training_recipe.json` in this repository" in card.text
    assert json.loads((output / "training_recipe.json").read_text())["options"]["steps"] == 2

    (output / "README.md").unlink()
    with mock.patch.object(trainer, "is_world_process_zero", return_value=False):
        trainer.create_model_card()
    assert not (output / "README.md").exists()


def test_a_subclass_loss_is_recorded_as_its_own_in_the_card(tmp_path):
    class ScaledLoss(EarlyExitTrainer):
        def exit_loss_and_terms(self, *args, **kwargs):
            loss, terms = super().exit_loss_and_terms(*args, **kwargs)
            return 2 * loss, terms

    trainer = ScaledLoss(model=tiny_model(decoder_layers=DEPTH), args=arguments(tmp_path), train_dataset=TinyCaptions())
    trainer.train()
    trainer.create_model_card()
    recipe = json.loads((tmp_path / "out" / "training_recipe.json").read_text())
    assert recipe["options"]["exit_loss"] == "ScaledLoss.exit_loss_and_terms (on 'layerwise')"
    # A script's own recipe file is kept, and the card shows it (it was overwritten with the shorter one).
    own = {"script": "my_training.py", "options": {"phases": 3}}
    (tmp_path / "out" / "training_recipe.json").write_text(json.dumps(own))
    trainer.create_model_card()
    assert json.loads((tmp_path / "out" / "training_recipe.json").read_text()) == own
    assert "`phases`: 3" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.parametrize("exit_loss", ["layerwise", "distill"])
def test_eval_loss_is_the_exit_loss_whether_or_not_evaluation_generates(tmp_path, exit_loss):
    """Seq2SeqTrainer's generating step computed the final layer's cross-entropy alone; `eval_loss` must not change
    meaning with `predict_with_generate`. Evaluation gathers no exit hidden states."""
    model = tiny_model(decoder_layers=DEPTH, exit_adapter_dim=8)
    frozen = exit_loss == "distill"  # the label-free losses train exit heads on a frozen backbone
    losses = {}
    for generating in (False, True):
        trainer = EarlyExitTrainer(
            model=model,
            args=arguments(
                tmp_path,
                exit_loss=exit_loss,
                predict_with_generate=generating,
                generation_max_length=4,
                freeze_backbone=frozen,
            ),
            eval_dataset=TinyCaptions(),
            compute_metrics=lambda prediction: {"rows": float(len(prediction.label_ids))},
        )
        metrics = trainer.evaluate()
        losses[generating] = metrics["eval_loss"]
        assert metrics["eval_rows"] == 8.0
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)
