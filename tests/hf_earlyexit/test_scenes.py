"""Shape scenes: deterministic, captions that say what is drawn, 9-19 words."""

import numpy as np
import pytest

from hf_earlyexit.scenes import COLOURS, caption, relation, scene, shape_scenes


def test_scenes_are_deterministic_and_splits_differ():
    first, again = shape_scenes("train", 6, image_size=64), shape_scenes("train", 6, image_size=64)
    assert first["caption"] == again["caption"]
    assert all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(first["image"], again["image"], strict=True)
    )
    assert shape_scenes("test", 6, image_size=64)["caption"] != first["caption"]
    assert shape_scenes("train", 8, image_size=64)["caption"][:6] == first["caption"]  # scene i depends on i only


def test_captions_name_each_drawn_object_and_its_place():
    for index in range(40):
        image, text, objects = scene(0, index, image_size=96)
        words = text.split()
        assert 9 <= len(words) <= 19 and text == caption(objects)
        pixels = {tuple(pixel) for pixel in np.asarray(image).reshape(-1, 3)}
        for obj in objects:
            assert f"{obj.size} {obj.colour} {obj.shape}" in text
            assert COLOURS[obj.colour] in pixels  # drawn in its colour
            centre = np.asarray(image)[int(obj.y * 96), int(obj.x * 96)]
            assert tuple(centre) == COLOURS[obj.colour]  # at its place
        assert relation(objects[0], objects[1]) in text


def test_bad_split_or_size_raises():
    with pytest.raises(ValueError, match="splits"):
        shape_scenes("dev")
    with pytest.raises(ValueError, match="image_size"):
        shape_scenes("train", 4, image_size=8)
