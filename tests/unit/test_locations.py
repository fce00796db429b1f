"""A location without a scheme means grpc://host:port, for one server and for shards."""

from __future__ import annotations

import pytest

import flightq


def test_a_location_without_a_scheme_means_grpc():
    c = flightq.Client("127.0.0.1:8815")  # connects lazily: no server needed
    try:
        assert c.location == "grpc://127.0.0.1:8815"
    finally:
        c.close()


def test_a_sharded_location_without_a_scheme_is_tried_as_grpc():
    # Nothing listens there: the error names the location as grpc://, not a bad scheme.
    with pytest.raises(flightq.UnavailableError, match=r"grpc://127\.0\.0\.1:1\b"):
        flightq.connect_sharded(["127.0.0.1:1"], timeout=2.0)
