"""What ``requests`` reads from the environment for a request, read once per host of a session instead.

The GCS and Azure clients send through ``requests``, which, for every request, looks the proxies up in the environment
(``HTTPS_PROXY``, ``NO_PROXY``... and whether the host is exempt) and a CA bundle (``REQUESTS_CA_BUNDLE``,
``CURL_CA_BUNDLE``): it walks ``os.environ`` several times, ~1.5 ms of CPU here, more than uploading a MB costs, paid
by every listing, lookup and small write of a save and on every rank. :func:`read_once` makes a session look them
up the first time it talks to a host and use the same settings for that host from then on: the environment's
proxies and CA bundle are honoured as ``requests`` honours them, as they are when the client first reaches the host.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

__all__ = ["read_once"]


def read_once(session: Any) -> Any:
    """Make ``session`` (a ``requests.Session``) read the environment's settings once per host; returns it."""
    if getattr(session, "_ckptio_read_once", False):
        return session
    from requests.sessions import merge_setting
    from requests.utils import get_environ_proxies

    own = type(session).merge_environment_settings
    found: dict[tuple[str, str, Any], tuple[dict[str, str], str | None]] = {}

    def merge(url: str, proxies: Any, stream: Any, verify: Any, cert: Any) -> dict[str, Any]:
        if not session.trust_env:
            return own(session, url, proxies, stream, verify, cert)
        parts = urlsplit(url)
        no_proxy = proxies.get("no_proxy") if proxies is not None else None
        key = (parts.scheme, parts.netloc, no_proxy)
        settings = found.get(key)
        if settings is None:  # two threads may both look the first time: the same answer, either kept
            settings = found[key] = (get_environ_proxies(url, no_proxy=no_proxy),
                                     os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE"))
        env_proxies, bundle = settings
        if proxies is not None:
            for scheme, proxy in env_proxies.items():
                proxies.setdefault(scheme, proxy)
        if (verify is True or verify is None) and bundle:
            verify = bundle
        return {"proxies": merge_setting(proxies, session.proxies), "stream": merge_setting(stream, session.stream),
                "verify": merge_setting(verify, session.verify), "cert": merge_setting(cert, session.cert)}

    session.merge_environment_settings = merge
    session._ckptio_read_once = True
    return session
