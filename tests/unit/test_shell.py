"""The HTTP shell both listeners read their requests through (governor.listeners.shell), with no
socket: h11 events in, a ClosingError out past a bound."""

from __future__ import annotations

from http import HTTPStatus

import h11
from hypothesis import given
from hypothesis import strategies as st

from governor.listeners.shell import MAX_HEAD_BYTES, MAX_HEADERS, Incoming, header


def request(target: bytes = b"/v1/models", *headers: tuple[bytes, bytes]) -> h11.Request:
    return h11.Request(method="POST", target=target, headers=[(b"host", b"x"), *headers])


def test_a_head_within_the_bounds_is_read_and_its_path_named_if_known() -> None:
    incoming = Incoming(100, {"/v1/models"})
    assert incoming.head(request(b"/v1/models/?x=1")) is None
    assert (incoming.request is not None, incoming.path) == (True, "/v1/models")
    incoming.done()
    assert (incoming.request, incoming.path, incoming.body) == (None, "other", bytearray())
    assert incoming.head(request(b"/secret")) is None
    assert incoming.path == "other"  # (a path it does not serve is not a metric's label)


def test_a_head_past_its_fields_or_bytes_is_431() -> None:
    many = [(b"x-%d" % i, b"v") for i in range(MAX_HEADERS)]  # with host: one too many
    huge = (b"x-pad", b"a" * MAX_HEAD_BYTES)
    for head in (request(b"/", *many), request(b"/", huge)):
        incoming = Incoming(100)
        refused = incoming.head(head)
        assert refused is not None
        assert refused.status == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE
        assert incoming.request is None
        assert incoming.too_large().status == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE


def test_a_body_its_length_says_is_too_large_is_413_before_it_is_read() -> None:
    incoming = Incoming(100)
    refused = incoming.head(request(b"/", (b"content-length", b"101")))
    assert refused is not None
    assert refused.status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE
    assert "100 bytes" in refused.message
    assert Incoming(100).head(request(b"/", (b"content-length", b"100"))) is None


@given(st.lists(st.binary(max_size=40), max_size=12), st.integers(0, 200))
def test_a_body_is_refused_exactly_when_it_grows_past_its_bound(
    pieces: list[bytes], bound: int
) -> None:
    incoming = Incoming(bound)
    assert incoming.head(request()) is None
    received = 0
    for piece in pieces:
        received += len(piece)
        refused = incoming.data(piece)
        if received > bound:
            assert refused is not None
            assert refused.status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE
            break
        assert refused is None
        assert bytes(incoming.body) == b"".join(pieces)[:received]


def test_a_header_is_found_by_its_lower_case_name() -> None:
    head = request(b"/", (b"Authorization", b"Bearer k"), (b"x-a", b"1"), (b"x-a", b"2"))
    assert header(head, b"authorization") == "Bearer k"
    assert header(head, b"x-a") == "1"
    assert header(head, b"x-b") is None
