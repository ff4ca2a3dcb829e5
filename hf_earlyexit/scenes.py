"""Shape scenes: a deterministic, seeded generator of images with two or three coloured shapes of two sizes and
their captions (9-19 words: the objects, their colours, sizes and where they are relative to each other), so that
decoder exits have long sequences to work on. Scene `i` of a split depends only on (split seed, i)."""

import random
from dataclasses import dataclass

import datasets
from PIL import Image, ImageDraw

COLOURS = {
    "red": (210, 40, 40),
    "green": (40, 160, 60),
    "blue": (40, 70, 210),
    "yellow": (230, 200, 30),
    "purple": (140, 50, 170),
    "orange": (240, 130, 30),
}
SHAPES = ("circle", "square", "triangle")
SIZES = {
    "small": 0.07,
    "large": 0.12,
}  # radius as a fraction of the image side: shapes in neighbouring cells never touch
BACKGROUND = (240, 240, 232)
SPLIT_SEEDS = {"train": 0, "validation": 1, "test": 2, "calibration": 3}


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    size: str
    x: float  # centre, as a fraction of the image side
    y: float

    def phrase(self) -> str:
        return f"a {self.size} {self.colour} {self.shape}"


def relation(a: SceneObject, b: SceneObject) -> str:
    """Where `a` is relative to `b`, along the axis on which they are further apart."""
    dx, dy = a.x - b.x, a.y - b.y
    if abs(dx) >= abs(dy):
        return "left of" if dx < 0 else "right of"
    return "above" if dy < 0 else "below"


def caption(objects: list[SceneObject]) -> str:
    """'a small red circle left of a large blue square and a small green triangle below the square' (9-19 words)."""
    first, second = objects[0], objects[1]
    text = f"{first.phrase()} {relation(first, second)} {second.phrase()}"
    if len(objects) == 3:
        third = objects[2]
        text += f" and {third.phrase()} {relation(third, second)} the {second.shape}"
    return text


def place(rng: random.Random, count: int) -> list[tuple[float, float]]:
    """Centres in distinct cells of a 3x3 grid (jittered), so shapes never overlap."""
    cells = rng.sample(range(9), count)
    return [((cell % 3 + 0.5 + rng.uniform(-0.12, 0.12)) / 3, (cell // 3 + 0.5 + rng.uniform(-0.12, 0.12)) / 3)
            for cell in cells]  # fmt: skip


def draw(objects: list[SceneObject], image_size: int) -> Image.Image:
    image = Image.new("RGB", (image_size, image_size), BACKGROUND)
    pen = ImageDraw.Draw(image)
    for obj in objects:
        r = SIZES[obj.size] * image_size
        x, y = obj.x * image_size, obj.y * image_size
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            pen.ellipse((x - r, y - r, x + r, y + r), fill=fill)
        elif obj.shape == "square":
            pen.rectangle((x - r * 0.85, y - r * 0.85, x + r * 0.85, y + r * 0.85), fill=fill)
        else:
            pen.polygon([(x, y - r), (x - r, y + r * 0.8), (x + r, y + r * 0.8)], fill=fill)
    return image


def scene(seed: int, index: int, image_size: int = 128) -> tuple[Image.Image, str, list[SceneObject]]:
    """Scene `index` of the stream `seed`: its image, caption and objects."""
    rng = random.Random(f"shape-scene-{seed}-{index}")
    count = rng.choice((2, 3))
    # Distinct shapes and colours, so "the square" names one object.
    shapes, colours = rng.sample(SHAPES, count), rng.sample(list(COLOURS), count)
    objects = [
        SceneObject(shape, colour, rng.choice(list(SIZES)), x, y)
        for shape, colour, (x, y) in zip(shapes, colours, place(rng, count), strict=True)
    ]
    return draw(objects, image_size), caption(objects), objects


def shape_scenes(split: str = "train", size: int = 2000, image_size: int = 128) -> datasets.Dataset:
    """`size` scenes of a split ("train", "validation", "test", "calibration": disjoint seed streams, each as long as
    asked). Columns: `image`, `caption`, `objects` (number of shapes)."""
    if split not in SPLIT_SEEDS:
        raise ValueError(f"Shape scenes have splits {list(SPLIT_SEEDS)}, got {split!r}.")
    if size < 1 or image_size < 32:
        raise ValueError(f"`size` must be positive and `image_size` at least 32, got {size} and {image_size}.")
    rows: dict[str, list] = {"image": [], "caption": [], "objects": []}
    for index in range(size):
        image, text, objects = scene(SPLIT_SEEDS[split], index, image_size)
        rows["image"].append(image)
        rows["caption"].append(text)
        rows["objects"].append(len(objects))
    return datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())


__all__ = ["COLOURS", "SHAPES", "SceneObject", "caption", "scene", "shape_scenes"]
