"""Torch-free library shared by every service: settings, Sample codec, streams, errors."""
