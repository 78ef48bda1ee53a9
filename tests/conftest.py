"""Fixtures shared by every test directory.

``s3_server``: one SeaweedFS S3 server (tests/s3server.py) for the whole pytest session, started when a test
first asks for it; while it runs, ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY`` and
``AWS_REGION`` in ``os.environ`` point at it, so processes the tests spawn (ranks of a multi-process test)
reach it the standard way. The test is skipped, saying why, only when the server cannot start.

``s3_bucket``: a fresh, uniquely named, empty bucket of that server for each test (its name).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from tests import s3server


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[s3server.S3Server]:
    try:
        server = s3server.start(tmp_path_factory.mktemp("s3server"))
    except s3server.ServerError as e:
        pytest.skip(f"the SeaweedFS S3 test server cannot start: {e}")
    try:
        with pytest.MonkeyPatch.context() as mp:  # the AWS variables name the server; as they were after
            for k, v in server.env.items():
                mp.setenv(k, v)
            yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: s3server.S3Server, request: pytest.FixtureRequest) -> str:
    """A new bucket named after the test (lower case, 63 characters at most, unique)."""
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"tdb-{stem}-{uuid.uuid4().hex[:12]}"
    s3_server.client().create_bucket(Bucket=name)
    return name
