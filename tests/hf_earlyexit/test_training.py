"""Training helpers of the CLI: what a new tokenizer learns from, and arguments left as the caller gave them."""

import datasets

from hf_earlyexit import EarlyExitTrainingArguments
from hf_earlyexit.training import small_model_and_processor, tokenizer_texts, train_exits
from tests.hf_earlyexit.test_data import shapes_dataset


def test_a_new_tokenizer_learns_every_reference_and_the_prompt():
    rows = datasets.Dataset.from_dict({"caption": [["a red circle", "a round red shape"], ["a blue square"]]})
    # Lists of references were dropped, and the prompt given for every row was never seen: a BPE trained on nothing.
    texts = tokenizer_texts(rows, None, "caption", " what does the image describe?")
    assert texts == [" what does the image describe?", "a red circle", "a round red shape", "a blue square"]
    rows = datasets.Dataset.from_dict({"question": ["what color?"], "answer": ["red"]})
    assert tokenizer_texts(rows, "question", "answer", "unused") == ["what color?", "red"]


def test_train_exits_leaves_the_callers_arguments_as_given(tmp_path):
    dataset = shapes_dataset(4)
    model, processor = small_model_and_processor(tokenizer_texts(dataset, "question", "answer", ""), vocab_size=300)
    args = EarlyExitTrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none", use_cpu=True
    )
    trainer = train_exits(model, processor, dataset, args)
    assert args.remove_unused_columns and not trainer.args.remove_unused_columns  # the collator reads raw columns


def test_a_runs_recipe_names_its_folders_where_they_are_and_its_processes(tmp_path, monkeypatch):
    """`--resume` compared paths as written: the same folder given another way was refused, another folder given
    the same relative way from elsewhere was taken. A run's processes make its batch; None options stay off a card."""
    import argparse

    import pytest

    from hf_earlyexit.training import run_recipe, write_recipe

    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    options = argparse.Namespace(
        dataset="json:data", model_dir=None, split=None, image_column="image", text_column="question",
        target_column="answer", prompt=None, batch_size=4, learning_rate=1e-4, max_steps=None,
    )  # fmt: skip
    trained = {"exit_loss": "layerwise", "disable_tqdm": False}
    recipe = run_recipe(options, {}, trained)
    assert recipe["data"]["dataset"] == f"json:{tmp_path / 'data'}"
    assert recipe["options"] == {
        "batch_size_per_process": 4, "processes": 1, "learning_rate": 1e-4, "exit_loss": "layerwise", "max_steps": 1000
    }  # fmt: skip
    write_recipe(tmp_path / "run" / "training_recipe.json", recipe)
    started = tmp_path / "run" / "training_recipe.json"
    same_folder = argparse.Namespace(**{**vars(options), "dataset": f"json:{tmp_path}/data/"})
    assert run_recipe(same_folder, {}, trained, started)["data"] == recipe["data"]
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="processes=1 there, 2 here"):
        run_recipe(options, {}, trained, started)
