"""Schemathesis against the gateway's OpenAPI document: requests generated from the schema (a few
per operation, so it runs in seconds) never get a 5xx. The app runs in-process on a prefix of its own
with no workers: turns it accepts just wait, and every key goes afterwards."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.conftest import drop_prefix
from threadline.workers.gateway.app import create_app
from threadline.workers.protocol.keys import Keys
from threadline.workers.settings import Settings, shards_from_env
from threadline.workers.storage.api_keys import create_key
from threadline.workers.storage.connect import sync_client

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(redis_url: str) -> Iterator[tuple[Any, str]]:
    prefix = f"tlg{uuid.uuid4().hex[:8]}"
    shards = shards_from_env()  # the session's layout (a cluster's needs shards)
    config = dataclasses.replace(Settings.from_env({}), prefix=prefix, redis_url=redis_url, shards=shards)
    app = create_app(config, redis_url)
    r = sync_client(redis_url)
    key = create_key(r, Keys(prefix, shards), "tenant-s", admin=True)
    yield app, key
    drop_prefix(r, prefix)
    r.close()


def test_no_request_the_schema_allows_gets_a_server_error(gateway: tuple[Any, str]) -> None:
    app, key = gateway
    # every operation, driven by hypothesis directly (schemathesis' pytest plugin predates this pytest)
    operations = [result.ok() for result in schemathesis.openapi.from_asgi("/openapi.json", app).get_all_operations()]
    assert len(operations) >= 12
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_server_error(case: Any) -> None:
            response = case.call(headers={"Authorization": f"Bearer {key}"})
            assert response.status_code < 500, (case.method, case.formatted_path, response.text)

        no_server_error()
