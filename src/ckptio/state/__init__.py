"""What is saved: wrappers that turn live training objects into state dicts and back."""

from .model import ModelState
from .optimizer import OptimizerState
from .rng import RNGState

__all__ = ["ModelState", "OptimizerState", "RNGState"]
