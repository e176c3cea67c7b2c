"""Demonstrations: the HDF5 format, its writer and reader, and training samples from it."""

from .reader import DemoFile, EpisodeInfo, open_demo_files, validate_demo_file
from .schema import stack_frames
from .writer import DemoWriter, EpisodeBuffer, merge_demo_files

__all__ = [
    "DemoFile",
    "DemoWriter",
    "EpisodeBuffer",
    "EpisodeInfo",
    "merge_demo_files",
    "open_demo_files",
    "stack_frames",
    "validate_demo_file",
]
