"""How bytes are laid out: one module per on-disk format.

Each format module offers a symmetric ``save``/``load`` pair plus ``read_index``, which describes the
tensors in a saved folder (key -> global shape and dtype) without loading them.
"""

from .common import TensorInfo

__all__ = ["TensorInfo"]
