"""A location without a scheme is refused at once, typed, with the fix."""

from __future__ import annotations

import pytest

import flightq


def test_a_location_without_a_scheme_names_the_fix():
    with pytest.raises(flightq.ProtocolError, match=r"use grpc://127\.0\.0\.1:8815"):
        flightq.connect("127.0.0.1:8815")


def test_a_sharded_location_without_a_scheme_names_the_fix():
    with pytest.raises(flightq.ProtocolError, match=r"use grpc://127\.0\.0\.1:8816"):
        flightq.connect_sharded(["grpc://127.0.0.1:8815", "127.0.0.1:8816"])
