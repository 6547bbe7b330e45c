"""Both nginx configurations tell the API what the client asked for: the scheme and the host.

The console's cookie is Secure when a trusted proxy says the client came over
TLS (X-Forwarded-Proto), and a console POST's Origin is compared with the
Host the client sent, port included (app/console/auth.py::same_origin). A
proxy that sends neither makes every cookie plain and, for browsers without
Sec-Fetch-Site, every console form refused; one that forwards the client's
own X-Forwarded-Proto lets a client claim TLS. Through a running nginx:
tests/console/test_console_sessions.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools import nginx

ROOT = Path(__file__).resolve().parents[2]


def configurations(tmp_path: Path) -> dict[str, str]:
    return {"compose/nginx.conf": (ROOT / "compose" / "nginx.conf").read_text(),
            "devtools/nginx.py": nginx.config(tmp_path, 8080, [8001, 8002])}


@pytest.mark.parametrize("name", ["compose/nginx.conf", "devtools/nginx.py"])
def test_each_nginx_configuration_sends_the_scheme_and_the_host_with_its_port(tmp_path, name):
    text = configurations(tmp_path)[name]
    assert "proxy_set_header X-Forwarded-Proto $scheme;" in text
    assert "proxy_set_header Host $http_host;" in text
    assert "proxy_set_header Host $host;" not in text, "$host drops the port an Origin names"
