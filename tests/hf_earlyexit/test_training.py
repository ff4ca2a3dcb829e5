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
