"""A step's batch crosses to the workers as numpy arrays (`runtime/launch/wire.py`): every dtype
comes back bit for bit, a dtype numpy lacks included, and what arrives may be written."""
import pickle

import numpy as np
import pytest
import torch

from piper.runtime.launch.wire import Viewed, pack, unpack

DTYPES = [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float64, torch.float32, torch.float16,
          torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (3,), (2, 5, 4)], ids=str)
def test_every_dtype_comes_back_bit_for_bit(dtype, shape):
    x = (torch.randn(shape, dtype=torch.float64) * 50).to(dtype)
    wired = pickle.loads(pickle.dumps(pack(x), protocol=5))
    assert isinstance(wired, Viewed) == (dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2))
    y = unpack(wired)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y.view(torch.uint8) if y.dim() else y.reshape(1).view(torch.uint8),
                       x.view(torch.uint8) if x.dim() else x.reshape(1).view(torch.uint8))


def test_a_read_only_array_arrives_writable_and_a_tensor_passes_through():
    a = np.arange(6, dtype=np.int64)
    a.flags.writeable = False
    t = unpack(a)
    t += 1                                   # would write Ray's read-only buffer without the copy
    assert a.tolist() == list(range(6)) and t.tolist() == list(range(1, 7))
    x = torch.ones(2)
    assert unpack(x) is x


def test_a_name_that_is_no_dtype_is_refused():
    with pytest.raises(TypeError, match="not a torch dtype"):
        unpack(Viewed(np.zeros(2, dtype=np.int16), "Tensor"))
