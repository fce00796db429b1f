"""The schema registry: loading folders, lookups, fingerprints, and the evolution rules.

The rules are those written in ``schemas/README.md``; a test here reads them from that
file and checks that the registry enforces each one, and no other.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers_wire import SHIPPED_REFS

from flightq import (
    EvolutionError,
    Field,
    Schema,
    SchemaError,
    SchemaRegistry,
    UnknownSchemaError,
    Zstd,
)
from flightq.registry import check_evolution, shipped_schema_dir

README = Path(__file__).resolve().parents[2] / "schemas" / "README.md"

V1: dict[str, Any] = {
    "name": "demo",
    "version": 1,
    "fields": [
        {"name": "ids", "dtype": "int64", "role": "token", "shape": [None], "required": True},
        {"name": "reward", "dtype": "float32", "role": "scalar", "shape": []},
        {"name": "sizes", "dtype": "int32", "role": "media", "shape": [None, 2]},
    ],
}


def _write(root: Path, doc: dict[str, Any], name: str | None = None) -> Path:
    folder = root / (name or doc["name"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"v{doc['version']}.json"
    path.write_text(json.dumps(doc, indent=2))
    return path


def _v2(**changes: Any) -> dict[str, Any]:
    """Version 2 of V1 with ``changes`` applied to field ``sizes`` (``None`` drops a key)."""
    doc = copy.deepcopy(V1)
    doc["version"] = 2
    for k, v in changes.items():
        if v is None:
            doc["fields"][2].pop(k, None)
        else:
            doc["fields"][2][k] = v
    return doc


def _with_fields(fields: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": "demo", "version": 2, "fields": fields}


F_IDS, F_REWARD, F_SIZES = V1["fields"]
F_NEW = {"name": "extra", "dtype": "float32", "role": "token", "shape": [None]}

# Each way of breaking a rule: (v2 document, field named in the error, the rule it breaks).
R_REMOVED = "rule: fields are never removed or renamed (use a new schema name)"
R_FIXED = (
    "rule: an existing field's dtype, role, shape, required flag and codec are fixed "
    "(use a new schema name)"
)
R_APPEND = "rule: new versions only append fields"
R_OPTIONAL = "rule: fields added in a new version are optional"
VIOLATIONS = {
    "removed": (_with_fields([F_IDS, F_SIZES]), "reward", R_REMOVED, "was removed or renamed"),
    "renamed": (
        _with_fields([F_IDS, F_REWARD, {**F_SIZES, "name": "img_sizes"}]),
        "sizes",
        R_REMOVED,
        "was removed or renamed",
    ),
    "dtype": (_v2(dtype="int64"), "sizes", R_FIXED, "changed its dtype"),
    "role": (_v2(role="tensor"), "sizes", R_FIXED, "changed its role"),
    "shape": (_v2(shape=[None, 3]), "sizes", R_FIXED, "changed its shape"),
    "rank": (_v2(shape=None), "sizes", R_FIXED, "changed its shape"),
    "required": (_v2(required=True), "sizes", R_FIXED, "changed its required"),
    "codec added": (_v2(codec={"id": "zstd", "level": 3}), "sizes", R_FIXED, "changed its codec"),
    "reordered": (_with_fields([F_IDS, F_SIZES, F_REWARD]), "reward", R_APPEND, "moved"),
    "inserted": (_with_fields([F_IDS, F_NEW, F_REWARD, F_SIZES]), "reward", R_APPEND, "moved"),
    "required appended": (
        _with_fields([F_IDS, F_REWARD, F_SIZES, {**F_NEW, "required": True}]),
        "extra",
        R_OPTIONAL,
        "appended field 'extra' is required",
    ),
}


def _readme_rules() -> list[str]:
    text = " ".join(README.read_text().split())
    return re.findall(r"\*(rule: [^*]+)\*", text)


def test_readme_quotes_each_rule_the_registry_enforces_and_no_other() -> None:
    enforced = {rule for _, _, rule, _ in VIOLATIONS.values()}
    assert sorted(_readme_rules()) == sorted(enforced)


@pytest.mark.parametrize("case", VIOLATIONS)
def test_loading_a_folder_that_breaks_a_rule_names_the_field_and_the_rule(
    case: str, tmp_path: Path
) -> None:
    v2, field_name, rule, what = VIOLATIONS[case]
    _write(tmp_path, V1)
    _write(tmp_path, v2)
    with pytest.raises(EvolutionError) as info:
        SchemaRegistry.from_dir(tmp_path)
    message = str(info.value)
    assert message.startswith("demo@2: ")
    assert f"field {field_name!r}" in message
    assert what in message
    assert message.endswith(rule)
    assert rule in " ".join(README.read_text().split())


def test_readme_rule_on_immutable_versions_is_the_registrys(tmp_path: Path) -> None:
    reg = SchemaRegistry([Schema.from_dict(V1)])
    changed = Schema.from_dict(_v2(dtype="int64") | {"version": 1})
    with pytest.raises(
        SchemaError,
        match=r"demo@1 is already registered with fingerprint [0-9a-f]{16}, not [0-9a-f]{16}; "
        r"released versions are immutable",
    ):
        reg.register(changed)
    assert "released versions are immutable" in README.read_text()


def test_appending_optional_fields_is_a_legal_new_version(tmp_path: Path) -> None:
    _write(tmp_path, V1)
    _write(tmp_path, _with_fields([F_IDS, F_REWARD, F_SIZES, F_NEW]))
    reg = SchemaRegistry.from_dir(tmp_path)
    assert reg.versions("demo") == [1, 2]
    assert reg.get("demo").version == 2
    assert [f.name for f in reg.get("demo@2")] == ["ids", "reward", "sizes", "extra"]


def test_changing_a_doc_only_is_not_an_evolution_error() -> None:
    old = Schema.from_dict(V1)
    new = Schema.from_dict(_v2(doc="now documented"))
    check_evolution(old, new)


def test_rules_are_checked_against_the_next_version_too() -> None:
    reg = SchemaRegistry([Schema.from_dict(_v2(dtype="int64"))])
    with pytest.raises(
        EvolutionError, match=r"demo@2: field 'sizes' changed its dtype since demo@1"
    ):
        reg.register(Schema.from_dict(V1))
    assert reg.versions("demo") == [2]


def test_check_evolution_refuses_an_older_or_other_schema() -> None:
    s1 = Schema.from_dict(V1)
    with pytest.raises(EvolutionError, match=r"demo@1 is not a later version of demo@1"):
        check_evolution(s1, s1)
    other = Schema.from_dict(V1 | {"name": "other", "version": 2})
    with pytest.raises(EvolutionError, match=r"other@2 is not a later version of demo@1"):
        check_evolution(s1, other)


def test_codec_change_is_named_when_both_versions_declare_one() -> None:
    old = Schema("z", 1, [Field("p", "uint8", "media", None, codec=Zstd(3))])
    new = Schema("z", 2, [Field("p", "uint8", "media", None, codec=Zstd(9))])
    with pytest.raises(EvolutionError, match=r"z@2: field 'p' changed its codec since z@1"):
        check_evolution(old, new)


def test_get_by_name_and_version_equals_get_by_ref() -> None:
    reg = SchemaRegistry.default()
    assert reg.get("rollout_vlm", 1) == reg.get("rollout_vlm@1")
    assert reg.get("rollout_vlm", 1) is reg.get("rollout_vlm@1")
    assert reg.get("rollout_vlm") is reg.get("rollout_vlm@1")  # latest


def test_default_registry_holds_the_shipped_schemas() -> None:
    reg = SchemaRegistry.default()
    assert [s.ref for s in reg] == sorted(SHIPPED_REFS)
    assert reg.names() == ["rollout_text", "rollout_vlm", "rollout_vlm_bf16"]
    assert len(reg) == 3
    assert "rollout_text@1" in reg and "rollout_text@2" not in reg and "nope" not in reg
    assert 3 not in reg


def test_unknown_name_or_version_lists_what_is_registered() -> None:
    reg = SchemaRegistry.default()
    with pytest.raises(
        UnknownSchemaError,
        match=r"^unknown schema 'rollout_audio'; registered: rollout_text, rollout_vlm, ",
    ):
        reg.get("rollout_audio@1")
    with pytest.raises(
        UnknownSchemaError, match=r"^unknown schema version rollout_vlm@7; registered versions: 1$"
    ):
        reg.get("rollout_vlm", 7)
    with pytest.raises(KeyError, match=r"rollout_vlm@7"):  # UnknownSchemaError is a KeyError
        reg.get("rollout_vlm@7")


def test_registries_share_nothing() -> None:
    a, b = SchemaRegistry.default(), SchemaRegistry.default()
    a.register(Schema.from_dict(V1))
    assert "demo@1" in a and "demo@1" not in b
    assert "demo@1" not in SchemaRegistry.default()


def test_registering_an_identical_schema_again_returns_the_first() -> None:
    reg = SchemaRegistry()
    first = reg.register(Schema.from_dict(V1))
    assert reg.register(Schema.from_dict(V1 | {"doc": "same fields"})) is first
    assert len(reg) == 1


def test_default_registry_is_found_from_another_working_directory() -> None:
    code = (
        "import flightq; r = flightq.SchemaRegistry.default(); "
        "print(' '.join(s.ref + '=' + s.fingerprint for s in r))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd="/tmp", capture_output=True, text=True, check=True
    )
    here = " ".join(f"{s.ref}={s.fingerprint}" for s in SchemaRegistry.default())
    assert out.stdout.strip() == here
    assert shipped_schema_dir().is_dir()


def _bad_folder(root: Path, case: str) -> Path:
    """A folder with one defect; returns the file the error must name."""
    if case == "invalid json":
        path = _write(root, V1)
        path.write_text('{"name": "demo", ')
        return path
    if case == "misnamed file":
        path = root / "demo" / "version1.json"
        path.parent.mkdir()
        path.write_text(json.dumps(V1))
        return path
    if case == "leading zero":
        path = root / "demo" / "v01.json"
        path.parent.mkdir()
        path.write_text(json.dumps(V1))
        return path
    if case == "folder disagrees":
        return _write(root, V1, name="other")
    if case == "version disagrees":
        path = _write(root, V1)
        return path.rename(path.with_name("v3.json"))
    if case == "unknown dtype":
        doc = copy.deepcopy(V1)
        doc["fields"][1]["dtype"] = "float24"
        return _write(root, doc)
    if case == "unknown field key":
        doc = copy.deepcopy(V1)
        doc["fields"][0]["nullable"] = True
        return _write(root, doc)
    raise AssertionError(case)


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("invalid json", r"schema is not valid JSON"),
        ("misnamed file", r"schema files are named v<N>\.json"),
        ("leading zero", r"schema files are named v<N>\.json"),
        ("folder disagrees", r"declares demo@1 but its path says other@1"),
        ("version disagrees", r"declares demo@1 but its path says demo@3"),
        ("unknown dtype", r"unknown dtype 'float24'"),
        ("unknown field key", r"field 'ids': unknown keys \['nullable'\]"),
    ],
)
def test_bad_folder_is_a_schema_error_naming_the_file(
    case: str, message: str, tmp_path: Path
) -> None:
    path = _bad_folder(tmp_path, case)
    with pytest.raises(SchemaError, match=message) as info:
        SchemaRegistry.from_dir(tmp_path)
    assert str(info.value).startswith(f"{path}: ")


def test_missing_folder_is_a_schema_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match=r"schema folder '.*/nowhere' does not exist"):
        SchemaRegistry.from_dir(tmp_path / "nowhere")


def test_files_that_are_not_json_are_ignored(tmp_path: Path) -> None:
    _write(tmp_path, V1)
    (tmp_path / "demo" / "NOTES.md").write_text("not a schema")
    (tmp_path / "README.md").write_text("not a schema either")
    assert [s.ref for s in SchemaRegistry.from_dir(tmp_path)] == ["demo@1"]


def test_forgotten_refs_are_kept_by_a_digest_and_come_back_with_their_content_only() -> None:
    # A ref may be 32 KiB long (names have no length limit of their own): what the
    # registry keeps of a forgotten one is 16 bytes of its digest, not the ref.
    reg = SchemaRegistry()
    names = [f"n{i}_" + "x" * 30_000 for i in range(8)]
    for name in names:
        reg.register(Schema.from_dict({**V1, "name": name}), max_schemas=4)
        if len(reg) == 4:
            assert reg.forget_oldest(set()) is not None
    assert len(reg._forgotten) == 5 and all(len(k) == 16 for k in reg._forgotten)
    changed = copy.deepcopy(V1)
    changed["fields"][0]["dtype"] = "int32"
    with pytest.raises(SchemaError, match=r"was registered with fingerprint"):
        reg.register(Schema.from_dict({**changed, "name": names[0]}), max_schemas=16)
    assert reg.register(Schema.from_dict({**V1, "name": names[0]}), max_schemas=16).name == names[0]
