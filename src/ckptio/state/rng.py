"""Random number generator streams: Python, NumPy, torch CPU and every accelerator device, per rank.

The state is laid out as NeMo AutoModel's ``StatefulRNG`` lays it out (``random_rng_state``, ``np_keys``,
``torch_rng_state``...), so an RNG saved by either loads in the other; the layout of earlier ckptio
versions (``python``/``numpy``/``torch``/``cuda``) still loads.
"""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for users; its stream is then simply not captured
    np = None  # type: ignore[assignment]

__all__ = ["RNGState"]


class RNGState:
    """Captures and restores this process's RNG streams.

    Everything is stored as tensors and plain numbers so that it loads with ``weights_only=True``.
    Each rank has its own streams; the manager stores them per rank (``rng/rng_global_rank_R.pt``).
    """

    def state_dict(self) -> dict[str, Any]:
        """The streams, in AutoModel's layout."""
        sd: dict[str, Any] = {"random_rng_state": random.getstate(), "torch_rng_state": torch.get_rng_state(),
                              "cuda_rng_state": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
        if np is not None:
            name, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)  # type: ignore[misc]
            keys = np.asarray(keys)
            sd.update(np_bit_generator=name, np_keys=torch.from_numpy(keys.copy()), np_position=int(pos),
                      np_has_gauss=int(has_gauss), np_cached_gaussian=float(gauss))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the streams from either layout; a state of neither is refused naming what it lacks."""
        if isinstance(sd, dict) and "random_rng_state" in sd and isinstance(sd.get("torch_rng_state"), torch.Tensor):
            self._load(sd["random_rng_state"], sd["torch_rng_state"], sd.get("cuda_rng_state") or [],
                       (sd["np_bit_generator"], sd["np_keys"], sd["np_position"], sd["np_has_gauss"],
                        sd["np_cached_gaussian"]) if "np_keys" in sd else None)
            return
        if not isinstance(sd, dict) or not isinstance(sd.get("python"), dict) \
                or not isinstance(sd.get("torch"), torch.Tensor) \
                or not {"version", "state", "gauss"} <= set(sd["python"]):
            raise ValueError("an RNG state needs 'random_rng_state' and a 'torch_rng_state' tensor (or, as earlier "
                             "ckptio versions saved it, a 'python' entry and a 'torch' tensor)")
        py, st = sd["python"], sd.get("numpy")
        numpy_state = None if st is None else (st["bit_generator"], st["key"], st["pos"], st["has_gauss"], st["gauss"])
        self._load((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]), sd["torch"],
                   sd.get("cuda") or [], numpy_state)

    @staticmethod
    def _load(python: Any, torch_state: torch.Tensor, cuda: list[torch.Tensor], numpy_state: Any) -> None:
        version, internal, gauss = python
        random.setstate((int(version), tuple(int(x) for x in internal), gauss))
        torch.set_rng_state(torch_state)
        if np is not None and numpy_state is not None:
            name, keys, pos, has_gauss, cached = numpy_state
            keys = keys.numpy() if isinstance(keys, torch.Tensor) else np.asarray(keys)
            np.random.set_state((name, keys.astype("uint32"), int(pos), int(has_gauss), float(cached)))
        if cuda and torch.cuda.is_available():
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:  # a different GPU count per process: restore the current device's stream only
                torch.cuda.set_rng_state(cuda[min(torch.cuda.current_device(), len(cuda) - 1)])
