"""Tests of the .pps language, the checker, the renderer and the `piper` CLI."""
