"""Demonstrations: the HDF5 format, its writer and reader, recorders and scripted players."""

from .reader import DemoFile, EpisodeInfo, validate_demo_file
from .schema import stack_frames
from .writer import DemoWriter, EpisodeBuffer, merge_demo_files

__all__ = [
    "DemoFile",
    "DemoWriter",
    "EpisodeBuffer",
    "EpisodeInfo",
    "merge_demo_files",
    "stack_frames",
    "validate_demo_file",
]
