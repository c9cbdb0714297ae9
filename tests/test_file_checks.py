"""Every file nla reads is checked (issue 48, "Nothing lost, nothing silently wrong"): each test
writes a real checkpoint or dataset with nla's own writers, damages it as a hostile user did, and
asserts the one-line error (or the correct result).

1. an injection adapter file present but not named by the sidecar;
2. an adapter ``file:`` outside the checkpoint (``..``, absolute, a symlink) or not in its checksums;
3. an adapter ``file:`` that is not safetensors;
4. a LoRA adapter on another base AV of the same shape (``base_weights_sha256``);
5. ``nla_lora.json`` that is not the documented object;
6. a pickled ``adapter_model.bin`` in a LoRA dir;
7. a dataset whose ``facts`` are all null (no ground truth, not recall 1.0);
8. a full disk inside ``save_pretrained`` during a checkpoint save.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml
from test_client import nla_pair  # noqa: F401 - a fixture
from train_helpers import dataset_sidecar

from nla.core.injection import (
    ADAPTER_FILE,
    InjectionAdapter,
    attach_adapter,
    load_adapter_file,
    load_av_model,
    save_av_checkpoint,
)
from nla.core.lora import LoRASettings, apply_lora, load_adapter, load_merged, read_lora_meta, save_adapter
from nla.core.sidecar import load_sidecar, write_sidecar
from nla.core.sidecar_errors import SidecarError
from nla.util.checkpoint_files import CHECKSUM_FILE, CheckpointSaveError, atomic_dir
from nla.util.validation import InputError

D_SUBJECT = 48  # the AV (tiny llama) is 32 wide: it reads the subject's 48-d vectors through its adapter


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    """Every test here runs single-threaded (see conftest.single_thread)."""


def _av_checkpoint(root: Path, tokenizer, base_dir: Path, *, adapter: bool = True, seed: int = 0) -> Path:
    """An AV checkpoint as nla's trainers write it: atomic_dir (checksums) + save_av_checkpoint."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir).eval()
    if seed:  # another AV of the same shape
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn_like(p))
    d_model = D_SUBJECT if adapter else 32
    side = dataset_sidecar(tokenizer, base_dir, d_model, 1, injection_scale=3.0)
    if adapter:
        a = InjectionAdapter(D_SUBJECT, 32, seed=1)
        attach_adapter(model, a)
        side = side.replace(model_base=str(base_dir), model_width=32, injection_adapter=a.describe())
    with atomic_dir(root) as tmp:
        save_av_checkpoint(model, tokenizer, side, tmp, stage="test")
    return root


@pytest.fixture
def av_dir(tmp_path, tiny_tokenizer, tiny_model_dir) -> Path:
    return _av_checkpoint(tmp_path / "av", tiny_tokenizer, tiny_model_dir("llama"))


def _edit_sidecar(directory: Path, edit) -> Path:
    file = directory / "nla_meta.yaml"
    doc = yaml.safe_load(file.read_text())
    edit(doc)
    file.write_text(yaml.safe_dump(doc, sort_keys=False))
    return file


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------- 1. unnamed adapter file
def test_adapter_file_without_its_sidecar_block_is_refused(av_dir, capsys):
    assert (av_dir / ADAPTER_FILE).is_file() and ADAPTER_FILE in (av_dir / CHECKSUM_FILE).read_text()
    side = load_sidecar(av_dir)  # as written: loads, with its adapter
    assert load_av_model(av_dir, side).nla_injection_adapter.d_in == D_SUBJECT
    _edit_sidecar(av_dir, lambda doc: doc.pop("injection_adapter"))
    with pytest.raises(SidecarError) as err:
        load_sidecar(av_dir)
    assert f"{av_dir / 'nla_meta.yaml'}: no injection_adapter block, but {av_dir / ADAPTER_FILE} is there" in _one_line(err)
    # a sidecar given explicitly (here: the edited one, re-read as a plain dict) is refused as well
    with pytest.raises(InputError, match=rf"{ADAPTER_FILE}: present and listed in {CHECKSUM_FILE}, but the sidecar has "
                                         "no injection_adapter block naming it"):
        load_av_model(av_dir, side.replace(injection_adapter=None, model_width=None, d_model=32))
    # the CLI: one line, exit 2
    from nla.cli import main

    np.save(av_dir.parent / "v.npy", np.ones((1, D_SUBJECT), np.float32))
    capsys.readouterr()
    assert main(["verbalize", "--av", str(av_dir), "--vectors", str(av_dir.parent / "v.npy")]) == 2
    out = capsys.readouterr().err.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("nla verbalize: error: ") and "no injection_adapter block" in out[0]


# ---------------------------------------------------------------- 2. adapter file outside the checkpoint
def test_adapter_file_must_be_inside_the_checkpoint_and_checksummed(av_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(av_dir / ADAPTER_FILE, other / ADAPTER_FILE)  # a valid adapter, elsewhere

    def named(name: str):
        _edit_sidecar(av_dir, lambda doc: doc["injection_adapter"].update(file=name))
        return load_sidecar(av_dir)

    for name, shown in ((f"../other/{ADAPTER_FILE}", other / ADAPTER_FILE), ("/etc/passwd", Path("/etc/passwd"))):
        with pytest.raises(InputError) as err:
            load_adapter_file(av_dir, named(name))
        assert (f"the sidecar's injection_adapter.file {name!r} resolves to {shown.resolve()}, outside the checkpoint "
                f"dir {av_dir.resolve()}") in _one_line(err)
    (av_dir / "link.safetensors").symlink_to(other / ADAPTER_FILE)  # a symlink out of the dir
    with pytest.raises(InputError, match="'link.safetensors' resolves to .*other.*, outside the checkpoint dir"):
        load_adapter_file(av_dir, named("link.safetensors"))
    # inside the dir, but not the file the checksum record covers
    shutil.copy(av_dir / ADAPTER_FILE, av_dir / "swapped.safetensors")
    with pytest.raises(InputError) as err:
        load_adapter_file(av_dir, named("swapped.safetensors"))
    assert f"'swapped.safetensors' is not listed in {av_dir / CHECKSUM_FILE}" in _one_line(err)
    # the named file is listed but was replaced since the save
    side = named(ADAPTER_FILE)
    from safetensors.torch import save_file

    save_file({k: v + 1 for k, v in load_adapter_file(av_dir, side).state_dict().items()}, str(av_dir / ADAPTER_FILE))
    with pytest.raises(InputError, match=r"SHA-256 differs from the one recorded"):
        load_adapter_file(av_dir, side)


# ---------------------------------------------------------------- 3. adapter file that is not safetensors
def test_adapter_file_that_is_not_safetensors_is_a_clear_error(av_dir):
    (av_dir / CHECKSUM_FILE).unlink()  # a checkpoint from elsewhere: no checksum record to catch it first
    (av_dir / "adapter.txt").write_text("these are not weights\n" * 4)
    _edit_sidecar(av_dir, lambda doc: doc["injection_adapter"].update(file="adapter.txt"))
    with pytest.raises(InputError) as err:
        load_adapter_file(av_dir, load_sidecar(av_dir))
    msg = _one_line(err)
    assert msg.startswith(f"{(av_dir / 'adapter.txt').resolve()}: not a safetensors file (88 bytes; safetensors: ")
    assert "must name the adapter's safetensors weights" in msg


# ---------------------------------------------------------------- 4-6. LoRA adapter dirs
@pytest.fixture
def lora_setup(tmp_path, tiny_tokenizer, tiny_model_dir):
    """Two AV checkpoints of one shape (A, B) and a LoRA adapter saved on A by save_adapter."""
    from transformers import AutoModelForCausalLM

    base = tiny_model_dir("llama")
    a = _av_checkpoint(tmp_path / "av_a", tiny_tokenizer, base, adapter=False)
    b = _av_checkpoint(tmp_path / "av_b", tiny_tokenizer, base, adapter=False, seed=3)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(a).eval(), LoRASettings(r=2, alpha=4.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    out = save_adapter(model, tmp_path / "av_a_adapter", a)
    return a, b, out


def _set_meta(directory: Path, **changes) -> None:
    meta = json.loads((directory / "nla_lora.json").read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    (directory / "nla_lora.json").write_text(json.dumps(meta))


def test_lora_adapter_records_and_checks_its_base_weights(lora_setup):
    a, b, adapter = lora_setup
    meta = read_lora_meta(adapter)
    assert len(meta["base_weights_sha256"]) == 64
    merged, home = load_merged(adapter)  # on its own base: loads
    assert home == a.resolve()
    _set_meta(adapter, base_model=str(b))  # another AV of the same shape
    with pytest.raises(InputError) as err:
        load_merged(adapter)
    msg = _one_line(err)
    assert msg.startswith(f"{adapter / 'nla_lora.json'}: base_weights_sha256 {meta['base_weights_sha256'][:12]}… but the "
                          f"base AV {b} (base_model) now holds weights ")
    assert "the adapter was trained on other weights" in msg
    # an adapter saved before the field existed loads as before (its base path is checked, not its weights)
    _set_meta(adapter, base_weights_sha256=None)
    load_merged(adapter)
    _set_meta(adapter, base_model=str(adapter.parent / "gone"))
    with pytest.raises(FileNotFoundError, match="is not a checkpoint dir here"):
        load_merged(adapter)


@pytest.mark.parametrize("content, found", [
    ("[1, 2]", "expected a JSON object {r, alpha, dropout, target_modules, base_model, ...}, found a list"),
    ('"r"', "found a str"),
    ('{"alpha": 4, "dropout": 0, "target_modules": ["q_proj"], "base_model": ""}', "missing key 'r' (expected int)"),
    ('{"r": "2", "alpha": 4, "dropout": 0, "target_modules": ["q_proj"], "base_model": ""}',
     "r: expected a positive int, found '2'"),
    ('{"r": 2, "alpha": 4, "dropout": 0, "target_modules": "q_proj", "base_model": ""}',
     "target_modules: expected a non-empty list of module names, found 'q_proj'"),
    ("{not json", "not valid JSON"),
])
def test_lora_meta_is_checked_by_schema(lora_setup, content, found):
    _, _, adapter = lora_setup
    (adapter / "nla_lora.json").write_text(content)
    with pytest.raises(InputError) as err:
        load_merged(adapter)
    assert _one_line(err).startswith(f"{adapter / 'nla_lora.json'}: {found}") or found in str(err.value)


def test_pickled_weights_in_a_lora_dir_are_refused_before_peft(lora_setup):
    _, _, adapter = lora_setup
    (adapter / "adapter_model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, adapter / "adapter_model.bin")  # what peft falls back to (and unpickles)
    for load in (lambda: load_merged(adapter), lambda: load_adapter(torch.nn.Linear(1, 1), adapter)):
        with pytest.raises(InputError) as err:
            load()
        assert _one_line(err) == (
            f"{adapter}: holds pickled weight file(s) ['adapter_model.bin']; nla never unpickles (loading a pickle "
            "can run any code): convert the adapter to safetensors (adapter_model.safetensors, e.g. peft's "
            "save_pretrained(..., safe_serialization=True)) and remove the pickled file(s)")


# ---------------------------------------------------------------- 7. facts all null
def test_all_null_facts_are_no_ground_truth_not_perfect_recall(nla_pair, tmp_path):  # noqa: F811
    from nla.client import NLAClient
    from nla.datagen.io import vectors_to_arrow, write_parquet_atomic
    from nla.eval.evaluate import ROW_SHUFFLED, evaluate_pair

    n, d = 4, nla_pair.side.d_model
    vecs = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    table = pa.table({"activation_vector": vectors_to_arrow(vecs),
                      "facts": pa.array([None] * n, pa.list_(pa.string())),
                      "current_word": pa.array(["a", "b", "c", "d"])})
    path = write_parquet_atomic(table, tmp_path / "nulls.parquet")
    write_sidecar(path, nla_pair.side.replace(kind="nla_dataset", role=None))
    client = NLAClient(nla_pair.av_dir, nla_pair.ar_dir, device="cpu")
    report = evaluate_pair(client, path, max_new_tokens=8, n_show=0, grader="world")
    rows = [r for r in report.rows if r.faithfulness is not None]
    assert {r.name for r in rows} >= {"AV → AR round trip", ROW_SHUFFLED}
    for r in rows:
        f = r.faithfulness
        assert (f.recall, f.precision, f.n) == (None, None, 0)
        assert f.note == "no ground truth: facts is null on every row (4); recall and precision are not graded"
    md = report.to_markdown()
    assert "Fact recall / precision: no ground truth" in md and "1.0000 | 1.0000" not in md
    assert report.to_dict()["rows"][0]["faithfulness"]["recall"] is None
    # some rows null: those are left out, the rest graded as before
    from nla.core.graders import faithfulness

    f = faithfulness(["Alice is here.", "Alice is here."], [None, ["person=alice"]])
    assert (f.recall, f.n) == (1.0, 1) and f.note == "1 of 2 rows have no ground truth (facts null) and are not graded"


# ---------------------------------------------------------------- 8. a full disk inside save_pretrained
@pytest.mark.parametrize("raise_as", ["safetensors", "oserror"])
def test_disk_full_in_save_pretrained_is_one_line_and_keeps_the_old_checkpoint(
        tmp_path, tiny_tokenizer, tiny_model_dir, monkeypatch, raise_as):
    import transformers.modeling_utils as mu
    from safetensors import SafetensorError

    final = _av_checkpoint(tmp_path / "step_1", tiny_tokenizer, tiny_model_dir("llama"))
    before = sorted(p.name for p in final.iterdir())

    def full(*args, **kwargs):
        if raise_as == "safetensors":  # what safetensors raises on ENOSPC (not an OSError)
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(mu, "safe_save_file", full)
    with pytest.raises(CheckpointSaveError) as err:
        _av_checkpoint(final, tiny_tokenizer, tiny_model_dir("llama"))
    msg = _one_line(err)
    assert msg.startswith(f"saving the checkpoint {final} failed: the disk is full (no space left on device; ")
    assert f"MB are free under {tmp_path} now). The previous checkpoint is intact" in msg
    assert sorted(p.name for p in final.iterdir()) == before  # the old one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["step_1"]  # no temporary dir left behind
    load_adapter_file(final, load_sidecar(final))
