"""Small non-tensor values (optimizer hyper-parameters, counters) as JSON that keeps Python's types.

Plain JSON would turn ``betas=(0.9, 0.95)`` into a list and could not hold a tensor learning rate; the
encoding here tags what JSON lacks, so a value comes back exactly as it went in::

    (0.9, 0.95)          -> {"__tuple__": [0.9, 0.95]}
    torch.tensor(1e-3)   -> {"__tensor__": {"dtype": "float32", "shape": [], "data": [0.001]}}
    float("inf")         -> Infinity                      (Python's json, allow_nan)

Only ``None``, booleans, numbers, strings, lists, tuples, string-keyed dicts and small tensors are
written; reading refuses anything else and is bounded in size (it goes through the confined folder).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..errors import CheckpointCorruptError
from ..storage.parse import json_object
from .common import dtype_name, torch_dtype

__all__ = ["encode", "decode", "dumps", "loads", "VALUES_FILE", "MAX_VALUES_BYTES"]

VALUES_FILE = "values.json"
MAX_VALUES_BYTES = 256 << 20
_MAX_TENSOR_ELEMENTS = 1 << 16


def encode(value: Any) -> Any:
    """A small value of a state dict as JSON data (tuples, string-keyed dicts and small tensors tagged so they come
    back as they were)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"__dict__": {k: encode(v) for k, v in value.items()}}
    if isinstance(value, torch.Tensor) and value.numel() <= _MAX_TENSOR_ELEMENTS:
        t = value.detach().cpu()
        return {"__tensor__": {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "data": t.reshape(-1).tolist()}}
    raise TypeError(f"a {type(value).__name__} cannot be stored as a small value ({value!r:.80})")


def decode(value: Any, where: object = "values") -> Any:
    """The inverse of :func:`encode`; malformed data is an error naming ``where``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [decode(v, where) for v in value]
    if isinstance(value, dict) and len(value) == 1:
        (tag, body), = value.items()
        if tag == "__tuple__" and isinstance(body, list):
            return tuple(decode(v, where) for v in body)
        if tag == "__dict__" and isinstance(body, dict):
            return {str(k): decode(v, where) for k, v in body.items()}
        if tag == "__tensor__" and isinstance(body, dict):
            try:
                shape = [int(d) for d in body["shape"]]
                data = body["data"]
                if not isinstance(data, list) or len(data) > _MAX_TENSOR_ELEMENTS:
                    raise ValueError("too many elements")
                return torch.tensor(data, dtype=torch_dtype(body["dtype"])).reshape(shape)
            except (KeyError, TypeError, ValueError, RuntimeError, CheckpointCorruptError) as exc:
                raise CheckpointCorruptError(f"{where}: malformed tensor value ({exc})") from exc
    raise CheckpointCorruptError(f"{where}: a value of an unknown kind: {value!r:.80}")


def dumps(values: dict[str, Any]) -> bytes:
    """A dict of values as the bytes of a JSON file (sorted keys, one value per line)."""
    return (json.dumps({k: encode(v) for k, v in values.items()}, indent=1, sort_keys=True, allow_nan=True)
            + "\n").encode()


def loads(data: bytes, where: object) -> dict[str, Any]:
    """A dict of values from :func:`dumps` bytes; malformed data is an error naming ``where``."""
    return {str(k): decode(v, where) for k, v in json_object(data, where).items()}
