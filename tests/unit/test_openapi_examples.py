"""The OpenAPI document's 201 samples are real final answers, not a schema's first enum value.

ReDoc and Swagger UI show a response's `examples` when it has them, and else
make a sample up from the schema, whose first status is `processing`: a
status a 201 never carries. Built in-process: no server, no database.
"""

from __future__ import annotations

from app.config import Settings
from app.main import create_app
from app.payments.models import PaymentView


def test_the_201_examples_show_each_final_status_as_the_api_writes_it():
    document = create_app(Settings(database_url="postgresql://u:p@127.0.0.1:1/x")).openapi()
    created = document["paths"]["/v1/payments"]["post"]["responses"]["201"]["content"]["application/json"]

    examples = created["examples"]
    assert set(examples) == {"succeeded", "declined", "failed"}
    for status, example in examples.items():
        body = example["value"]
        assert body["status"] == status
        assert PaymentView.model_validate(body).model_dump(mode="json") == body  # a body the API could send
    assert examples["succeeded"]["value"]["failure"] is None
    assert examples["declined"]["value"]["failure"]["stage"] == "charge"
    assert examples["failed"]["value"]["failure"]["stage"] == "payout"
    assert "processing" not in str(created)
