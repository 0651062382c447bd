"""A user's file keeps its file:line in diagnostics whatever its folders are named (`piper/`, `torch/`)."""
import importlib.util
import sys
import textwrap

import pytest
import torch

import piper
from piper.frontend.capture import capture
from piper.frontend.frames import is_library_file, last_user_frame

MODEL = textwrap.dedent('''
    import torch
    import piper

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 1)

        def forward(self, x, y):
            with piper.annotate("PP"):
                h = self.a(x)
            h = torch.relu(h)                      # line 14: outside every region
            with piper.annotate("PP"):
                return ((self.b(h).squeeze(-1) - y) ** 2).mean()
''')


def _load(path, monkeypatch):
    name = f"user_model_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)     # Dynamo looks the model's module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("folders", [("piper",), ("torch",), ("piper", "piper", "examples")])
def test_a_model_file_under_a_folder_named_like_a_library_keeps_its_line(tmp_path, monkeypatch, folders):
    # `git clone .../piper` makes a folder `piper`: its examples are the user's code, not Piper's.
    where = tmp_path.joinpath(*folders)
    where.mkdir(parents=True)
    (where / "my_model.py").write_text(MODEL)
    model = _load(where / "my_model.py", monkeypatch).Model()
    program = capture(model, (torch.randn(4, 4), torch.randn(4)))
    (op, why, at), = program.regions[1].joined
    assert op == "aten.relu.default" and why == "first user"
    assert at == f"{where / 'my_model.py'}:14"


def test_library_files_are_told_by_location_not_by_name(tmp_path):
    assert is_library_file(torch.__file__) and is_library_file(piper.__file__)
    assert is_library_file(importlib.util.find_spec("piper.dsl").origin)
    assert not is_library_file(str(tmp_path / "piper" / "model.py"))
    assert not is_library_file(str(tmp_path / "torch" / "nn.py"))
    trace = (f'File "{tmp_path}/piper/model.py", line 7, in forward\n'
             f'File "{torch.__file__}", line 99, in __call__\n')
    assert last_user_frame(trace) == f"{tmp_path}/piper/model.py:7"
    assert last_user_frame(f'File "{piper.__file__}", line 3') is None
