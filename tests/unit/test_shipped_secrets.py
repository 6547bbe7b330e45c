"""No secret ships with the checkout, and a weak one refuses start-up.

docker-compose.yml requires every secret from its environment (nothing
fixed in the file) and publishes only nginx; neither nginx configuration
logs a raw Idempotency-Key (their hash, which the soak reads back); a
`whsec_` secret whose key is shorter than 24 bytes is refused.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from app.config import Settings
from devtools import nginx, soak

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SECRET_NAMES = re.compile(r"SECRET|PASSWORD|TOKEN|KEY", re.IGNORECASE)
REQUIRED = re.compile(r"^\$\{[A-Z_]+:\?[^}]+\}$")


def environments() -> list[tuple[str, str, str]]:
    return [(service, name, str(value)) for service, spec in COMPOSE["services"].items()
            for name, value in (spec.get("environment") or {}).items()]


def test_compose_fixes_no_secret_and_requires_each_from_its_environment():
    secrets = [(s, n, v) for s, n, v in environments() if SECRET_NAMES.search(n)]
    assert {n for _, n, _ in secrets} >= {"POSTGRES_PASSWORD", "RAIL_NOTIFICATION_SECRET", "FAKE_RAIL_NOTIFY_SECRET",
                                          "WEBHOOK_SECRETS_KEY"}
    for service, name, value in secrets:
        assert REQUIRED.match(value), f"{service}'s {name} is fixed in the file, not required"
    for service, name, value in environments():
        if name.endswith("DATABASE_URL"):
            assert "${POSTGRES_PASSWORD:?" in value, f"{service}'s {name} holds a fixed password"
    assert "whsec_" not in (ROOT / "docker-compose.yml").read_text().replace("RAIL_NOTIFICATION_SECRET=whsec_", "")


def test_compose_publishes_only_nginx():
    published = {service for service, spec in COMPOSE["services"].items() if spec.get("ports")}
    assert published == {"nginx"}


def test_no_nginx_configuration_logs_the_raw_idempotency_key(tmp_path):
    for text in ((ROOT / "compose" / "nginx.conf").read_text(), nginx.config(tmp_path, 8080, [8001, 8002])):
        assert "$http_idempotency_key" not in text
        assert "js_set $idempotency_key_hash key_hash.digest;" in text
        assert '"$idempotency_key_hash"' in text


def test_the_soak_finds_a_stranded_payment_by_its_hashed_key(tmp_path):
    log = tmp_path / "access.log"
    hashed = soak.key_hash("key-1")
    log.write_text(f'100.5 0.5 201 "127.0.0.1:9001" "201" POST "{hashed}"\n'
                   f'100.6 0.1 201 "127.0.0.1:9002" "201" POST "-"\n')
    events = [{"action": "kill_api", "at": 100.2, "addr": "127.0.0.1:9001"}]
    figures = soak.stranded(log, events, finished={"key-1": 101.2}, parked=set())
    assert figures["kill_api"]["stranded_payments"] == 1 and figures["kill_api"]["median_seconds"] == 1.0
    assert "key-1" not in log.read_text()


@pytest.mark.parametrize("key_bytes", [3, 16, 23])
def test_a_whsec_secret_shorter_than_24_bytes_refuses_start_up(key_bytes):
    secret = "whsec_" + base64.b64encode(b"k" * key_bytes).decode()
    with pytest.raises(ValidationError, match=f"its key is {key_bytes} bytes, at least 24"):
        Settings(database_url="postgresql://u@h/d", rail_notification_secret=secret)


def test_a_whsec_secret_of_24_bytes_or_more_is_taken():
    for n in (24, 32, 64):
        secret = "whsec_" + base64.b64encode(b"k" * n).decode()
        assert Settings(database_url="postgresql://u@h/d", rail_notification_secret=secret).rail_notification_secret
