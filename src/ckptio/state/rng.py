"""Random number generator streams: Python, NumPy, torch CPU and every accelerator device, per rank."""

from __future__ import annotations

import random
from typing import Any

import torch

try:
    import numpy as np
except ImportError:  # numpy is optional for users; its stream is then simply not captured
    np = None  # type: ignore[assignment]


class RNGState:
    """Captures and restores this process's RNG streams.

    Everything is stored as tensors and plain numbers so that it loads with ``weights_only=True``.
    Each rank has its own streams; the manager stores them per rank when they differ.
    """

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        sd: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        if np is not None:
            st = np.random.get_state(legacy=False)
            sd["numpy"] = {
                "bit_generator": st["bit_generator"],
                "key": torch.from_numpy(st["state"]["key"].astype("int64")),
                "pos": int(st["state"]["pos"]),
                "has_gauss": int(st["has_gauss"]),
                "gauss": float(st["gauss"]),
            }
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state_all()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if not isinstance(sd, dict) or not isinstance(sd.get("python"), dict) \
                or not isinstance(sd.get("torch"), torch.Tensor) \
                or not {"version", "state", "gauss"} <= set(sd["python"]):
            raise ValueError("an RNG state needs a 'python' entry (version, state, gauss) and a 'torch' tensor")
        py = sd["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        torch.set_rng_state(sd["torch"])
        if np is not None and "numpy" in sd:
            st = sd["numpy"]
            np.random.set_state({
                "bit_generator": st["bit_generator"],
                "state": {"key": st["key"].numpy().astype("uint32"), "pos": st["pos"]},
                "has_gauss": st["has_gauss"],
                "gauss": st["gauss"],
            })
        if "cuda" in sd and torch.cuda.is_available():
            states = sd["cuda"]
            if len(states) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(states)
            else:  # a different GPU count per process: restore the current device's stream only
                torch.cuda.set_rng_state(states[min(torch.cuda.current_device(), len(states) - 1)])
