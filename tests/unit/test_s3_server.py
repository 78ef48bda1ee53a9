"""What the S3 test server (SeaweedFS 4.48, tests/s3server.py) does with the requests a commit protocol
over S3 relies on, checked against the real server through boto3 (no mocks).

Observed with SeaweedFS 4.48, each asserted below:

* ``PutObject`` with ``If-None-Match: *`` writes a new key and refuses an existing one (412
  ``PreconditionFailed``); of concurrent ones for one new key exactly one succeeds;
* ``PutObject`` with ``If-Match: <ETag>`` is supported: it replaces the object when the ETag is the
  current one (quoted or not) and is refused with 412 ``PreconditionFailed`` for a stale ETag, and for a
  missing key; ``If-Match: *`` replaces an existing object and is refused for a missing key; of concurrent
  ones carrying the same current ETag exactly one succeeds;
* ``DeleteObject`` with ``If-Match`` is supported: a stale ETag is refused with 412 and the object stays;
  the current ETag deletes it; on a missing key it is refused with 412 as well (AWS answers 404 there);
* ``CompleteMultipartUpload`` with ``If-None-Match: *`` over an existing key is refused with 412;
* ``GetObject`` with ``If-Match`` on a stale ETag is refused with 412, ranged or not;
* conditional writes of one key are serialized: a writer that finds the key busy retries after ~1 s before
  its answer (so a refused writer of a contended commit may wait ~1 s per writer ahead of it); plain puts
  do not wait.
"""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("boto3")
from botocore.exceptions import ClientError  # noqa: E402

MiB = 1 << 20


@pytest.fixture(scope="module")
def s3(s3_server):
    return s3_server.client(max_pool_connections=32)  # the races' threads each hold a connection


def _refused(call, **kw) -> ClientError:
    """The error of a call that must be refused with 412 PreconditionFailed."""
    with pytest.raises(ClientError) as info:
        call(**kw)
    e = info.value
    assert e.response["Error"]["Code"] == "PreconditionFailed", e.response
    assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 412
    return e


def _body(s3, bucket: str, key: str) -> bytes:
    return s3.get_object(Bucket=bucket, Key=key)["Body"].read()


def test_server_start_is_recorded_and_clients_get_its_environment(s3_server):
    assert s3_server.endpoint.startswith("http://127.0.0.1:")
    assert 0 < s3_server.start_seconds < 60
    import os

    for k, v in s3_server.env.items():
        assert os.environ[k] == v  # spawned processes inherit them
    assert s3_server.proc.poll() is None


def test_put_get_round_trip(s3, s3_bucket):
    data = bytes(range(256)) * 1000
    put = s3.put_object(Bucket=s3_bucket, Key="dir/obj.bin", Body=data)
    got = s3.get_object(Bucket=s3_bucket, Key="dir/obj.bin")
    assert got["Body"].read() == data
    assert got["ContentLength"] == len(data)
    assert got["ETag"] == put["ETag"]
    with pytest.raises(ClientError) as info:
        s3.get_object(Bucket=s3_bucket, Key="dir/missing")
    assert info.value.response["Error"]["Code"] == "NoSuchKey"


def test_ranged_get(s3, s3_bucket):
    data = bytes(i % 251 for i in range(3 * MiB))
    s3.put_object(Bucket=s3_bucket, Key="r", Body=data)
    for a, b in [(0, 0), (10, 19), (MiB - 3, MiB + 5), (len(data) - 7, len(data) - 1)]:
        r = s3.get_object(Bucket=s3_bucket, Key="r", Range=f"bytes={a}-{b}")
        assert r["ResponseMetadata"]["HTTPStatusCode"] == 206
        assert r["ContentRange"] == f"bytes {a}-{b}/{len(data)}"
        assert r["Body"].read() == data[a:b + 1]
    # an end past the object is cut at its end
    r = s3.get_object(Bucket=s3_bucket, Key="r", Range=f"bytes={len(data) - 4}-{len(data) + 100}")
    assert r["Body"].read() == data[-4:]


def test_multipart_upload_of_three_parts(s3, s3_bucket):
    parts = [bytes([i]) * (5 * MiB) for i in (1, 2)] + [b"tail" * 1000]  # all but the last >= 5 MiB
    up = s3.create_multipart_upload(Bucket=s3_bucket, Key="mp")["UploadId"]
    done = []
    for n, p in enumerate(parts, 1):
        done.append({"PartNumber": n, "ETag": s3.upload_part(Bucket=s3_bucket, Key="mp", UploadId=up,
                                                              PartNumber=n, Body=p)["ETag"]})
    with pytest.raises(ClientError):  # nothing visible before completion
        s3.head_object(Bucket=s3_bucket, Key="mp")
    r = s3.complete_multipart_upload(Bucket=s3_bucket, Key="mp", UploadId=up, MultipartUpload={"Parts": done})
    assert r["ETag"].endswith('-3"')  # the multipart ETag: md5 of the parts' md5s, "-<parts>"
    whole = b"".join(parts)
    assert _body(s3, s3_bucket, "mp") == whole
    a = 5 * MiB - 2  # a range across the first two parts
    assert s3.get_object(Bucket=s3_bucket, Key="mp", Range=f"bytes={a}-{a + 3}")["Body"].read() == whole[a:a + 4]


def test_multipart_complete_with_if_none_match_refused_over_an_existing_key(s3, s3_bucket):
    s3.put_object(Bucket=s3_bucket, Key="k", Body=b"first")
    up = s3.create_multipart_upload(Bucket=s3_bucket, Key="k")["UploadId"]
    etag = s3.upload_part(Bucket=s3_bucket, Key="k", UploadId=up, PartNumber=1, Body=b"x" * MiB)["ETag"]
    _refused(s3.complete_multipart_upload, Bucket=s3_bucket, Key="k", UploadId=up, IfNoneMatch="*",
             MultipartUpload={"Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert _body(s3, s3_bucket, "k") == b"first"
    s3.abort_multipart_upload(Bucket=s3_bucket, Key="k", UploadId=up)


def test_put_if_none_match_creates_only(s3, s3_bucket):
    s3.put_object(Bucket=s3_bucket, Key="once", Body=b"first", IfNoneMatch="*")  # a new key: written
    assert _body(s3, s3_bucket, "once") == b"first"
    _refused(s3.put_object, Bucket=s3_bucket, Key="once", Body=b"second", IfNoneMatch="*")
    assert _body(s3, s3_bucket, "once") == b"first"


def test_put_if_match_replaces_only_the_current_version(s3, s3_bucket):
    e1 = s3.put_object(Bucket=s3_bucket, Key="ptr", Body=b"v1")["ETag"]
    assert s3.head_object(Bucket=s3_bucket, Key="ptr")["ETag"] == e1
    e2 = s3.put_object(Bucket=s3_bucket, Key="ptr", Body=b"v2", IfMatch=e1)["ETag"]  # current ETag: replaced
    assert e2 != e1 and _body(s3, s3_bucket, "ptr") == b"v2"
    _refused(s3.put_object, Bucket=s3_bucket, Key="ptr", Body=b"v3", IfMatch=e1)  # stale ETag: refused
    assert _body(s3, s3_bucket, "ptr") == b"v2"
    # the ETag without its quotes is matched too
    e4 = s3.put_object(Bucket=s3_bucket, Key="ptr", Body=b"v4", IfMatch=e2.strip('"'))["ETag"]
    assert _body(s3, s3_bucket, "ptr") == b"v4"
    # If-Match on a key that does not exist: refused with 412 (not 404)
    _refused(s3.put_object, Bucket=s3_bucket, Key="absent", Body=b"x", IfMatch=e4)
    # If-Match: * replaces any existing object, and is refused where there is none
    s3.put_object(Bucket=s3_bucket, Key="ptr", Body=b"v5", IfMatch="*")
    assert _body(s3, s3_bucket, "ptr") == b"v5"
    _refused(s3.put_object, Bucket=s3_bucket, Key="absent", Body=b"x", IfMatch="*")
    with pytest.raises(ClientError):
        s3.head_object(Bucket=s3_bucket, Key="absent")


def test_delete_if_match(s3, s3_bucket):
    e1 = s3.put_object(Bucket=s3_bucket, Key="d", Body=b"v1")["ETag"]
    e2 = s3.put_object(Bucket=s3_bucket, Key="d", Body=b"v2")["ETag"]
    _refused(s3.delete_object, Bucket=s3_bucket, Key="d", IfMatch=e1)  # stale: refused, the object stays
    assert _body(s3, s3_bucket, "d") == b"v2"
    r = s3.delete_object(Bucket=s3_bucket, Key="d", IfMatch=e2)  # current: deleted
    assert r["ResponseMetadata"]["HTTPStatusCode"] == 204
    with pytest.raises(ClientError) as info:
        s3.head_object(Bucket=s3_bucket, Key="d")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    # on a missing key: 412 (AWS S3 answers 404 NoSuchKey); a plain delete of a missing key succeeds (204)
    _refused(s3.delete_object, Bucket=s3_bucket, Key="d", IfMatch=e2)
    assert s3.delete_object(Bucket=s3_bucket, Key="d")["ResponseMetadata"]["HTTPStatusCode"] == 204


def test_get_if_match_refuses_a_replaced_object(s3, s3_bucket):
    e1 = s3.put_object(Bucket=s3_bucket, Key="g", Body=b"0123456789")["ETag"]
    assert s3.get_object(Bucket=s3_bucket, Key="g", IfMatch=e1, Range="bytes=2-4")["Body"].read() == b"234"
    s3.put_object(Bucket=s3_bucket, Key="g", Body=b"abcdefghij")
    _refused(s3.get_object, Bucket=s3_bucket, Key="g", IfMatch=e1)
    _refused(s3.get_object, Bucket=s3_bucket, Key="g", IfMatch=e1, Range="bytes=2-4")


def test_list_objects_v2_prefix_and_pagination(s3, s3_bucket):
    keys = [f"ck/a/{i:02d}" for i in range(5)] + ["ck/b/0", "ck/ab", "other/0"]
    for k in keys:
        s3.put_object(Bucket=s3_bucket, Key=k, Body=k.encode())
    seen, pages, token = [], 0, None
    while True:
        kw = {"ContinuationToken": token} if token else {}
        r = s3.list_objects_v2(Bucket=s3_bucket, Prefix="ck/a/", MaxKeys=2, **kw)
        pages += 1
        assert r["KeyCount"] == len(r.get("Contents", [])) <= 2
        seen += [o["Key"] for o in r.get("Contents", [])]
        if not r["IsTruncated"]:
            break
        token = r["NextContinuationToken"]
    assert seen == sorted(k for k in keys if k.startswith("ck/a/"))  # in key order, each once
    assert pages == 3
    # with a delimiter: one level, the deeper names as common prefixes
    r = s3.list_objects_v2(Bucket=s3_bucket, Prefix="ck/", Delimiter="/")
    assert [o["Key"] for o in r.get("Contents", [])] == ["ck/ab"]
    assert [p["Prefix"] for p in r["CommonPrefixes"]] == ["ck/a/", "ck/b/"]
    # boto3's paginator agrees
    pages_keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket=s3_bucket, Prefix="ck/", PaginationConfig={"PageSize": 2}) for o in page.get("Contents", [])]
    assert pages_keys == sorted(k for k in keys if k.startswith("ck/"))


def _race(s3, bucket: str, key: str, n: int, **condition) -> tuple[list[int], list[str]]:
    """``n`` threads put ``key`` at once (released together by a barrier), each with its own body;
    the indices of the writers that succeeded and the error codes of the others."""
    barrier = threading.Barrier(n)
    ok: list[int] = []
    codes: list[str] = []
    lock = threading.Lock()

    def put(i: int) -> None:
        body = f"writer {i} ".encode() * 100
        barrier.wait()
        try:
            s3.put_object(Bucket=bucket, Key=key, Body=body, **condition)
            with lock:
                ok.append(i)
        except ClientError as e:
            with lock:
                codes.append(e.response["Error"]["Code"])

    threads = [threading.Thread(target=put, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ok, codes


# Four writers: SeaweedFS serializes conditional writes of one key, and a writer that finds the key busy
# retries after ~1 s before it is refused, so a run takes 0-2 s (~9 s for the 20): under -m slow.
@pytest.mark.parametrize("writers", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_concurrent_if_none_match_puts_exactly_one_wins(s3, s3_bucket, writers):
    for run in range(20):
        key = f"commit-{run}"
        ok, codes = _race(s3, s3_bucket, key, writers, IfNoneMatch="*")
        assert len(ok) == 1, (run, ok, codes)
        assert codes == ["PreconditionFailed"] * (writers - 1), (run, codes)
        assert _body(s3, s3_bucket, key) == f"writer {ok[0]} ".encode() * 100  # the winner's object stays


def test_concurrent_if_match_puts_exactly_one_wins(s3, s3_bucket):
    for run in range(20):
        key = f"ptr-{run}"
        etag = s3.put_object(Bucket=s3_bucket, Key=key, Body=b"base")["ETag"]
        ok, codes = _race(s3, s3_bucket, key, 2, IfMatch=etag)
        assert len(ok) == 1 and codes == ["PreconditionFailed"], (run, ok, codes)
        assert _body(s3, s3_bucket, key) == f"writer {ok[0]} ".encode() * 100


def test_server_clock_is_this_machines(s3, s3_bucket):
    """Lease expiry is judged by the store's clock (its Date and Last-Modified): on loopback it is ours."""
    r = s3.put_object(Bucket=s3_bucket, Key="t", Body=b"t")
    date = r["ResponseMetadata"]["HTTPHeaders"]["date"]
    from email.utils import parsedate_to_datetime

    assert abs(parsedate_to_datetime(date).timestamp() - time.time()) < 5
    lm = s3.head_object(Bucket=s3_bucket, Key="t")["LastModified"]
    assert abs(lm.timestamp() - time.time()) < 5
