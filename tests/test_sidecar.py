import math
from pathlib import Path

import pytest
import yaml

from nla.core.sidecar import NLAConfig, load_sidecar, resolve_sidecar, sidecar_path_for, write_sidecar
from nla.core.sidecar_errors import (
    ARSuffixMismatchError,
    MarkerCountError,
    MarkerIdMismatchError,
    MarkerIsUnknownError,
    MarkerNotSingleTokenError,
    NeighborMismatchError,
    SidecarError,
    SidecarMismatchError,
)
from nla.core.templates import (
    AV_PLACEHOLDER,
    DEFAULT_AR_TEMPLATE,
    DEFAULT_AV_TEMPLATE,
    DEFAULT_INJECTION_CHAR,
)
from nla.core.token_ids import verify_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
AV_TPL = "Here is a hidden state <{injection_char}> from a language model. Explain what it encodes."
AR_TPL = "<explanation>{explanation}</explanation> <summary>"


def test_published_av_fixture_parses():
    # The AV layout of the published docs: no role, no layer, no AR fields.
    cfg = load_sidecar(FIXTURES / "published_av.nla_meta.yaml")
    assert cfg == NLAConfig(
        kind="nla_model", role=None, d_model=3584, injection_char="㈎", injection_token_id=149705,
        injection_left_neighbor_id=29, injection_right_neighbor_id=522,
        av_template="...<concept>{injection_char}</concept>...", injection_scale=150.0,
    )
    assert (cfg.layer_index, cfg.critic_suffix_ids, cfg.ar_template) == (None, None, None)
    assert cfg.mse_scale_value() == pytest.approx(math.sqrt(3584))  # absent = sqrt_d_model
    assert cfg.need_av("verbalizing") is cfg
    with pytest.raises(SidecarError, match=r"building an AR needs the extraction layer K.*records none"):
        cfg.need_layer("building an AR")
    with pytest.raises(SidecarError, match=r"scoring needs the AR fields .*tokens.critic_suffix_ids"):
        cfg.need_ar("scoring")
    with pytest.raises(SidecarError, match="the AR text needs the AR fields"):
        cfg.ar_text("x")


def test_published_ar_fixture_parses_layer_from_ar_num_hidden_layers():
    # The AR layout of the published docs: ar.num_hidden_layers is K itself, no injection fields.
    cfg = load_sidecar(FIXTURES / "published_ar.nla_meta.yaml")
    assert cfg == NLAConfig(
        kind="nla_model", role="ar", d_model=3584, layer_index=20, critic_suffix_ids=(1318, 29, 366, 1708, 29),
        ar_template="Summary of the following text: <text>{explanation}</text> <summary>", mse_scale=59.87,
    )
    assert cfg.injection_char is None and cfg.injection_scale is None and cfg.av_template is None
    assert cfg.need_layer("building an AR") == 20 and cfg.mse_scale_value() == 59.87
    with pytest.raises(SidecarError, match="injection needs the AV fields"):
        cfg.need_av("injection")


@pytest.mark.parametrize(("role", "template_key"), [("critic", "critic"), ("ar", "ar"), ("critic", "ar")])
def test_published_critic_sidecar_with_the_shared_tokens_block_parses(tmp_path, role, template_key):
    """Issue 21: a published critic sidecar carries the tokens block but no AV template; nla said
    "the AV fields come together" and stopped. The AR never injects: read as the AR it is."""
    doc = yaml.safe_load((FIXTURES / "published_critic.nla_meta.yaml").read_text())
    doc["role"] = role
    doc["prompt_templates"] = {template_key: doc["prompt_templates"]["critic"]}
    path = tmp_path / "nla_meta.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    cfg = load_sidecar(path)
    assert cfg == NLAConfig(
        kind="nla_model", role="ar", d_model=3584, layer_index=20, critic_suffix_ids=(1318, 29, 366, 1708, 29),
        ar_template="Summary of the following text: <text>{explanation}</text> <summary>", mse_scale=59.87,
        base_model="Qwen/Qwen2.5-7B-Instruct",
    )
    assert cfg.need_ar("scoring") is cfg and cfg.need_layer("building an AR") == 20
    with pytest.raises(SidecarError, match="injection needs the AV fields"):
        cfg.need_av("injection")
    # written back, it is the documented AR layout, which reads the same
    write_sidecar(tmp_path / "out", cfg)
    assert load_sidecar(tmp_path / "out") == cfg


def test_an_av_sidecar_missing_its_template_is_still_refused(tmp_path):
    # the relaxation is for the AR only: an AV with the marker but no template cannot inject
    doc = yaml.safe_load((FIXTURES / "published_critic.nla_meta.yaml").read_text())
    doc["role"] = "av"
    doc["extraction"]["injection_scale"] = 150.0
    (tmp_path / "nla_meta.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
    with pytest.raises(SidecarError, match=r"the AV fields come together; .* but not prompt_templates.av"):
        load_sidecar(tmp_path / "nla_meta.yaml")


def test_full_av_fixture_parses():
    cfg = load_sidecar(FIXTURES / "full_av.nla_meta.yaml")
    assert cfg == NLAConfig(
        kind="nla_model", role="av", d_model=3584, layer_index=20, injection_char="㈎",
        injection_token_id=149705, injection_left_neighbor_id=29, injection_right_neighbor_id=522,
        critic_suffix_ids=(522, 1708, 29), av_template=AV_TPL, ar_template=AR_TPL,
        injection_scale=150.0, mse_scale=59.87, base_model="Qwen/Qwen2.5-7B-Instruct",
        training={"lr": 1.41e-05, "step": 1200},
    )
    assert cfg.injection_scale_value() == 150.0 and cfg.mse_scale_value() == 59.87


def test_older_writer_ar_fixture_parses_critic_keys_and_defaults():
    cfg = load_sidecar(FIXTURES / "older_writer_ar.nla_meta.yaml")
    assert (cfg.role, cfg.d_model, cfg.layer_index) == ("ar", 3584, 20)
    assert cfg.av_template == AV_TPL and cfg.ar_template == AR_TPL
    assert cfg.injection_scale is None
    assert cfg.mse_scale == "sqrt_d_model"
    assert cfg.mse_scale_value() == pytest.approx(math.sqrt(3584))  # 59.866...


def _published_ar_doc() -> dict:
    return yaml.safe_load((FIXTURES / "published_ar.nla_meta.yaml").read_text())


@pytest.mark.parametrize(
    ("layer_keys", "expected"),
    [
        ({"ar": {"num_hidden_layers": 7}}, 7),  # published: K
        ({"critic": {"num_hidden_layers": 7}}, 7),  # older writers: K
        ({"critic": {"extraction_layer_index": 7}}, 7),
        ({"extraction": {"layer_index": 7}, "ar": {"num_hidden_layers": 8}}, 7),  # nla before: K and K+1
        ({"extraction": {"layer_index": 7}, "ar": {"num_hidden_layers": 7}}, 7),  # nla now: K and K
        ({}, None),  # no layer at all: allowed, demanded only where used
    ],
)
def test_layer_keys(tmp_path, layer_keys, expected):
    doc = _published_ar_doc()
    del doc["ar"]
    for key, sub in layer_keys.items():
        doc.setdefault(key, {}).update(sub)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    assert load_sidecar(tmp_path / "s.yaml").layer_index == expected


@pytest.mark.parametrize(
    ("layer_keys", "message"),
    [
        ({"extraction": {"layer_index": 7}, "ar": {"num_hidden_layers": 9}},
         r"ar.num_hidden_layers = 9 disagrees with extraction.layer_index = 7"),
        ({"extraction": {"layer_index": 7}, "critic": {"extraction_layer_index": 6}},
         r"two different layers \(extraction.layer_index = 7, critic.extraction_layer_index = 6\)"),
        ({"ar": {"num_hidden_layers": "twenty"}}, r"ar.num_hidden_layers: expected a non-negative int.*'twenty'"),
    ],
)
def test_contradictory_or_bad_layer_keys_are_refused(tmp_path, layer_keys, message):
    doc = _published_ar_doc()
    del doc["ar"]
    for key, sub in layer_keys.items():
        doc.setdefault(key, {}).update(sub)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SidecarError, match=message):
        load_sidecar(tmp_path / "s.yaml")


def test_role_needs_its_fields_and_groups_come_whole(tmp_path):
    doc = _published_ar_doc()
    del doc["tokens"]["critic_suffix_ids"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SidecarError, match=r"AR fields come together; found prompt_templates.ar but not "
                                           r"tokens.critic_suffix_ids"):
        load_sidecar(tmp_path / "s.yaml")
    del doc["prompt_templates"]["ar"]
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(SidecarError, match=r"role 'ar' needs the AR fields"):
        load_sidecar(tmp_path / "s.yaml")


def test_written_layouts_round_trip_and_follow_the_published_keys(tmp_path):
    ar = load_sidecar(FIXTURES / "published_ar.nla_meta.yaml")
    write_sidecar(tmp_path / "ar", ar)
    doc = yaml.safe_load((tmp_path / "ar" / "nla_meta.yaml").read_text())
    assert doc["ar"] == {"num_hidden_layers": 20} and doc["extraction"]["layer_index"] == 20  # both K
    assert set(doc["tokens"]) == {"critic_suffix_ids"} and set(doc["prompt_templates"]) == {"ar"}
    assert load_sidecar(tmp_path / "ar") == ar
    av = load_sidecar(FIXTURES / "published_av.nla_meta.yaml")
    write_sidecar(tmp_path / "av", av)
    doc = yaml.safe_load((tmp_path / "av" / "nla_meta.yaml").read_text())
    assert "layer_index" not in doc["extraction"] and "critic_suffix_ids" not in doc["tokens"] and "ar" not in doc
    # an absent mse_scale means sqrt_d_model; it is written as that number (readers take float(...))
    assert av.mse_scale == "sqrt_d_model" and doc["extraction"]["mse_scale"] == math.sqrt(3584)
    assert load_sidecar(tmp_path / "av") == av.replace(mse_scale=math.sqrt(3584))


def test_messages_and_ar_text():
    cfg = load_sidecar(FIXTURES / "full_av.nla_meta.yaml")
    assert cfg.av_messages() == [{"role": "user", "content": AV_TPL.format(injection_char="㈎")}]
    assert cfg.av_messages(AV_PLACEHOLDER)[0]["content"].startswith("Here is a hidden state <<INJECT>>")
    assert cfg.ar_text("hi") == "<explanation>hi</explanation> <summary>"


def test_write_then_load_roundtrip_with_provenance(tmp_path):
    cfg = load_sidecar(FIXTURES / "full_av.nla_meta.yaml")
    out = write_sidecar(tmp_path, cfg, step=5, parent=tmp_path / "x")
    assert out == tmp_path / "nla_meta.yaml"
    back = load_sidecar(tmp_path)
    assert back == cfg.replace(training={"lr": 1.41e-05, "step": 5, "parent": str(tmp_path / "x")})
    # dataset layout: d_model under extraction, file beside the parquet
    ds = cfg.replace(kind="nla_dataset", role=None)
    write_sidecar(tmp_path / "rl.parquet", ds)
    assert (tmp_path / "rl.parquet.nla_meta.yaml").is_file()
    doc = yaml.safe_load((tmp_path / "rl.parquet.nla_meta.yaml").read_text())
    assert doc["extraction"]["d_model"] == 3584 and "d_model" not in doc
    assert load_sidecar(tmp_path / "rl.parquet") == ds
    assert not list(tmp_path.glob("*.tmp"))  # no temp file left behind


def test_missing_key_names_key_and_file(tmp_path):
    doc = yaml.safe_load((FIXTURES / "full_av.nla_meta.yaml").read_text())
    del doc["tokens"]["injection_right_neighbor_id"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc, allow_unicode=True))
    with pytest.raises(SidecarError, match=r"tokens.injection_right_neighbor_id.*") as info:
        load_sidecar(bad)
    assert str(bad) in str(info.value)
    # an AV sidecar must record its injection scale (null is allowed, absence is not)
    doc = yaml.safe_load((FIXTURES / "full_av.nla_meta.yaml").read_text())
    del doc["extraction"]["injection_scale"]
    bad.write_text(yaml.safe_dump(doc, allow_unicode=True))
    with pytest.raises(SidecarError, match="injection_scale"):
        load_sidecar(bad)


def test_bad_values_name_the_field(tmp_path):
    cfg = load_sidecar(FIXTURES / "full_av.nla_meta.yaml")
    with pytest.raises(ValueError, match="NLAConfig.role"):
        cfg.replace(role="critic")
    with pytest.raises(ValueError, match="NLAConfig.mse_scale.*'sqrt_dmodel'"):
        cfg.replace(mse_scale="sqrt_dmodel")
    with pytest.raises(ValueError, match="NLAConfig.ar_template"):
        cfg.replace(ar_template="{explanation}")  # no constant tail
    with pytest.raises(ValueError, match="NLAConfig.av_template"):
        cfg.replace(av_template="no marker here")


def test_sidecar_path_for_and_resolve(tmp_path):
    assert sidecar_path_for(tmp_path) == tmp_path / "nla_meta.yaml"
    assert sidecar_path_for(tmp_path / "a.parquet") == tmp_path / "a.parquet.nla_meta.yaml"
    cfg = load_sidecar(FIXTURES / "full_av.nla_meta.yaml")
    ckpt, data = tmp_path / "ckpt", tmp_path / "d.parquet"
    ckpt.mkdir()
    write_sidecar(data, cfg.replace(kind="nla_dataset", role=None, layer_index=3))
    # only the dataset's exists -> dataset
    assert resolve_sidecar(checkpoint=ckpt, dataset=data).layer_index == 3
    write_sidecar(ckpt, cfg.replace(layer_index=4))
    assert resolve_sidecar(checkpoint=ckpt, dataset=data).layer_index == 4  # checkpoint beats dataset
    assert resolve_sidecar(FIXTURES / "published_ar.nla_meta.yaml", ckpt, data).role == "ar"  # explicit wins
    with pytest.raises(FileNotFoundError, match="tried checkpoint: .*nope.*dataset: .*x.parquet"):
        resolve_sidecar(checkpoint=tmp_path / "nope", dataset=tmp_path / "x.parquet")
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        resolve_sidecar(tmp_path / "missing.yaml", checkpoint=ckpt)


# --- live tokenizer -------------------------------------------------------------------------------
def _cfg(tok, **kw):
    args = dict(kind="nla_model", role="av", d_model=32, layer_index=1, av_template=DEFAULT_AV_TEMPLATE,
                ar_template=DEFAULT_AR_TEMPLATE, injection_char=DEFAULT_INJECTION_CHAR, injection_scale="sqrt_d_model")
    args.update(kw)
    return NLAConfig.from_tokenizer(tok, **args)


def test_from_tokenizer_computes_ids(tiny_tokenizer):
    cfg = _cfg(tiny_tokenizer)
    conv = tiny_tokenizer.convert_tokens_to_ids
    assert cfg.injection_token_id == conv(DEFAULT_INJECTION_CHAR)
    # template "...<<{c}>>..." with punctuation split: neighbours are "<" and ">"
    assert cfg.injection_left_neighbor_id == conv("<") and cfg.injection_right_neighbor_id == conv(">")
    # tail "\nSummary vector:" -> Summary, vector, ":"
    assert cfg.critic_suffix_ids == tuple(conv(["Summary", "vector", ":"]))
    assert cfg.injection_scale_value() == pytest.approx(math.sqrt(32))
    verify_tokenizer(cfg, tiny_tokenizer)  # passes


def test_verify_marker_several_tokens(tiny_tokenizer):
    with pytest.raises(MarkerNotSingleTokenError, match=r"injection_char.*exactly 1 token, found 2"):
        _cfg(tiny_tokenizer, injection_char="cat dog")


def test_verify_marker_unknown(tiny_tokenizer):
    with pytest.raises(MarkerIsUnknownError, match="UNK"):
        _cfg(tiny_tokenizer, injection_char="zebra")


def test_verify_marker_id_mismatch(tiny_tokenizer):
    cfg = _cfg(tiny_tokenizer).replace(injection_token_id=999)
    with pytest.raises(MarkerIdMismatchError, match=r"injection_token_id: the sidecar records 999"):
        verify_tokenizer(cfg, tiny_tokenizer)


def test_verify_marker_count(tiny_tokenizer):
    cfg = _cfg(tiny_tokenizer)
    # a system-ish second copy of the marker in the template
    two = cfg.replace(av_template="<<{injection_char}>> and " + DEFAULT_INJECTION_CHAR)
    with pytest.raises(MarkerCountError, match="found 2 times"):
        verify_tokenizer(two, tiny_tokenizer)


def test_verify_neighbor_drift(tiny_tokenizer):
    cfg = _cfg(tiny_tokenizer)
    drift = cfg.replace(av_template="Explain the hidden state ({injection_char}) in a few short sentences.")
    with pytest.raises(NeighborMismatchError, match="injection_left_neighbor_id: the sidecar records"):
        verify_tokenizer(drift, tiny_tokenizer)
    right = cfg.replace(injection_right_neighbor_id=cfg.injection_right_neighbor_id + 1)
    with pytest.raises(NeighborMismatchError, match="injection_right_neighbor_id"):
        verify_tokenizer(right, tiny_tokenizer)


def test_verify_ar_suffix(tiny_tokenizer):
    cfg = _cfg(tiny_tokenizer)
    read = cfg.critic_suffix_ids[-1]
    bad = cfg.replace(critic_suffix_ids=(1, 2, 3))  # another read token
    with pytest.raises(ARSuffixMismatchError, match=r"reads its prediction at the last token .* the sidecar records 3 "):
        verify_tokenizer(bad, tiny_tokenizer)
    bad = cfg.replace(critic_suffix_ids=(1, 2, read))  # the read token, but another id before it
    with pytest.raises(ARSuffixMismatchError, match=rf"the sidecar records \[1, 2, {read}\] .* the last 3 ids"):
        verify_tokenizer(bad, tiny_tokenizer)


def test_error_classes_are_distinct_value_errors():
    classes = {MarkerNotSingleTokenError, MarkerIsUnknownError, MarkerIdMismatchError, MarkerCountError,
               NeighborMismatchError, ARSuffixMismatchError}
    assert len(classes) == 6
    assert all(issubclass(c, SidecarMismatchError) and issubclass(c, ValueError) for c in classes)


def test_edited_template_is_refused(tmp_path):
    cfg = load_sidecar(FIXTURES / "full_av.nla_meta.yaml")
    write_sidecar(tmp_path, cfg)
    doc = yaml.safe_load((tmp_path / "nla_meta.yaml").read_text())
    assert set(doc["prompt_template_sha256"]) == {"av", "ar"}
    # An edit that keeps the marker's neighbours ("<" and ">") passes every token check; the digest catches it.
    doc["prompt_templates"]["av"] = doc["prompt_templates"]["av"].replace("Explain what it encodes.", "Be brief.")
    (tmp_path / "nla_meta.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
    with pytest.raises(SidecarError, match=r"prompt_templates.av was edited after this sidecar was written"):
        load_sidecar(tmp_path)
    del doc["prompt_template_sha256"]  # a deliberate change: the user drops the record
    (tmp_path / "nla_meta.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True))
    assert load_sidecar(tmp_path).av_template.endswith("Be brief.")


def test_fix_tokens_rederives_drifted_ids_only_when_asked(tiny_tokenizer, tmp_path, capsys):
    """A sidecar written for another tokenizer version (its marker and suffix ids differ from the
    live tokenizer's): loads refuse it; `nla sidecar fix-tokens` shows the change, and writes it
    (those keys only, the old file kept) only with --write."""
    from nla.cli import main
    from nla.core.sidecar import SIDECAR_NAME

    ckpt = tmp_path / "ckpt"
    tiny_tokenizer.save_pretrained(ckpt)
    good = _cfg(tiny_tokenizer)
    write_sidecar(ckpt, good)
    path = ckpt / SIDECAR_NAME
    doc = yaml.safe_load(path.read_text())
    right_id, right_suffix = doc["tokens"]["injection_token_id"], doc["tokens"]["critic_suffix_ids"]
    doc["tokens"]["injection_token_id"] = right_id + 7  # as an older tokenizer numbered the marker
    doc["tokens"]["critic_suffix_ids"] = [1, 2]
    doc["extraction"]["note"] = "a key nla does not write, kept"
    path.write_text(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))
    drifted = path.read_text()
    with pytest.raises(MarkerIdMismatchError):
        verify_tokenizer(load_sidecar(ckpt), tiny_tokenizer)

    assert main(["sidecar", "fix-tokens", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert f"tokens.injection_token_id: {right_id + 7} -> {right_id}" in out
    assert f"tokens.critic_suffix_ids: [1, 2] -> {right_suffix}" in out and "not written" in out
    assert path.read_text() == drifted  # a dry run changes nothing

    assert main(["sidecar", "fix-tokens", str(ckpt), "--write"]) == 0
    fixed = yaml.safe_load(path.read_text())
    assert fixed["tokens"]["injection_token_id"] == right_id and fixed["tokens"]["critic_suffix_ids"] == right_suffix
    doc["tokens"].update(injection_token_id=right_id, critic_suffix_ids=right_suffix)
    assert fixed == doc and list(fixed) == list(doc)  # every other key, and the order, as written
    assert (ckpt / (SIDECAR_NAME + ".bak")).read_text() == drifted
    verify_tokenizer(load_sidecar(ckpt), tiny_tokenizer)  # loads again
    assert main(["sidecar", "fix-tokens", str(ckpt)]) == 0
    assert "nothing to change" in capsys.readouterr().out


def test_fix_tokens_on_a_dataset_needs_the_tokenizer(tiny_tokenizer, tmp_path, capsys):
    from nla.cli import main

    ds = tmp_path / "d.parquet"
    ds.write_bytes(b"")
    write_sidecar(ds, _cfg(tiny_tokenizer).replace(kind="nla_dataset", role=None))
    assert main(["sidecar", "fix-tokens", str(ds)]) == 2
    assert "--tokenizer: " in capsys.readouterr().err
    tok = tmp_path / "tok"
    tiny_tokenizer.save_pretrained(tok)
    assert main(["sidecar", "fix-tokens", str(ds), "--tokenizer", str(tok)]) == 0
    assert "nothing to change" in capsys.readouterr().out
