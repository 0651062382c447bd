"""Annotated example models for Piper; run one with `python examples/<name>.py`."""
