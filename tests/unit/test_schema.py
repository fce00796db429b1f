"""Fields, roles and shapes; schemas to and from JSON; fingerprints and diffs."""

from __future__ import annotations

import json

import pytest
from helpers_wire import SHIPPED_REFS, shipped

from flightq import Field, Schema, SchemaError, UnknownSchemaError, Zstd
from flightq.schema import diff_schemas, parse_ref

TEXT_FIELDS = {
    # name: (dtype, role, shape)
    "input_ids": ("int64", "token", [None]),
    "input_lengths": ("int32", "scalar", []),
    "generation_logprobs": ("float32", "token", [None]),
    "prev_logprobs": ("float32", "token", [None]),
    "reference_policy_logprobs": ("float32", "token", [None]),
    "advantages": ("float32", "token", [None]),
    "token_mask": ("int64", "token", [None]),
    "sample_mask": ("float32", "scalar", []),
    "total_reward": ("float32", "scalar", []),
    "truncated": ("bool", "scalar", []),
    "mask_sample": ("bool", "scalar", []),
}
VLM_EXTRA = {
    "token_type_ids": ("int64", "token", [None]),
    "mm_token_type_ids": ("int64", "token", [None]),
    "pixel_values": ("float32", "media", None),
    "image_grid_thw": ("int64", "media", [None, 3]),
    "pixel_values_videos": ("float32", "media", None),
    "video_grid_thw": ("int64", "media", [None, 3]),
    "imgs_sizes": ("int32", "media", [None, 2]),
    "num_frames": ("int32", "media", [None]),
}
BF16 = {"pixel_values", "pixel_values_videos"}


def _declared(ref: str) -> dict[str, tuple[str, str, list | None]]:
    return {
        f.name: (f.dtype, f.role, None if f.shape is None else list(f.shape)) for f in shipped(ref)
    }


def test_rollout_text_declares_the_text_fields_of_the_recipes() -> None:
    assert _declared("rollout_text@1") == TEXT_FIELDS


def test_rollout_vlm_declares_the_text_fields_plus_token_types_and_media() -> None:
    assert _declared("rollout_vlm@1") == TEXT_FIELDS | VLM_EXTRA


def test_rollout_vlm_bf16_is_rollout_vlm_with_bfloat16_pixels() -> None:
    want = TEXT_FIELDS | VLM_EXTRA
    want |= {n: ("bfloat16", *want[n][1:]) for n in BF16}
    assert _declared("rollout_vlm_bf16@1") == want


@pytest.mark.parametrize("ref", SHIPPED_REFS)
def test_input_ids_is_the_only_required_field_of_a_shipped_schema(ref: str) -> None:
    assert shipped(ref).required == ("input_ids",)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "a__b"}, r"field 'a__b': names are identifiers .* without '__'"),
        ({"name": "1abc"}, r"field '1abc': names are identifiers"),
        ({"dtype": "float128"}, r"unknown dtype 'float128'"),
        ({"role": "image"}, r"field 'x': unknown role 'image'; expected one of \('token'"),
        ({"shape": [None, -1]}, r"field 'x': shape must be a list of non-negative ints or null"),
        ({"shape": [None, True]}, r"shape must be a list of non-negative ints or null, or null"),
        ({"shape": [None, 2.0]}, r"field 'x': shape must be"),
        ({"shape": "2"}, r"field 'x': shape must be"),
        ({"role": "scalar", "shape": (3,)}, r"field 'x': a scalar has shape \[\], got \[3\]"),
        ({"role": "token", "shape": (3,)}, r"a token field's shape starts with null .*got \(3,\)"),
        ({"role": "token", "shape": ()}, r"a token field's shape starts with null"),
        ({"role": "token", "shape": None}, r"a token field's shape starts with null"),
        ({"role": "tensor", "shape": None}, r"field 'x': a tensor field has a fixed rank"),
        ({"required": 1}, r"field 'x': required must be true or false"),
    ],
)
def test_invalid_field_declarations_are_schema_errors(kwargs: dict, message: str) -> None:
    args = {"name": "x", "dtype": "float32", "role": "media", "shape": None} | kwargs
    with pytest.raises(SchemaError, match=message):
        Field(**args)


def test_scalar_shape_defaults_to_empty_and_list_shapes_become_tuples() -> None:
    assert Field("s", "int32", "scalar").shape == ()
    assert Field("t", "int64", "token", [None, 3]).shape == (None, 3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("d", "message"),
    [
        (
            {"name": "x", "dtype": "int64", "role": "token", "shape": [None], "size": 3},
            r"field 'x': unknown keys \['size'\]",
        ),
        ({"name": "x", "role": "token"}, r"field 'x': missing 'dtype'"),
        ([1, 2], r"a field is an object, got \[1, 2\]"),
    ],
)
def test_field_from_dict_refuses_malformed_documents(d: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Field.from_dict(d)  # type: ignore[arg-type]


def test_field_dict_form_round_trips_with_its_codec() -> None:
    f = Field("px", "bfloat16", "media", None, codec=Zstd(7), doc="pixels")
    d = f.to_dict()
    assert d == {
        "name": "px",
        "dtype": "bfloat16",
        "role": "media",
        "shape": None,
        "required": False,
        "codec": {"id": "zstd", "level": 7},
        "doc": "pixels",
    }
    assert Field.from_dict(d) == f


def test_field_check_shape_names_expected_and_actual() -> None:
    f = Field("g", "int64", "media", (None, 3))
    assert f.check_shape((5, 3)) is None
    assert f.check_shape((0, 3)) is None
    assert f.check_shape((1, 4)) == "expected shape [?, 3], got (1, 4)"
    assert f.check_shape((3,)) == "expected rank 2 [?, 3], got (3,)"
    assert Field("any", "int8", "media", None).check_shape((1, 2, 3, 4, 5)) is None


def test_schema_refuses_a_field_declared_twice() -> None:
    f = Field("a", "int64", "token", (None,))
    with pytest.raises(SchemaError, match=r"schema s@1: field 'a' is declared twice"):
        Schema("s", 1, [f, f])


@pytest.mark.parametrize(
    ("name", "version", "message"),
    [
        ("s", 0, r"schema 's': version must be an integer >= 1, got 0"),
        ("s", True, r"schema 's': version must be an integer >= 1, got True"),
        ("s", "1", r"schema 's': version must be an integer >= 1, got '1'"),
        ("my schema", 1, r"schema name 'my schema' must be an identifier without '__'"),
        ("s__x", 1, r"schema name 's__x' must be an identifier"),
    ],
)
def test_schema_refuses_bad_names_and_versions(name: str, version: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Schema(name, version, [])  # type: ignore[arg-type]


@pytest.mark.parametrize("ref", SHIPPED_REFS)
def test_shipped_schema_json_round_trips_to_the_same_fingerprint(ref: str) -> None:
    s = shipped(ref)
    again = Schema.from_json(s.to_json())
    assert again == s
    assert again.fingerprint == s.fingerprint
    assert again.to_json() == s.to_json()


def test_fingerprint_ignores_docs_but_not_declarations() -> None:
    base = Schema("s", 1, [Field("a", "int64", "token", (None,), doc="one")], doc="x")
    redoc = Schema("s", 1, [Field("a", "int64", "token", (None,), doc="two")], doc="y")
    retyped = Schema("s", 1, [Field("a", "int32", "token", (None,))])
    assert base.fingerprint == redoc.fingerprint
    assert base.fingerprint != retyped.fingerprint
    assert len(base.fingerprint) == 16 and int(base.fingerprint, 16) >= 0


def test_canonical_json_is_sorted_compact_and_docless() -> None:
    s = Schema("s", 2, [Field("a", "bool", "scalar", doc="d")], doc="x")
    assert s.canonical_json == (
        '{"fields":[{"dtype":"bool","name":"a","required":false,"role":"scalar","shape":[]}],'
        '"name":"s","version":2}'
    )


def test_schema_lookup_of_an_undeclared_field_lists_the_declared_ones() -> None:
    s = Schema("s", 1, [Field("a", "bool", "scalar"), Field("b", "int8", "scalar")])
    assert "a" in s and "c" not in s
    with pytest.raises(
        UnknownSchemaError, match=r"schema s@1 declares no field 'c'; declared: a, b"
    ):
        s["c"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"{not json", r"schema is not valid JSON: "),
        (b"[1]", r"a schema is an object, got list"),
        (b'{"name": "s", "version": 1}', r"schema 's': missing 'fields'"),
        (b'{"name": "s", "version": 1, "fields": {}}', r"schema 's': 'fields' must be a list"),
        (b'{"name": "s", "version": 1, "fields": [], "v": 2}', r"schema 's': unknown keys \['v'\]"),
    ],
)
def test_schema_from_json_refuses_malformed_documents(text: bytes, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        Schema.from_json(text)


@pytest.mark.parametrize(
    ("ref", "version", "want"),
    [
        ("rollout_vlm@1", None, ("rollout_vlm", 1)),
        ("rollout_vlm", 2, ("rollout_vlm", 2)),
        ("rollout_vlm", None, ("rollout_vlm", None)),
        ("rollout_vlm@12", 12, ("rollout_vlm", 12)),
    ],
)
def test_parse_ref_splits_name_and_version(ref: str, version: int | None, want: tuple) -> None:
    assert parse_ref(ref, version) == want


def test_parse_ref_refuses_a_bad_or_conflicting_version() -> None:
    with pytest.raises(SchemaError, match=r"'rollout_vlm@v1': expected name@version, e\.g\."):
        parse_ref("rollout_vlm@v1")
    with pytest.raises(SchemaError, match=r"'rollout_vlm@1' conflicts with version=2"):
        parse_ref("rollout_vlm@1", 2)


def test_diff_of_identical_schemas_is_empty() -> None:
    assert diff_schemas(shipped("rollout_vlm@1"), shipped("rollout_vlm@1")) == []


def test_diff_names_each_changed_field_with_expected_and_actual() -> None:
    lines = diff_schemas(shipped("rollout_vlm@1"), shipped("rollout_vlm_bf16@1"))
    assert lines == [
        "schema: expected rollout_vlm@1, actual rollout_vlm_bf16@1",
        "field 'pixel_values': dtype expected 'float32', actual 'bfloat16'",
        "field 'pixel_values_videos': dtype expected 'float32', actual 'bfloat16'",
    ]


def test_diff_reports_absent_fields_and_order() -> None:
    a = Schema("s", 1, [Field("x", "int8", "scalar"), Field("y", "int8", "scalar")])
    b = Schema(
        "s",
        1,
        [
            Field("y", "int8", "scalar"),
            Field("x", "int8", "scalar"),
            Field("z", "int64", "token", (None,), required=True),
        ],
    )
    assert diff_schemas(a, b) == [
        "field 'z': expected (absent), actual int64 token shape=[None] required=True",
        "field order: expected ['x', 'y'], actual ['y', 'x']",
    ]
    assert diff_schemas(b, a)[0] == (
        "field 'z': expected int64 token shape=[None] required=True, actual (absent)"
    )


def test_shipped_files_hold_exactly_what_the_loaded_schema_declares() -> None:
    # No key of a released file is dropped or defaulted on the way in (docs included).
    from flightq.registry import shipped_schema_dir

    for ref in SHIPPED_REFS:
        s = shipped(ref)
        path = shipped_schema_dir() / s.name / f"v{s.version}.json"
        assert json.loads(path.read_text()) == s.to_dict()
