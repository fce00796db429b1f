"""What a client learns from its answers to size its next gets (`RowSizes`)."""

from __future__ import annotations

from flightq.client.reads import RowSizes


def test_parts_that_came_back_empty_teach_how_many_rows_the_server_keeps_together() -> None:
    sizes = RowSizes()
    assert sizes.together("p") == 1  # nothing known: any cut
    sizes.learn_parts("p", [0, 0, 0, 8])  # one prompt group over 4 streams
    assert sizes.together("p") == 8
    sizes.learn_parts("p", [0, 16, 0, 16])  # two groups of 16 over 4 streams
    assert sizes.together("p") == 16
    sizes.learn_parts("p", [16, 16, 16, 16])  # every part had rows: no fewer than 16 seen
    assert sizes.together("p") == 16
    sizes.learn_parts("p", [8, 8])  # a part of fewer rows than known: the server cut there
    assert sizes.together("p") == 8
    sizes.learn_parts("p", [0, 0])  # an answer of no rows teaches nothing
    assert sizes.together("p") == 8
    assert sizes.together("q") == 1  # per partition
