"""Wall-clock of an OFA-base-size model on this machine, in the setting of the official port's reference table
(docs/results.md, "Parity with the official OFA, and OFA-base speed", shows both): random weights, float32, batch 1,
2 threads, an 8-token prompt, 16 new tokens.

    python examples/time_ofa_base.py [--image-size 384] [--repeats 3] [--device cuda --dtype bfloat16]

Prints one JSON object (median seconds of each measurement).
"""

import argparse
import json

import torch

from hf_earlyexit import EarlyExitOFAForConditionalGeneration, OFAEarlyExitConfig
from hf_earlyexit.benchmark import median_seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image-size", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--attn-implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    config = OFAEarlyExitConfig.from_preset("base")
    model = EarlyExitOFAForConditionalGeneration(config).eval().to(device, dtype)
    model.set_attn_implementation(args.attn_implementation)
    input_ids = torch.tensor([[0, 99, 473, 5, 2274, 6190, 116, 2]], device=device)
    pixel_values = torch.randn(1, 3, args.image_size, args.image_size, device=device, dtype=dtype)
    decoder_input_ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    generation = dict(max_new_tokens=16, min_new_tokens=16)

    functions = {
        "stem": lambda: model.encoder.embed_images(pixel_values),
        "encoder": lambda: model.encoder(input_ids, pixel_values=pixel_values),
        "forward": lambda: model(input_ids=input_ids, pixel_values=pixel_values, decoder_input_ids=decoder_input_ids),
    }
    for name, settings in {
        "greedy_cache": dict(num_beams=1),
        "beam5_cache": dict(num_beams=5),
        "greedy_no_cache": dict(num_beams=1, use_cache=False),
    }.items():
        functions[name] = lambda s=settings: model.generate(
            input_ids=input_ids, pixel_values=pixel_values, **generation, **s
        )
    with torch.no_grad():
        results = median_seconds(functions, args.repeats, device)
    print(
        json.dumps(
            {
                "model": "OFA-base (random weights)",
                "parameters_m": round(model.num_parameters() / 1e6, 1),
                "image_size": args.image_size,
                "threads": args.threads,
                "attn_implementation": args.attn_implementation,
                "device": str(device),
                "dtype": args.dtype,
                "seconds": {key: round(value, 3) for key, value in results.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
