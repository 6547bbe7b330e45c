"""Both nginx configurations bound what one client can hold, since behind nginx the API cannot.

Every connection a replica sees comes from nginx, a trusted proxy the API
does not bound as one peer (app/api/http_protocol.py). So each
configuration, devtools/nginx.py's (make cluster, make soak) and
compose/nginx.conf, must carry the bounds per client itself: the number of
requests one address has in progress, and deadlines on a head and a body
that stop coming. (`make soak` runs nginx on the generated one; `make test`
does not need nginx.)
"""

from __future__ import annotations

import re
from pathlib import Path

from devtools import nginx

ROOT = Path(__file__).resolve().parents[2]


def bounds_of(conf: str) -> dict[str, str]:
    found = dict(re.findall(r"^\s*(limit_conn_zone|limit_conn|limit_conn_status|client_header_timeout|"
                            r"client_body_timeout)\s+([^;]+);", conf, re.MULTILINE))
    return found


def test_both_configurations_bound_each_client_address():
    generated = nginx.config(Path("/nonexistent"), 8000, [8001, 8002])
    compose = (ROOT / "compose" / "nginx.conf").read_text()
    for conf in (generated, compose):
        bounds = bounds_of(conf)
        assert bounds["limit_conn_zone"].startswith("$binary_remote_addr zone=per_client:")
        assert bounds["limit_conn"] == "per_client 100"
        assert bounds["limit_conn_status"] == "429"
        assert bounds["client_header_timeout"] == bounds["client_body_timeout"] == "10s"

