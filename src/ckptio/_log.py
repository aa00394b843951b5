"""The ``ckptio`` logger: INFO messages from rank 0 reach the terminal unless the user configures logging."""

from __future__ import annotations

import logging
import sys

_configured = False


def get_logger() -> logging.Logger:
    global _configured
    logger = logging.getLogger("ckptio")
    if not _configured:
        _configured = True
        if not logger.handlers and not logging.getLogger().handlers:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("[ckptio] %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    return logger
