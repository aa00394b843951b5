"""Conversions: between checkpoint formats (:mod:`.formats`) and between model namings (the converters of
:mod:`ckptio.formats.naming`, which the Megatron format applies too, re-exported here)."""

from ..formats.naming import CONVERTERS, Converter, Rule, check_invertible, get_converter, register
from .formats import FORMATS, convert, detect, open_any

__all__ = ["FORMATS", "convert", "detect", "open_any", "CONVERTERS", "Converter", "Rule", "register",
           "get_converter", "check_invertible"]
