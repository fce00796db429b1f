"""``flightq schema list | show | diff | check``, run as a user runs them: in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers_wire import shipped

from flightq import Schema
from flightq.registry import shipped_schema_dir


def _flightq(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flightq.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def _folder(root: Path, *docs: dict) -> Path:
    for doc in docs:
        folder = root / doc["name"]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"v{doc['version']}.json").write_text(json.dumps(doc))
    return root


IDS = {"name": "ids", "dtype": "int64", "role": "token", "shape": [None], "required": True}
REWARD = {"name": "reward", "dtype": "float32", "role": "scalar", "shape": []}
PIXELS = {
    "name": "px",
    "dtype": "uint8",
    "role": "media",
    "shape": None,
    "codec": {"id": "zstd", "level": 5},
}


def test_list_prints_every_version_with_its_fingerprint(tmp_path: Path) -> None:
    run = _flightq("schema", "list", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["rollout_text@1", "8fc8fc254357e2fa"],
        ["rollout_vlm@1", "d7a5042c77355bdd"],
        ["rollout_vlm_bf16@1", "67f08417fecfdc87"],
    ]
    assert lines[0].endswith("11 fields (required: input_ids)")
    assert lines[1].endswith("19 fields (required: input_ids)")


def test_show_lists_each_field_with_dtype_role_and_shape() -> None:
    run = _flightq("schema", "show", "rollout_vlm@1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "rollout_vlm@1  fingerprint d7a5042c77355bdd"
    rows = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    assert list(rows) == [f.name for f in shipped("rollout_vlm@1")]
    assert rows["input_ids"] == ["int64", "token", "[null]", "required"]
    assert rows["pixel_values"] == ["float32", "media", "any", "rank"]
    assert rows["image_grid_thw"] == ["int64", "media", "[null,", "3]"]
    assert rows["truncated"] == ["bool", "scalar", "[]"]


def test_show_of_a_bare_name_is_its_latest_version() -> None:
    assert _flightq("schema", "show", "rollout_text").stdout == (
        _flightq("schema", "show", "rollout_text@1").stdout
    )


def test_show_json_prints_the_schema_document() -> None:
    run = _flightq("schema", "show", "--json", "rollout_vlm_bf16@1")
    assert run.returncode == 0, run.stderr
    s = Schema.from_json(run.stdout)
    assert s == shipped("rollout_vlm_bf16@1")
    assert s.fingerprint == "67f08417fecfdc87"
    assert json.loads(run.stdout) == shipped("rollout_vlm_bf16@1").to_dict()


def test_show_names_a_fields_codec(tmp_path: Path) -> None:
    root = _folder(tmp_path, {"name": "img", "version": 1, "fields": [IDS, PIXELS]})
    run = _flightq("schema", "--schemas", str(root), "show", "img@1")
    assert run.returncode == 0, run.stderr
    px = next(line for line in run.stdout.splitlines() if line.split()[0] == "px")
    assert px.endswith("codec={'id': 'zstd', 'level': 5}")


def test_show_of_an_unknown_schema_fails_naming_what_is_registered() -> None:
    run = _flightq("schema", "show", "rollout_audio@1")
    assert run.returncode == 2
    assert run.stdout == ""
    assert run.stderr.strip() == (
        "flightq: UnknownSchemaError: unknown schema 'rollout_audio'; registered: "
        "rollout_text, rollout_vlm, rollout_vlm_bf16"
    )


def test_diff_prints_each_difference_and_exits_1() -> None:
    run = _flightq("schema", "diff", "rollout_vlm@1", "rollout_vlm_bf16@1")
    assert run.returncode == 1
    assert run.stdout.splitlines() == [
        "schema: expected rollout_vlm@1, actual rollout_vlm_bf16@1",
        "field 'pixel_values': dtype expected 'float32', actual 'bfloat16'",
        "field 'pixel_values_videos': dtype expected 'float32', actual 'bfloat16'",
    ]


def test_diff_of_a_json_file_against_its_released_version_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "copy.json"
    path.write_text(shipped("rollout_text@1").to_json())
    run = _flightq("schema", "diff", "rollout_text@1", str(path))
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (
        "rollout_text@1 and rollout_text@1 are identical (fingerprint 8fc8fc254357e2fa)"
    )


def test_diff_names_a_field_missing_from_a_vlm_schema() -> None:
    run = _flightq("schema", "diff", "rollout_vlm@1", "rollout_text@1")
    assert run.returncode == 1
    assert (
        "field 'pixel_values': expected float32 media shape=None required=False, actual (absent)"
        in run.stdout.splitlines()
    )


def test_check_of_the_shipped_folder_passes() -> None:
    run = _flightq("schema", "check", str(shipped_schema_dir()))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "ok  rollout_text@1               8fc8fc254357e2fa",
        "ok  rollout_vlm@1                d7a5042c77355bdd",
        "ok  rollout_vlm_bf16@1           67f08417fecfdc87",
        "3 schema versions follow the evolution rules",
    ]


@pytest.mark.parametrize(
    ("v2_fields", "stderr"),
    [
        (
            [IDS],
            "flightq: EvolutionError: demo@2: field 'reward' of demo@1 was removed or "
            "renamed; rule: fields are never removed or renamed (use a new schema name)",
        ),
        (
            [IDS, REWARD, {**PIXELS, "required": True}],
            "flightq: EvolutionError: demo@2: appended field 'px' is required; rule: fields added "
            "in a new version are optional",
        ),
    ],
)
def test_check_of_a_folder_breaking_a_rule_names_the_field_and_the_rule(
    v2_fields: list, stderr: str, tmp_path: Path
) -> None:
    v1 = {"name": "demo", "version": 1, "fields": [IDS, REWARD]}
    root = _folder(tmp_path, v1, {"name": "demo", "version": 2, "fields": v2_fields})
    run = _flightq("schema", "check", str(root))
    assert run.returncode == 2
    assert run.stderr.strip() == stderr


def test_check_of_a_malformed_file_names_the_file(tmp_path: Path) -> None:
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "v1.json").write_text("{")
    run = _flightq("schema", "check", str(tmp_path))
    assert run.returncode == 2
    assert run.stderr.startswith(f"flightq: SchemaError: {tmp_path}/demo/v1.json: schema is not")


def test_list_of_a_users_folder_shows_its_schemas_only(tmp_path: Path) -> None:
    doc = {"name": "demo", "version": 1, "fields": [IDS, REWARD]}
    root = _folder(tmp_path, doc)
    run = _flightq("schema", "--schemas", str(root), "list")
    assert run.returncode == 0, run.stderr
    fingerprint = Schema.from_dict(doc).fingerprint
    assert run.stdout.split() == ["demo@1", fingerprint, "2", "fields", "(required:", "ids)"]


def test_check_of_a_folder_without_schemas_fails(tmp_path: Path) -> None:
    run = _flightq("schema", "check", str(tmp_path))
    assert run.returncode == 1 and "no schemas under" in run.stderr


def test_version_prints_the_package_version() -> None:
    import flightq

    run = _flightq("--version")
    assert run.returncode == 0 and run.stdout.strip() == f"flightq {flightq.__version__}"


@pytest.mark.torch
def test_draft_writes_a_schema_from_a_saved_sample(tmp_path: Path, torch) -> None:
    sample = {
        "input_ids": torch.zeros(2, 7, dtype=torch.int64),
        "total_reward": torch.zeros(2),
    }
    torch.save(sample, tmp_path / "sample.pt")
    run = _flightq("schema", "draft", "sample.pt", "--name", "mine", "--out", "s", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    s = Schema.from_json((tmp_path / "s" / "mine" / "v1.json").read_text())
    assert [(f.name, f.dtype, f.role, f.shape) for f in s.fields] == [
        ("input_ids", "int64", "token", (None,)),
        ("total_reward", "float32", "scalar", ()),
    ]
    check = _flightq("schema", "check", "s", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    again = _flightq("schema", "draft", "sample.pt", "--name", "mine", "--out", "s", cwd=tmp_path)
    assert again.returncode == 1 and "immutable" in again.stderr
