"""bench/profile.py's split of py-spy's samples by layer: each sample goes to the layer whose code it was in."""

from bench.profile import layer_of, summarise


def test_a_sample_belongs_to_the_innermost_layer_on_its_stack_not_to_the_standard_library_it_ended_in():
    assert layer_of(["asyncio", "uvicorn", "fastapi", "app.api", "pydantic", "json"]) == "validation (pydantic)"
    assert layer_of(["asyncio", "app.machine", "sqlalchemy", "asyncpg"]) == "asyncpg"
    assert layer_of(["asyncio", "app.machine", "sqlalchemy", "re"]) == "SQLAlchemy"
    assert layer_of(["threading", "hashlib"]) == "other"


def test_h11_under_an_http_client_is_that_clients_and_h11_alone_is_the_server():
    assert layer_of(["asyncio", "app.rails", "httpx", "httpcore", "h11"]) == "the rail clients (aiohttp)"
    assert layer_of(["asyncio", "uvicorn", "h11"]) == "HTTP server and framework"


def test_an_http_client_under_the_outbox_is_the_webhook_dispatchers_not_a_rail_clients():
    assert layer_of(["asyncio", "app.rails", "aiohttp"]) == "the rail clients (aiohttp)"
    assert layer_of(["asyncio", "app.workers", "app.outbox", "aiohttp"]) == "the outbox"


def test_the_summary_gives_each_layer_its_share_of_all_samples():
    raw = "\n".join([
        "run (uvicorn/server.py:1);handle (fastapi/routing.py:2);validate (pydantic/main.py:3) 30",
        "run (uvicorn/server.py:1);execute (sqlalchemy/engine.py:4);fetch (asyncpg/connection.py:5) 50",
        "run (uvicorn/server.py:1);send (httpx/_client.py:6);write (h11/_connection.py:7) 20",
    ])
    layers = dict(summarise(raw)["self_by_layer"])
    assert layers == {"asyncpg": 50.0, "validation (pydantic)": 30.0, "the rail clients (aiohttp)": 20.0}
