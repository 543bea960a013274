"""Qwen2-VL / Qwen2.5-VL without torchvision (the CPU install has none: no CPU wheel fits torch 2.13 there).

transformers 5.x builds Qwen2-VL's fast image and video processors on torchvision, and vLLM's Qwen2-VL module
imports `smart_resize` from the torchvision one. Images need none of it: `Qwen2VLImageProcessorPil` does the
same resizing and patching with PIL and numpy. `install()` (a no-op when torchvision is importable):

- aliases `transformers.models.qwen2_vl.image_processing_qwen2_vl` to the PIL module, so imports of
  `smart_resize` / `Qwen2VLImageProcessor` from it succeed;
- loads processors' video part as `ImagesOnlyVideoProcessor`, which satisfies
  `Qwen2_5_VLProcessor`'s constructor and refuses videos (without torchvision, videos cannot work anyway).

It is imported by apmpo.rollout.vllm_compat (the server and, spawned, its engine process) and by the weight-sync
worker extension (the engine's workers), before vLLM touches the model.
"""
from __future__ import annotations

import importlib.util
import sys

from transformers.video_processing_utils import VideoProcessorMixin


class ImagesOnlyVideoProcessor(VideoProcessorMixin):
    """Stands in for a video processor where torchvision is missing; any video is an error."""

    merge_size, temporal_patch_size, patch_size = 2, 2, 14  # read by processors' size helpers only

    def __init__(self, **kwargs):  # config values are kept, nothing is computed
        self.__dict__.update({k: v for k, v in kwargs.items() if isinstance(v, (int, float, str))})

    @classmethod
    def from_pretrained(cls, *args, **kwargs) -> "ImagesOnlyVideoProcessor":
        return cls()

    def __call__(self, videos, **kwargs):
        raise RuntimeError("video inputs need torchvision, which is not installed")

    preprocess = __call__


def has_torchvision() -> bool:
    return importlib.util.find_spec("torchvision") is not None


def install() -> None:
    if has_torchvision() or getattr(install, "done", False):
        return
    import transformers
    from transformers import processing_utils
    from transformers.models.qwen2_vl import image_processing_pil_qwen2_vl as pil

    pil.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules["transformers.models.qwen2_vl.image_processing_qwen2_vl"] = pil
    # ProcessorMixin type-checks sub-processors by class name on the top-level module, which exports this
    # class only with torchvision, and loads a processor's video part through this mapping.
    transformers.VideoProcessorMixin = VideoProcessorMixin
    processing_utils.MODALITY_TO_AUTOPROCESSOR_MAPPING._MAPPING_NAMES["video_processor"] = (
        __name__, "ImagesOnlyVideoProcessor")
    install.done = True
