"""``fetch_plan``'s fetch request and response, encoded and decoded by hand: the same bytes and the same
fields as aiokafka's generic ``Struct`` code, whatever the topics, partitions, offsets, aborted
transactions and null fields (hypothesis); other versions built by aiokafka."""

from __future__ import annotations

import io

import pytest
from aiokafka.protocol.fetch import FetchRequest, FetchRequest_v10, FetchRequest_v11, FetchResponse_v11
from hypothesis import given, settings
from hypothesis import strategies as st

from stream_app.worker.fetch_plan import FastFetchRequest, _FetchResponseV11

V11 = {FetchRequest.API_KEY: (0, 11)}

names = st.text(alphabet=st.characters(min_codepoint=0x2D, max_codepoint=0x7A) | st.sampled_from("é€"),
                min_size=1, max_size=40)
int32 = st.integers(-(2**31), 2**31 - 1)
int64 = st.integers(-(2**63), 2**63 - 1)
requested = st.lists(st.tuples(names, st.lists(st.tuples(int32, int64, int32), max_size=12)), max_size=5)


@settings(max_examples=200, deadline=None)
@given(requested, int32, int32, int32, st.sampled_from([0, 1]), st.sampled_from(["", "rack-a", "é"]))
def test_a_request_is_encoded_to_aiokafkas_bytes(topics: list, max_wait: int, min_bytes: int, max_bytes: int,
                                                 isolation: int, rack: str) -> None:
    theirs = FetchRequest(max_wait, min_bytes, max_bytes, isolation, topics, rack_id=rack).prepare(V11)
    ours = FastFetchRequest(max_wait, min_bytes, max_bytes, isolation, topics, rack_id=rack).prepare(V11)
    assert type(theirs) is FetchRequest_v11 and isinstance(ours, FetchRequest_v11)
    assert ours.encode() == theirs.encode()
    assert ours.build_request_header(7, "c").encode() == theirs.build_request_header(7, "c").encode()
    assert ours.RESPONSE_TYPE is _FetchResponseV11


def test_a_broker_without_version_11_gets_aiokafkas_request() -> None:
    topics = [("t", [(0, 42, 1024)])]
    ours = FastFetchRequest(100, 1, 1 << 20, 0, topics).prepare({FetchRequest.API_KEY: (0, 10)})
    assert type(ours) is FetchRequest_v10
    assert ours.encode() == FetchRequest(100, 1, 1 << 20, 0, topics).prepare({FetchRequest.API_KEY: (0, 10)}).encode()


partition = st.tuples(int32, st.integers(-1, 100), int64, int64, int64,
                      st.none() | st.lists(st.tuples(int64, int64), max_size=3), int32,
                      st.none() | st.binary(max_size=300))
responses = st.tuples(int32, st.integers(-1, 100), int32,
                      st.lists(st.tuples(names, st.lists(partition, max_size=10)), max_size=4))


@settings(max_examples=200, deadline=None)
@given(responses)
def test_a_response_is_decoded_to_aiokafkas_fields(fields: tuple) -> None:
    raw = FetchResponse_v11(*fields).encode()
    theirs = FetchResponse_v11.decode(io.BytesIO(raw))
    ours = _FetchResponseV11.decode(io.BytesIO(raw))
    assert ours.topics == theirs.topics
    assert (ours.throttle_time_ms, ours.error_code, ours.session_id) == (
        theirs.throttle_time_ms, theirs.error_code, theirs.session_id)
    assert ours.API_VERSION == 11


def test_a_response_is_decoded_from_where_its_header_ended() -> None:
    raw = FetchResponse_v11(0, 0, 9, [("t", [(3, 0, 10, 10, 0, None, -1, b"records")])]).encode()
    stream = io.BytesIO(b"head" + raw)
    stream.read(4)  # the response header, read by the connection first
    assert _FetchResponseV11.decode(stream).topics == [("t", [(3, 0, 10, 10, 0, None, -1, b"records")])]


def test_a_truncated_response_is_a_value_error_as_aiokafkas() -> None:
    raw = FetchResponse_v11(0, 0, 9, [("t", [(3, 0, 10, 10, 0, None, -1, b"records")])]).encode()
    for cut in (3, 12, len(raw) - 2):
        with pytest.raises(ValueError, match="Buffer underrun"):
            _FetchResponseV11.decode(io.BytesIO(raw[:cut]))


def test_a_negative_count_other_than_minus_one_is_an_empty_array_as_aiokafkas() -> None:
    import struct

    head = struct.pack(">ihi", 0, 0, 9)
    for raw in (head + struct.pack(">i", -2),  # topics
                head + struct.pack(">i", 1) + struct.pack(">h", 1) + b"t" + struct.pack(">i", -5)):  # partitions
        assert _FetchResponseV11.decode(io.BytesIO(raw)).topics == FetchResponse_v11.decode(io.BytesIO(raw)).topics
    assert _FetchResponseV11.decode(io.BytesIO(head + struct.pack(">i", -1))).topics is None
