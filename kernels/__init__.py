"""Triton kernels, each with a plain-torch reference twin (``kernels/<op>/reference.py``)."""
