"""The typed records the stages hand each other (eagle3.artifacts): loading old and foreign
files, the errors of incomplete ones, and a guard that no library module reads another stage's
record by string key."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from eagle3.artifacts import (
    ArtifactError,
    CaptureManifest,
    DraftMetadata,
    DraftVocab,
    EvalResults,
    PreparedMeta,
    SpoolHeader,
)
from eagle3.io import sha256_json, write_json

SRC = Path(__file__).resolve().parents[1] / "src" / "eagle3"

#: the file names of the records (eagle3.artifacts) and the module constants that name them
RECORD_FILES = {
    CaptureManifest.FILE,
    SpoolHeader.FILE,
    DraftMetadata.FILE,
    EvalResults.FILE,
    DraftVocab.FILE,
    PreparedMeta.FILE,
}
RECORD_FILE_CONSTANTS = {"MANIFEST", "METADATA", "HEADER", "RESULTS", "VOCAB_FILE", "FILE"}
#: modules that read a manifest.json of their own (their stage's output, read back only by
#: themselves on resume)
OWN_MANIFESTS = {"data/regenerate.py", "data/synthesize.py", "targets.py"}
#: calls that read a file's content
READERS = {
    "read_json",
    "loads",
    "load",
    "read_text",
    "read_bytes",
    "open",
    "read_state",
    "load_file",
    "safe_open",
}
#: names a record is bound to in the library (and nothing else may be: a dict under one of these
#: names is a record read around eagle3.artifacts)
RECORD_NAMES = {
    "manifest",
    "meta",
    "metadata",
    "prep_manifest",
    "prepared_manifest",
    "vm",
    "recorded",
    "results",
    "draft_meta",
}
RECORD_CLASSES = {
    "CaptureManifest",
    "SpoolHeader",
    "PreparedMeta",
    "DraftMetadata",
    "EvalResults",
    "DraftVocab",
}
#: functions that returned a record as a dict before eagle3.artifacts (a name bound to their result
#: is a record)
DICT_LOADERS = {
    "load_manifest",
    "load_combined_manifest",
    "verify_capture",
    "migrate_record",
    "load_prepared_manifest",
}


def _mentions_record_file(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Constant)
            and isinstance(sub.value, str)
            and Path(sub.value).name in RECORD_FILES
        ):
            return True
        if isinstance(sub, ast.Name) and sub.id in RECORD_FILE_CONSTANTS:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in RECORD_FILE_CONSTANTS:
            return True
    return False


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _base_name(node: ast.AST) -> str:
    """`manifest` for manifest, self.manifest, source.manifest, inputs.manifest."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _is_record(node: ast.AST) -> bool:
    """A name a record goes by (manifest, self.manifest, meta, ...) or a record loaded in place
    (CaptureManifest.load(...))."""
    if isinstance(node, ast.Call):
        return any(isinstance(n, ast.Name) and n.id in RECORD_CLASSES for n in ast.walk(node.func))
    return _base_name(node) in RECORD_NAMES


def _dumps_record(node: ast.AST) -> bool:
    """`<record>.to_dict()` / `<record>.model_dump()`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("to_dict", "model_dump")
        and _is_record(node.func.value)
    )


def _string_key(node: ast.AST) -> str | None:
    """The constant string key of `x["key"]` or `x.get("key", ...)`, else None."""
    if (
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
    ):
        return node.slice.value
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "get"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def _keyed_value(node: ast.AST) -> ast.AST:
    if isinstance(node, ast.Subscript):
        return node.value
    return node.func.value  # type: ignore[attr-defined]


def _scope_nodes(scope: ast.AST):
    """The nodes of one scope (a module or a function), not those of the functions defined in it."""
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            todo.extend(ast.iter_child_nodes(node))


def record_key_reads(path: Path, rel: str) -> list[str]:
    """Places in one module that read a record around eagle3.artifacts: a raw read of a record
    file, a string key read on a name a record goes by, or on a record's to_dict()/model_dump()."""
    tree = ast.parse(path.read_text())
    found = []
    for fn in [
        tree,
        *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)),
    ]:
        dumped: set[str] = set()  # names bound to a record's to_dict() in this scope
        bound: set[str] = (
            set()
        )  # names bound to a record (or a record read as a dict) in this scope
        for node in _scope_nodes(fn):
            if not isinstance(node, ast.Assign):
                continue
            pairs = [(t, node.value) for t in node.targets]
            pairs += [
                pair
                for t in node.targets
                if isinstance(t, ast.Tuple)
                and isinstance(node.value, ast.Tuple)
                and len(t.elts) == len(node.value.elts)
                for pair in zip(t.elts, node.value.elts, strict=True)
            ]
            for target, value in pairs:
                if not isinstance(target, ast.Name):
                    continue
                if _dumps_record(value):
                    dumped.add(target.id)
                elif _is_record(value) or (
                    isinstance(value, ast.Call)
                    and (
                        _call_name(value) in DICT_LOADERS
                        or any(_mentions_record_file(a) for a in value.args)
                    )
                ):
                    bound.add(target.id)
        for node in _scope_nodes(fn):
            where = f"{rel}:{getattr(node, 'lineno', '?')}"
            if (
                isinstance(node, ast.Call)
                and _call_name(node) in READERS
                and rel not in OWN_MANIFESTS
                and any(
                    _mentions_record_file(a)
                    for a in [*node.args, getattr(node.func, "value", node)]
                )
            ):
                found.append(f"{where}: reads a record file itself ({ast.unparse(node)[:80]})")
            key = _string_key(node)
            if key is None:
                continue
            value = _keyed_value(node)
            if _dumps_record(value) or isinstance(value, ast.Name) and value.id in dumped:
                found.append(f"{where}: {ast.unparse(node)[:80]}")
            elif (
                _is_record(value) or isinstance(value, ast.Name) and value.id in bound
            ) and rel not in OWN_MANIFESTS:
                found.append(f"{where}: {ast.unparse(node)[:80]}")
    return sorted(set(found))


def test_no_module_outside_artifacts_reads_a_record_by_string_key():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = str(path.relative_to(SRC))
        if rel != "artifacts.py":
            found += record_key_reads(path, rel)
    assert not found, "records read around eagle3.artifacts:\n" + "\n".join(found)


def test_the_guard_finds_what_it_guards_against(tmp_path):
    """The readers the typed records replaced, as they were written before (2026-12-03), are each
    found."""
    src = tmp_path / "old.py"
    src.write_text(
        "def a(ck):\n    meta = migrate_record(read_json(ck / METADATA))\n"
        "    return meta['draft_config']\n"
        "def b(d):\n    return CaptureManifest.load(d).to_dict()['aux_layer_ids']\n"
        "def c(self):\n"
        "    return self.manifest['aux_layer_ids'], inputs.manifest.get('hidden_size')\n"
        "def d(p):\n    return json.loads((p / 'eagle3_draft.json').read_text())\n"
        "def e(manifest):\n    d = manifest.to_dict()\n"
        "    return d['shards'], stats.to_dict()['x']\n"
        "def f(t):\n    return t['hidden_size']  # a target's config.json: not a record\n"
        "def g(out):\n    m = load_manifest(out)\n    h, c = self.source.manifest, 1\n"
        "    return m['shards'], h['seed']\n"
    )
    found = record_key_reads(src, "old.py")
    assert sorted(int(f.split(":")[1]) for f in found) == [2, 3, 5, 7, 7, 9, 9, 12, 18, 18], found


def test_capture_manifest_with_old_keys_and_unknown_keys_round_trips(tmp_path):
    old = {
        "format": CaptureManifest.FORMAT,
        "layers": [1, 2, 4],
        "hidden_size": 8,
        "num_samples": 2,
        "from_a_newer_writer": {"x": 1},
        "shards": [{"file": "shard-00000.safetensors", "sha256": "ab", "num_samples": 2, "seq": 3}],
    }
    write_json(tmp_path / "manifest.json", old)
    m = CaptureManifest.load(tmp_path)
    assert (
        m.aux_layer_ids == [1, 2, 4]
        and m.hidden_size == 8
        and m.shards[0].file == "shard-00000.safetensors"
    )
    assert m.origin == str(tmp_path / "manifest.json")
    out = m.to_dict()
    assert (
        out["from_a_newer_writer"] == {"x": 1}
        and out["shards"][0]["seq"] == 3
        and "layers" not in out
    )
    assert set(out) == {
        "format",
        "aux_layer_ids",
        "hidden_size",
        "num_samples",
        "from_a_newer_writer",
        "shards",
    }


@pytest.mark.parametrize(
    "drop,field",
    [("hidden_size", "hidden_size"), ("layers", "aux_layer_ids"), ("shards", "shards")],
)
def test_a_missing_required_field_names_the_file_the_field_and_the_fix(tmp_path, drop, field):
    rec = {"format": CaptureManifest.FORMAT, "layers": [1, 2], "hidden_size": 8, "shards": []}
    del rec[drop]
    write_json(tmp_path / "manifest.json", rec)
    with pytest.raises(
        ArtifactError,
        match=rf"{tmp_path}/manifest.json \(CaptureManifest\): required field "
        rf"`{field}` is missing; .*run it again with this --out",
    ):
        CaptureManifest.load(tmp_path)


def test_a_bad_value_is_named_with_the_record_and_the_fix(tmp_path):
    write_json(tmp_path / "eagle3_draft.json", {"draft_config": {}, "aux_layer_ids": "two"})
    with pytest.raises(
        ArtifactError,
        match=r"eagle3_draft.json \(DraftMetadata\): field `aux_layer_ids` = 'two'"
        r".*`eagle3 train` or `eagle3 export`",
    ):
        DraftMetadata.load(tmp_path)


def test_prepared_meta_round_trip_keeps_the_hash_capture_resumes_by(tmp_path):
    """capture hashes the prepared manifest (an interrupted capture resumes only under the same
    hash): read through PreparedMeta it must hash as the file's own JSON does, extra and null
    fields included."""
    raw = {
        "stage": "prepare",
        "source": "chats.jsonl",
        "source_sha256": None,
        "tokenizer_sha256": "t",
        "tokenizer_vocab_size": 50,
        "target_vocab_size": 64,
        "num_samples": 3,
        "num_tokens": 30,
        "skipped": {"invalid_json": 1},
        "config": {"max_seq_len": 2048, "trust_remote_code": False},
        "a_later_field": [1, 2],
    }
    write_json(tmp_path / "manifest.json", raw)
    meta = PreparedMeta.load(tmp_path)
    assert meta.to_dict() == json.loads((tmp_path / "manifest.json").read_text())
    assert sha256_json(meta.to_dict()) == sha256_json(raw) and meta.vocab_size == 64
    with pytest.raises(
        ArtifactError,
        match=r"required field `tokenizer_vocab_size` is missing; run `eagle3 prepare`",
    ):
        _ = PreparedMeta.from_dict({"stage": "prepare"}, "p/manifest.json").vocab_size


def test_draft_metadata_combined_capture_and_eval_results(tmp_path):
    meta = DraftMetadata.from_dict(
        {
            "layers": [1, 3],
            "draft_config": {"hidden_size": 8},
            "target": "t",
            "target_num_layers": 4,
            "train_config": {"layers": [1, 3], "num_speculative_tokens": 5},
        },
        "in memory",
    )
    assert meta.aux_layer_ids == [1, 3] and meta.train_config["aux_layer_ids"] == [1, 3]
    assert (
        meta.trained_num_speculative_tokens == 5 and meta.recorded_target().num_hidden_layers == 4
    )
    meta.model_copy(update={"export_format": "vllm"}).save(tmp_path)
    assert json.loads((tmp_path / "eagle3_draft.json").read_text())["export_format"] == "vllm"

    for name, n in (("a", 3), ("b", 4)):
        write_json(
            tmp_path / name / "manifest.json",
            {
                "format": CaptureManifest.FORMAT,
                "aux_layer_ids": [1, 2],
                "hidden_size": 8,
                "num_samples": n,
                "num_tokens": 10 * n,
                "shards": [{"file": "shard-00000.safetensors", "sha256": "ab", "num_samples": n}],
            },
        )
    both = CaptureManifest.load_combined(f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert (both.num_samples, both.num_tokens, both.parts) == (
        7,
        70,
        [str(tmp_path / "a"), str(tmp_path / "b")],
    )

    write_json(
        tmp_path / "ev" / "results.json",
        {
            "acceptance_length": 2.5,
            "method": "eagle3",
            "engine": {"x": 1},
            "rows": [{"category": "all", "num_drafts": 4, "tau": 2.5}],
        },
    )
    res = EvalResults.load(tmp_path / "ev")
    assert res.all_row().num_drafts == 4 and res.to_dict()["engine"] == {"x": 1}


def test_draft_vocab_file_round_trips_and_refuses_disagreeing_maps(tmp_path):
    ids = np.array([0, 2, 3, 7])
    t2d = np.zeros(9, dtype=bool)
    t2d[ids] = True
    v = DraftVocab(d2t=ids - np.arange(4), t2d=t2d, draft_ids=ids)
    v.save(tmp_path)
    back = DraftVocab.load(tmp_path)
    assert back.draft_ids.tolist() == [0, 2, 3, 7] and back.target_vocab_size == 9
    d2t, t2d_t = back.torch_maps()
    assert d2t.dtype.is_floating_point is False and t2d_t.sum() == 4
    DraftVocab(d2t=ids - np.arange(4), t2d=np.zeros(9, dtype=bool), draft_ids=ids).save(
        tmp_path / "bad"
    )
    with pytest.raises(ValueError, match="d2t and t2d disagree"):
        DraftVocab.load(tmp_path / "bad")
