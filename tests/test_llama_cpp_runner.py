"""LlamaCppRunner against the torch ModelRunner on the same weights: a tiny random Qwen2 written as an F32 GGUF file
(llama.cpp's qwen2 names, no Q/K permutation: qwen2 uses NeoX RoPE, as transformers does) and loaded both ways;
then the runner's input errors, and a short check on the real embedded Q4_K_M draft."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pytest
import torch

from dsde_core.errors import ConfigError, ModelLoadError
from dsde_core.models.llama import LlamaModel
from dsde_core.models.runner import ModelRunner
from tests.tiny_gguf import write_qwen2_gguf

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python==0.3.36)")

from dsde_core.models.llama_cpp import LlamaCppError, LlamaCppRunner, embedded_gguf, gguf_info  # noqa: E402

SLOTS, MAX_LEN = 4, 64


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b -> one printable character (what byte-level BPE vocabularies list)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = _byte_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS
VOCAB = len(TOKENS)  # 264


@lru_cache(maxsize=1)
def tiny_qwen2():
    """A transformers Qwen2 of random fp32 weights over the byte-level vocabulary above (no sliding window)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=False,
                         eos_token_id=VOCAB - 3, bos_token_id=VOCAB - 3)
    model = Qwen2ForCausalLM(config).float().eval()
    return config, {k: v.detach().clone() for k, v in model.state_dict().items()}


def write_gguf(path: Path) -> Path:
    """The tiny Qwen2 as llama.cpp's qwen2 architecture reads it: F32 tensors, [out, in] rows as in torch."""
    config, state = tiny_qwen2()
    return write_qwen2_gguf(path, config, state, TOKENS, MERGES, specials=len(SPECIALS))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("lcpp") / "tiny-qwen2-f32.gguf")


def torch_runner(num_slots: int = SLOTS, max_seq_len: int = MAX_LEN) -> ModelRunner:
    config, state = tiny_qwen2()
    return ModelRunner(LlamaModel.from_hf(config, dict(state), dtype=torch.float32), num_slots, max_seq_len)


def lcpp_runner(path: Path, num_slots: int = SLOTS, max_seq_len: int = MAX_LEN, **kw) -> LlamaCppRunner:
    return LlamaCppRunner(path, num_slots, max_seq_len, threads=2, **{**SETTINGS["fp32"][0], **kw})


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def same(ref: ModelRunner, run: LlamaCppRunner, slots: list[int], tokens: list[list[int]],
         num_logits: list[int], hidden: bool = False, tol: float = 1e-4) -> None:
    """Both runners take the same forward: logits within tol of the logits' scale, the same argmax wherever the
    reference's top two are further apart than 4 tol (all of them at fp32 precision)."""
    want = ref.forward(slots, tokens, num_logits)  # [N, V]
    got = run.head(run.forward(slots, tokens, num_logits, hidden=hidden))  # [N, V]
    assert got.dtype == torch.float32 and got.shape == want.shape == (sum(num_logits), VOCAB)
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tol * scale)
    top2 = want.topk(2, dim=-1).values  # [N, 2]
    clear = top2[:, 0] - top2[:, 1] > 4 * tol * scale  # [N]
    assert clear.float().mean() > 0.5 and torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])
    assert [run.length(s) for s in range(SLOTS)] == [ref.length(s) for s in range(SLOTS)]


# fp32 attention over an fp32 cache (no flash attention: llama.cpp casts K and V to f16 for it), and the runner's
# defaults (flash attention where llama.cpp picks it, an f16 cache: errors ~1e-3 of the logits' scale)
SETTINGS = {"fp32": (dict(kv_type="f32", flash_attn=False), 1e-4),
            "default": (dict(kv_type="f16", flash_attn=None), 5e-3)}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_matches_torch_runner(tiny_gguf: Path, setting: str) -> None:
    """Prefill, ragged prefills, decode, mixed verify, rollback and re-feed, reset, slots out of order."""
    kw, tol = SETTINGS[setting]
    ref, run = torch_runner(), lcpp_runner(tiny_gguf, **kw)
    assert run.vocab_size == VOCAB and run.cache.max_seq_len == MAX_LEN and run.n_ctx >= SLOTS * MAX_LEN
    same(ref, run, [0], [toks(7, 1)], [7], tol=tol)  # a prompt, every position's logits
    same(ref, run, [1, 2], [toks(12, 2), toks(3, 3)], [1, 2], tol=tol)  # ragged prefills
    same(ref, run, [0, 1, 2], [toks(1, 4), toks(1, 5), toks(1, 6)], [1, 1, 1], tol=tol)  # decode
    same(ref, run, [0, 1, 2], [toks(5, 7), toks(1, 8), toks(3, 9)], [5, 1, 3], hidden=True, tol=tol)  # verify, decode
    for r in (ref, run):  # rejections: keep a prefix, feed other tokens after it
        r.set_length(0, r.length(0) - 3)
        r.set_length(2, 4)
    same(ref, run, [2, 0], [toks(4, 10), toks(2, 11)], [4, 2], tol=tol)
    for r in (ref, run):
        r.reset(1)
    assert run.length(1) == 0
    same(ref, run, [1, 3], [toks(5, 12), toks(9, 13)], [5, 1], tol=tol)  # a fresh prompt in a reset slot, a new slot
    same(ref, run, [3, 1, 0, 2], [toks(1, 14), toks(2, 15), toks(1, 16), toks(6, 17)], [1, 2, 1, 3], tol=tol)
    run.close()


class CountingLib:
    """llama-cpp-python's module with llama_decode counted; `fail_at`: that call returns -3 instead."""

    def __init__(self, lib, fail_at: int | None = None) -> None:
        self.lib, self.calls, self.fail_at = lib, 0, fail_at

    def __getattr__(self, name: str):
        return getattr(self.lib, name)

    def llama_decode(self, ctx, batch) -> int:
        self.calls += 1
        return -3 if self.calls == self.fail_at else self.lib.llama_decode(ctx, batch)


@pytest.mark.parametrize(("n_batch", "max_outputs", "decodes"), [(8, 512, [3, 3]), (64, 3, [5, 2]), (8, 3, [5, 4])])
def test_forward_in_several_decodes(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch, n_batch: int,
                                    max_outputs: int, decodes: list[int]) -> None:
    """A forward of more tokens than one decode takes (n_batch) or more logits rows (max_outputs): several decodes
    in order, one result."""
    ref, run = torch_runner(), lcpp_runner(tiny_gguf, n_batch=n_batch, n_ubatch=4, max_outputs=max_outputs)
    assert run.n_batch == n_batch
    for (slots, tokens, num_logits), n in zip([([0, 1], [toks(13, 20), toks(6, 21)], [13, 2]),
                                               ([1, 0, 2], [toks(3, 22), toks(1, 23), toks(17, 24)], [3, 1, 1])],
                                              decodes, strict=True):
        lib = CountingLib(run._lib)
        monkeypatch.setattr(run, "_lib", lib)
        same(ref, run, slots, tokens, num_logits)
        assert lib.calls == n


def test_failed_decode_keeps_lengths(tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode failing after an earlier decode of the same forward succeeded: LlamaCppError, and the positions the
    forward added are gone (the next forward agrees with a runner that never saw it)."""
    ref, run = torch_runner(), lcpp_runner(tiny_gguf, n_batch=8)
    same(ref, run, [0], [toks(5, 30)], [1])

    monkeypatch.setattr(run, "_lib", CountingLib(run._lib, fail_at=2))
    with pytest.raises(LlamaCppError, match=r"llama_decode returned -3 \(fatal error\) on 12 tokens of slots \[0, 1\]"):
        run.forward([0, 1], [toks(4, 31), toks(8, 32)], [1, 1])
    assert run._lib.calls == 2 and run.length(0) == 5 and run.length(1) == 0
    same(ref, run, [0, 1], [toks(3, 33), toks(2, 34)], [3, 2])
    monkeypatch.undo()
    run._remove(0, 6)  # llama.cpp's cache now ends before the runner's length: llama.cpp refuses the next batch
    with pytest.raises(LlamaCppError, match=r"returned -1 \(invalid input batch\).*inconsistent sequence positions"):
        run.forward([0], [toks(1, 35)], [1])
    assert run.length(0) == 8


def test_quiet_by_default(tiny_gguf: Path, capfd: pytest.CaptureFixture) -> None:
    """llama.cpp writes nothing to stderr unless asked (quiet=False: its loader's lines)."""
    lcpp_runner(tiny_gguf).forward([0], [[1, 2]], [1])
    assert capfd.readouterr().err == ""
    LlamaCppRunner(tiny_gguf, 1, 16, quiet=False).close()
    assert "llama_model_loader" in capfd.readouterr().err
    lcpp_runner(tiny_gguf).close()  # quiet again (the log callback is the process's)
    assert capfd.readouterr().err == ""


def test_input_errors(tiny_gguf: Path) -> None:
    run = lcpp_runner(tiny_gguf, max_seq_len=16)
    run.forward([0], [toks(10, 40)], [1])
    bad = [
        (([], [], []), "at least one slot"),
        (([0], [[1], [2]], [1]), "one token list and one num_logits per slot"),
        (([1], [[]], [1]), "slot 1: empty token list"),
        (([1], [[1, 2]], [0]), r"slot 1: num_logits 0 must be in \[1, 2\]"),
        (([1], [[1, 2]], [3]), r"slot 1: num_logits 3 must be in \[1, 2\]"),
        (([1, 1], [[1], [2]], [1, 1]), r"forward got a slot twice: \[1, 1\]"),
        (([1], [[1, VOCAB]], [1]), rf"token ids must be in \[0, {VOCAB}\), got min 1 max {VOCAB}"),
        (([1], [[-1, 3]], [1]), rf"token ids must be in \[0, {VOCAB}\), got min -1 max 3"),
        (([0], [toks(7, 41)], [1]), "slot 0: 10 cached \\+ 7 new tokens = 17 exceeds max_seq_len 16"),
        (([SLOTS], [[1]], [1]), rf"slot {SLOTS} out of range \[0, {SLOTS}\)"),
    ]
    for args, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            run.forward(*args)
    assert [run.length(s) for s in range(SLOTS)] == [10, 0, 0, 0]
    with pytest.raises(ConfigError, match=r"set_length\(slot=0, n=11\): n must be in \[0, 10\]"):
        run.set_length(0, 11)
    with pytest.raises(ConfigError, match=r"slot -1 out of range"):
        run.reset(-1)
    run.forward([0], [toks(6, 42)], [1])  # the errors left the cache as it was: exactly 6 more fit
    assert run.length(0) == 16
    with pytest.raises(ConfigError, match=r"num_slots must be in \[1, 256\]"):
        LlamaCppRunner(tiny_gguf, 257, 16)
    with pytest.raises(ConfigError, match="kv_type must be one of f32, f16, bf16"):
        LlamaCppRunner(tiny_gguf, 1, 16, kv_type="q4")
    with pytest.raises(ModelLoadError, match="no GGUF file at"):
        LlamaCppRunner(tiny_gguf.with_name("missing.gguf"), 1, 16)


def test_gguf_info(tiny_gguf: Path) -> None:
    """Tokenizer and config from the GGUF's metadata alone, as the converted cache would hold them."""
    info = gguf_info(str(tiny_gguf))
    config, _ = tiny_qwen2()
    c = info.hf_config
    assert c.model_type == "qwen2" and info.path == str(tiny_gguf)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) \
        == (config.hidden_size, 2, 4, 2, config.intermediate_size)
    assert info.tokenizer.get_vocab() == {t: i for i, t in enumerate(TOKENS)}
    assert info.tokenizer.convert_ids_to_tokens(VOCAB - 3) == "<|endoftext|>"


# ---- the real embedded draft (Q4_K_M) ----

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


@pytest.fixture(scope="module")
def draft_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dsde_core.models.loader import DEFAULT_DRAFT

    return embedded_gguf(DEFAULT_DRAFT, root=tmp_path_factory.mktemp("joined"))


@pytest.mark.real_models
def test_real_draft_batching_and_rollback(draft_gguf: Path) -> None:
    """Greedy 16 tokens by single-token forwards == the argmaxes of one prompt forward plus one 16-token verify
    forward; then the same after a rollback, and beside another slot's prefill."""
    from dsde_core.models.loader import DEFAULT_DRAFT

    info = gguf_info(DEFAULT_DRAFT, root=draft_gguf.parent.parent)
    prompt = info.tokenizer(PROMPT)["input_ids"]
    run = LlamaCppRunner(draft_gguf, 2, 256, threads=2)
    assert run.vocab_size == info.hf_config.vocab_size == 151936
    out = [int(run.forward([0], [prompt], [1])[0].argmax())]
    for _ in range(15):
        out.append(int(run.forward([0], [[out[-1]]], [1])[0].argmax()))
    run.set_length(0, len(prompt) - 1)  # rollback: re-feed the prompt's last token with the 16 drafts
    verify = run.forward([0], [prompt[-1:] + out], [17]).argmax(-1).tolist()  # [17]
    assert verify[:16] == out
    run.reset(0)
    first = run.forward([1, 0], [prompt[:5], prompt], [1, 1]).argmax(-1).tolist()  # ragged, slot 1 beside slot 0
    assert first[1] == out[0]
    run.close()


@pytest.mark.real_models
def test_real_draft_agrees_with_torch(draft_gguf: Path) -> None:
    """The first greedy token of a simple prompt: llama.cpp on the Q4_K_M file == the torch bf16 runner on its
    conversion."""
    from dsde_core.models.loader import DEFAULT_DRAFT, load_model

    loaded = load_model(DEFAULT_DRAFT)
    prompt = loaded.tokenizer("The capital of France is")["input_ids"]
    want = int(ModelRunner(loaded.model, 1, 64).forward([0], [prompt], [1])[0].argmax())
    run = LlamaCppRunner(draft_gguf, 1, 64, threads=2)
    assert int(run.forward([0], [prompt], [1])[0].argmax()) == want
    run.close()


def test_a_prompt_prefilled_apart_lands_in_its_slot(tiny_gguf: Path) -> None:
    """Where the weights are repacked, a fresh prompt of PLAIN_PREFILL tokens or more is prefilled by a plain-layout
    copy of the model and its keys and values copied into the slot: the forward's logits, and every forward after
    it, are the torch runner's; rows beside it decode in the same call, in order."""
    from dsde_core.models.llama_cpp import PLAIN_PREFILL

    tol = SETTINGS["fp32"][1]
    ref, run = torch_runner(), lcpp_runner(tiny_gguf)
    run._plain = lcpp_runner(tiny_gguf, num_slots=1)  # as a repacked model has (tiny F32 files have no Q4_K)
    prefill = run._prefill_plain
    calls = []
    run._prefill_plain = lambda *a: calls.append(a[0]) or prefill(*a)
    same(ref, run, [1], [toks(3, 50)], [1], tol=tol)
    same(ref, run, [0, 1], [toks(PLAIN_PREFILL + 2, 51), toks(2, 52)], [2, 1], tol=tol)  # apart, beside a decode
    assert calls == [0] and run.length(0) == PLAIN_PREFILL + 2
    same(ref, run, [1, 0], [toks(1, 53), toks(4, 54)], [1, 4], tol=tol)  # the copied cache serves the next forwards
    for r in (ref, run):
        r.set_length(0, 10)
    same(ref, run, [0], [toks(3, 55)], [3], tol=tol)  # and rolls back like any other
    same(ref, run, [2], [toks(PLAIN_PREFILL - 1, 56)], [1], tol=tol)  # shorter: this context's own decode
    assert calls == [0]
    run.close()
