"""`hf-earlyexit` command line: convert, caption, train, demo, bench.

Every user error (bad path, unreadable image, wrong model folder, bad option) ends in one line on stderr and
exit status 2, never a traceback.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

PROMPT = " what does the image describe?"


def shared_dir() -> Path | None:
    """The project's `shared/` folder (reference tokenizer, fixtures): $HF_EARLYEXIT_SHARED or ../shared."""
    candidates = [os.environ.get("HF_EARLYEXIT_SHARED"), Path.cwd().parent / "shared", Path.cwd() / "shared"]
    for candidate in candidates:
        if candidate and (Path(candidate) / "reference").is_dir():
            return Path(candidate)
    return None


def load_image(path: str):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        raise ValueError(f"No image at {path}.") from None
    except (UnidentifiedImageError, OSError) as error:
        raise ValueError(f"Cannot read {path} as an image ({error}).") from None


def load_model_and_processor(model_dir: str, **config_fields):
    """A saved hf-earlyexit model (in eval mode) and its processor; `config_fields` override the config (e.g. to
    add exit heads)."""
    from transformers import AutoModel, AutoProcessor

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"{model_dir} is not a model folder (no config.json).")
    if json.loads((path / "config.json").read_text()).get("model_type") != "ofa_early_exit":
        raise ValueError(f"{model_dir} is not an hf-earlyexit OFA model (model_type is not 'ofa_early_exit').")
    model = AutoModel.from_pretrained(path, trust_remote_code=True, **config_fields).eval()
    processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
    return model, processor


def caption_images(model, processor, images: list, prompt: str, num_beams: int, max_new_tokens: int):
    import torch

    inputs = processor(images=images, text=[prompt] * len(images), return_tensors="pt")
    start = time.perf_counter()
    with torch.no_grad():
        sequences = model.generate(**inputs, num_beams=num_beams, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    return processor.batch_decode(sequences, skip_special_tokens=True), sequences, seconds


def cmd_convert(args: argparse.Namespace) -> None:
    from .convert import convert_checkpoint
    from .modeling.processing_ofa import OFAImageProcessor, OFAProcessor

    model = convert_checkpoint(args.source, args.target)
    print(f"converted {args.source} -> {args.target} ({model.num_parameters() / 1e6:.1f}M parameters)")
    if args.tokenizer:
        tokenizer = OFAProcessor.build_tokenizer(args.tokenizer)
        if len(tokenizer) != model.config.vocab_size:
            raise ValueError(
                f"The tokenizer has {len(tokenizer)} tokens but the model's vocabulary has {model.config.vocab_size}."
            )
        image_processor = OFAImageProcessor(size={"height": args.image_size, "width": args.image_size})
        OFAProcessor(image_processor, tokenizer).save_pretrained(args.target)
        print(f"saved the processor ({len(tokenizer)} tokens, {args.image_size}px images)")


def cmd_caption(args: argparse.Namespace) -> None:
    images = [load_image(path) for path in args.images]
    model, processor = load_model_and_processor(args.model_dir)
    captions, _, seconds = caption_images(model, processor, images, args.prompt, args.num_beams, args.max_new_tokens)
    for path, caption in zip(args.images, captions, strict=True):
        print(f"{path}\t{caption.strip()}")
    print(f"{len(images)} image(s) in {seconds:.2f} s", file=sys.stderr)


def sample_image():
    """A drawn scene (no download): a red circle and a blue square on a light background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (256, 256), (235, 235, 225))
    draw = ImageDraw.Draw(image)
    draw.ellipse((30, 40, 120, 130), fill=(200, 30, 30))
    draw.rectangle((140, 120, 230, 210), fill=(30, 60, 200))
    return image


def cmd_demo(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import load_file

    from .convert import convert_checkpoint
    from .modeling import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
    from .modeling.processing_ofa import OFAImageProcessor, OFAProcessor

    shared = shared_dir()
    if shared is None:
        raise ValueError("The demo needs the project's shared/ folder (set HF_EARLYEXIT_SHARED or run beside it).")
    output = Path(args.output_dir)
    torch.manual_seed(0)

    fixture = shared / "fixtures" / "ofa_ref_A"
    if fixture.is_dir():
        converted = convert_checkpoint(fixture, output / "ofa-reference-converted")
        io = load_file(fixture / "io.safetensors")
        with torch.no_grad():
            logits = converted(
                input_ids=io["input_ids"], pixel_values=io["patch_images"], decoder_input_ids=io["decoder_input_ids"]
            ).logits
        error = (logits - io["logits"]).abs().max().item()
        print(f"1. converted the official-format OFA checkpoint {fixture} -> {output / 'ofa-reference-converted'}")
        print(f"   max |logits - official OFA logits| = {error:.2e}")

    model_dir = output / "ofa-tiny"
    tokenizer = OFAProcessor.build_tokenizer(str(shared / "reference" / "bart_tokenizer"))
    config = OFAEarlyExitConfig.from_preset("tiny", vocab_size=len(tokenizer))
    EarlyExitOFAForConditionalGeneration(config).save_pretrained(model_dir)
    OFAProcessor(OFAImageProcessor(size={"height": 256, "width": 256}), tokenizer).save_pretrained(model_dir)
    print(
        f"2. built an OFA-tiny model ({config.resnet_type} stem, {config.encoder_layers}+{config.decoder_layers} "
        f"layers, d_model {config.d_model}) with the OFA tokenizer -> {model_dir}"
    )
    print("   its weights are randomly initialised: the caption below shows the pipeline, not a trained model")

    model, processor = load_model_and_processor(str(model_dir))
    captions, sequences, seconds = caption_images(model, processor, [sample_image()], PROMPT, 5, 16)
    print("3. loaded it with AutoModel/AutoProcessor (trust_remote_code=True) and captioned a drawn image, beam 5:")
    print(f"   prompt {PROMPT!r} -> {captions[0].strip()!r}")
    print(f"   tokens {sequences[0].tolist()}")
    print(f"   {seconds:.2f} s on {torch.get_num_threads()} CPU thread(s)")

    inputs = processor(images=[sample_image()], text=[PROMPT], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, num_beams=5, max_new_tokens=16, exit_threshold=0.8, return_dict_in_generate=True)
    layers = out.exit_layers[0][out.exit_layers[0] > 0].tolist()
    print("4. the same with early exit (exit_threshold=0.8: a token leaves once a layer changes it little):")
    print(f"   -> {processor.batch_decode(out.sequences, skip_special_tokens=True)[0].strip()!r}")
    print(f"   decoder layers run per token {layers} of {model.config.decoder_layers}")
    print("   (random weights: this shows the mechanism; the trained model and its measured trade-off come later)")


def cmd_bench(args: argparse.Namespace) -> None:
    from .benchmark import forced_exit_benchmark, training_step_benchmark

    batch_sizes = tuple(int(size) for size in args.batch_sizes.split(",")) if args.batch_sizes else ()
    if any(size < 1 for size in batch_sizes) or args.repeats < 1 or args.new_tokens < 1:
        raise ValueError("--batch-sizes, --repeats and --new-tokens must be positive.")
    if args.training_step:
        report = training_step_benchmark(
            args.preset,
            exit_losses=tuple(args.exit_losses.split(",")),
            batch_size=batch_sizes[0] if batch_sizes else 8,
            image_size=args.image_size,
            target_length=args.new_tokens,
            repeats=args.repeats,
        )
        print(json.dumps(report, indent=None if args.json else 2))
        return
    report = forced_exit_benchmark(
        args.forced_exit,
        preset=args.preset,
        batch_sizes=batch_sizes,
        encoder_batch_size=args.encoder_batch_size,
        new_tokens=args.new_tokens,
        image_size=args.image_size,
        repeats=args.repeats,
        device=args.device,
        dtype=args.dtype,
    )
    print(json.dumps(report, indent=None if args.json else 2))


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """The data, model and run options of `hf-earlyexit train` and `examples/train_*.py`."""
    parser.add_argument("--model-dir", help="a saved hf-earlyexit model to start from (default: a small new one)")
    parser.add_argument(
        "--dataset",
        default="easy-vqa",
        help="'easy-vqa', a save_to_disk folder, 'loader:folder' (imagefolder, parquet, ...) or a data set name",
    )
    parser.add_argument("--split", default="train")
    parser.add_argument("--image-column", default="image")
    parser.add_argument("--text-column", default="question", help="prompt column ('' = use --prompt for all rows)")
    parser.add_argument("--target-column", default="answer")
    parser.add_argument("--prompt", default=" what does the image describe?")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--max-steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--learning-rate", type=float, default=1e-4)


def parse_layers(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3] (decoder layers for exit transformer layers)."""
    try:
        return [int(layer) for layer in text.split(",")]
    except ValueError:
        raise ValueError(f"Exit layers must be comma-separated layer numbers, got {text!r}.") from None


def cmd_train(args: argparse.Namespace) -> None:
    from .training import fine_tune

    config_fields = {}
    if args.exit_adapter_dim:
        config_fields["exit_adapter_dim"] = args.exit_adapter_dim
    if args.exit_transformer_layers:
        config_fields["exit_transformer_layers"] = parse_layers(args.exit_transformer_layers)
    trainer = fine_tune(
        args, config_fields, exit_loss=args.exit_loss, freeze_backbone=args.freeze_backbone, disable_tqdm=False
    )
    last = [entry for entry in trainer.state.log_history if "loss" in entry][-1]
    losses = {key: round(value, 4) for key, value in last.items() if key.startswith("loss")}
    print(f"trained {args.max_steps} steps with exit_loss={args.exit_loss!r}; last logged {losses}")
    print(f"saved the model and processor to {args.output_dir}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-earlyexit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="convert an official OFA checkpoint (HF port or fairseq)")
    convert.add_argument("--from", dest="source", required=True, help="official checkpoint folder or fairseq .pt")
    convert.add_argument("--to", dest="target", required=True, help="output folder (hf-earlyexit format)")
    convert.add_argument("--tokenizer", help="folder with BART vocab.json + merges.txt, saved as the processor")
    convert.add_argument("--image-size", type=int, default=384, help="processor image size (default 384)")
    convert.set_defaults(run=cmd_convert)

    caption = commands.add_parser("caption", help="caption images with a saved model")
    caption.add_argument("model_dir")
    caption.add_argument("images", nargs="+")
    caption.add_argument("--prompt", default=PROMPT)
    caption.add_argument("--num-beams", type=int, default=5)
    caption.add_argument("--max-new-tokens", type=int, default=16)
    caption.set_defaults(run=cmd_caption)

    train = commands.add_parser("train", help="train exits on an image-text data set (EarlyExitTrainer)")
    add_training_arguments(train)
    train.add_argument(
        "--exit-loss", default="layerwise", help="layerwise (default), deep_supervision, distill, adversarial or none"
    )
    train.add_argument("--exit-adapter-dim", type=int, help="add DEED adaptation modules of this width")
    train.add_argument("--exit-transformer-layers", help="add BLIPEE exit layers after these decoder layers: 1,2,3")
    train.add_argument("--freeze-backbone", action="store_true", help="train the exit heads only")
    train.set_defaults(run=cmd_train)

    bench = commands.add_parser(
        "bench",
        help="time full vs forced-exit vs truncated models, or a training step per exit loss (random weights); "
        "prints JSON",
    )
    mode = bench.add_mutually_exclusive_group(required=True)
    mode.add_argument("--forced-exit", type=int, help="exit every row after this many layers")
    mode.add_argument(
        "--training-step",
        action="store_true",
        help="time a training step (forward + backward) per exit loss; --batch-sizes' first size is the batch, "
        "--new-tokens the target length",
    )
    bench.add_argument("--exit-losses", default="none,layerwise", help="with --training-step (default none,layerwise)")
    bench.add_argument("--preset", default="base", choices=["tiny", "medium", "base", "large", "huge"])
    bench.add_argument("--batch-sizes", default="1,8", help="decoder batch sizes, comma-separated (default 1,8)")
    bench.add_argument("--encoder-batch-size", type=int, default=1)
    bench.add_argument("--new-tokens", type=int, default=16)
    bench.add_argument("--image-size", type=int, default=384)
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--device", default="cpu")
    bench.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    bench.add_argument("--json", action="store_true", help="one line of JSON (default: indented)")
    bench.set_defaults(run=cmd_bench)

    demo = commands.add_parser("demo", help="convert, build and caption end to end")
    demo.add_argument("--output-dir", default="out/demo")
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.run(args)
    except (ValueError, OSError) as error:
        print(f"hf-earlyexit: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
