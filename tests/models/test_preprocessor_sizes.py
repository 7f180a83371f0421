"""The folder's preprocessor_config.json must cut images into the patches the vision tower was built for: a patch,
merge or temporal patch size that disagrees is refused when the engine is built, naming the file and the sizes
(a temporal_patch_size of 1 against the tower's 2 loaded and failed on every image inside the tower)."""

from __future__ import annotations

import json

import pytest

from hybridcache.mm_processor import ImageProcessor
from hybridcache.models.vision_config import VisionConfig
from hybridcache.models.vl_folders import write_tiny_vl_model


@pytest.fixture(scope="module")
def vl_folder(tmp_path_factory):
    return write_tiny_vl_model(tmp_path_factory.mktemp("vl"))


def _vision(folder) -> VisionConfig:
    return VisionConfig.from_dict(json.loads((folder / "config.json").read_text()))


def test_matching_sizes_load(vl_folder):
    assert ImageProcessor(vl_folder, _vision(vl_folder)).vision.temporal_patch_size == 2


@pytest.mark.parametrize("key, value", [("temporal_patch_size", 1), ("patch_size", 8), ("merge_size", 4)])
def test_a_size_that_disagrees_with_the_tower_is_refused(vl_folder, tmp_path, key, value):
    import shutil

    folder = shutil.copytree(vl_folder, tmp_path / "copy")
    preprocessor = json.loads((folder / "preprocessor_config.json").read_text())
    preprocessor[key] = value
    (folder / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    with pytest.raises(ValueError, match=rf"preprocessor_config.json has .*{key} {value}.*the vision tower"):
        ImageProcessor(folder, _vision(folder))
