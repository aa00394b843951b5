import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from hypothesis import settings  # noqa: E402

# "ci": what the suite runs; "fuzz": the long run of benchmarks/fuzz_readers.py
settings.register_profile("ci", max_examples=120, deadline=None)
settings.register_profile("fuzz", max_examples=int(os.environ.get("CKPTIO_FUZZ_EXAMPLES", "3000")), deadline=None)
settings.load_profile(os.environ.get("CKPTIO_HYPOTHESIS_PROFILE", "ci"))
