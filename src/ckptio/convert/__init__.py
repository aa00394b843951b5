"""Conversions: between checkpoint formats (:mod:`.formats`) and between model namings (:mod:`.naming`)."""

from .formats import FORMATS, convert, detect, open_any
from .naming import CONVERTERS, Converter, Rule, check_invertible, get_converter, register

__all__ = ["FORMATS", "convert", "detect", "open_any", "CONVERTERS", "Converter", "Rule", "register",
           "get_converter", "check_invertible"]
