"""ModelRunner vs transformers' own forward, on tiny random Llama / Qwen2 / Mistral models (fp32)."""

from __future__ import annotations

import pytest
import torch

from dsde_core.errors import ConfigError
from dsde_core.models.llama import LlamaModel
from dsde_core.models.runner import ALONE_Q, ModelRunner

TOL = 1e-4


class Checked:
    """A runner plus the token history of each slot; every forward is checked against transformers."""

    def __init__(self, hf, num_slots: int = 4, max_seq_len: int = 64, prepack: bool | None = None,
                 attention: str = "torch") -> None:
        self.hf = hf
        model = LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.float32, prepack=prepack)
        assert prepack is None or model.packed == prepack
        self.runner = ModelRunner(model, num_slots=num_slots, max_seq_len=max_seq_len, attention=attention)
        self.seqs: dict[int, list[int]] = {s: [] for s in range(num_slots)}

    @torch.no_grad()
    def reference(self, seq: list[int]) -> torch.Tensor:
        return self.hf(torch.tensor([seq])).logits[0]  # [L, V]

    def forward(self, feed: dict[int, list[int]], num_logits: list[int] | None = None) -> torch.Tensor:
        slots, tokens = list(feed), list(feed.values())
        num_logits = num_logits or [len(t) for t in tokens]
        out = self.runner.forward(slots, tokens, num_logits)
        assert out.dtype == torch.float32 and out.shape == (sum(num_logits), self.runner.vocab_size)
        row = 0
        for s, t, n in zip(slots, tokens, num_logits, strict=True):
            self.seqs[s] = self.seqs[s] + t
            assert self.runner.length(s) == len(self.seqs[s])
            ref = self.reference(self.seqs[s])[-n:]
            diff = (out[row : row + n] - ref).abs().max().item()
            assert diff < TOL, f"slot {s}: max abs diff {diff}"
            row += n
        return out

    def rollback(self, slot: int, n: int) -> None:
        self.runner.set_length(slot, n)
        self.seqs[slot] = self.seqs[slot][:n]


def rand_tokens(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.mark.parametrize("prepack", [False, None], ids=["plain", "packed-if-available"])
def test_ragged_prefill_decode_verify_rollback(arch: str, prepack: bool | None, make_tiny_model) -> None:
    g = torch.Generator().manual_seed(1)
    c = Checked(make_tiny_model(arch), prepack=prepack)
    # ragged prefill of different lengths in one call
    c.forward({0: rand_tokens(g, 11), 1: rand_tokens(g, 3), 2: rand_tokens(g, 17)})
    # prefill + single-token decode + multi-token verification, mixed, in another slot order
    c.forward({3: rand_tokens(g, 9), 0: rand_tokens(g, 1), 2: rand_tokens(g, 5)}, num_logits=[2, 1, 5])
    # rollback: drop the last 3 tokens of slot 2 and feed different ones
    c.rollback(2, c.runner.length(2) - 3)
    c.forward({2: rand_tokens(g, 4), 1: rand_tokens(g, 2)})
    # uniform decode over all slots, several steps (lengths pass the sliding windows)
    for _ in range(4):
        c.forward({s: rand_tokens(g, 1) for s in (1, 0, 3, 2)})
    # single-sequence calls: decode and verification chunks, with a rollback in between
    c.forward({1: rand_tokens(g, 1)})
    c.forward({1: rand_tokens(g, 6)}, num_logits=[6])
    c.rollback(1, c.runner.length(1) - 5)
    c.forward({1: rand_tokens(g, 3)}, num_logits=[2])
    # reset a slot and reuse it for a new sequence
    c.runner.reset(0)
    c.seqs[0] = []
    c.forward({0: rand_tokens(g, 12), 3: rand_tokens(g, 2)})


def test_long_queries_attend_apart_from_the_rest(arch: str, make_tiny_model, monkeypatch) -> None:
    """A query longer than ALONE_Q (a prompt) attends in its own SDPA call, over its own keys only; the rows decoding
    and verifying beside it share one call, padded to their longest. Every logit still equals transformers'."""
    import dsde_core.models.llama as llama

    calls: list[tuple[int, int, int]] = []  # (sequences, query rows, keys) of each attention call
    causal: list[int] = []  # query rows of each call with SDPA's own causal mask
    sdpa = llama.F.scaled_dot_product_attention

    def spy(q: torch.Tensor, k: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append((q.shape[0], q.shape[2], k.shape[2]))
        if kwargs.get("is_causal"):
            assert kwargs.get("attn_mask") is None
            causal.append(q.shape[2])
        return sdpa(q, k, *args, **kwargs)

    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", spy)
    g = torch.Generator().manual_seed(4)
    c = Checked(make_tiny_model(arch), max_seq_len=256)
    layers = c.hf.config.num_hidden_layers
    c.forward({1: rand_tokens(g, 20), 2: rand_tokens(g, 30), 3: rand_tokens(g, 5)})
    assert set(calls) == {(3, 30, 30)}  # no long query: one call, as always
    long = ALONE_Q + 26
    calls.clear()  # a prompt beside a decoding row and a verifying one, between them in the batch's order
    c.forward({1: rand_tokens(g, 1), 0: rand_tokens(g, long), 3: rand_tokens(g, 4)}, num_logits=[1, 3, 4])
    assert sorted(calls) == sorted([(1, long, long), (2, 4, 21)] * layers)
    # from position 0 and inside every window (none for llama), the prompt takes SDPA's causal mask
    assert causal == ([long] * layers if arch == "llama" else [])
    calls.clear()  # two prompts (one in a slot that holds tokens already) and a decoding row
    c.runner.reset(2)
    c.seqs[2] = []
    c.forward({2: rand_tokens(g, ALONE_Q + 1), 0: rand_tokens(g, ALONE_Q + 5), 1: rand_tokens(g, 1)})
    assert sorted(calls) == sorted([(1, ALONE_Q + 1, ALONE_Q + 1), (1, ALONE_Q + 5, long + ALONE_Q + 5), (1, 1, 22)]
                                   * layers)
    calls.clear()  # a long prompt alone in the batch
    c.forward({3: rand_tokens(g, long)})
    assert set(calls) == {(1, long, long + 9)}
    for _ in range(2):  # then decode, all rows in one call again
        c.forward({s: rand_tokens(g, 1) for s in range(4)})


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_sliding_window_matters(arch: str, make_tiny_model) -> None:
    """The windowed reference differs from full attention at these lengths, so the test above has teeth."""
    g = torch.Generator().manual_seed(2)
    seq = torch.tensor([rand_tokens(g, 20)])
    windowed, full = make_tiny_model(arch), make_tiny_model(arch, sliding_window=None)
    with torch.no_grad():
        assert (windowed(seq).logits - full(seq).logits).abs().max() > 1e-2


def test_num_logits_returns_last_positions(arch: str, make_tiny_model) -> None:
    g = torch.Generator().manual_seed(3)
    hf = make_tiny_model(arch)
    a = Checked(hf)
    b = Checked(hf)
    t0, t1 = rand_tokens(g, 10), rand_tokens(g, 7)
    full = a.runner.forward([0, 1], [t0, t1], [10, 7])
    part = b.runner.forward([0, 1], [t0, t1], [3, 1])
    assert part.shape == (4, 256)
    torch.testing.assert_close(part[:3], full[7:10], atol=TOL, rtol=0)
    torch.testing.assert_close(part[3:], full[16:17], atol=TOL, rtol=0)


def test_errors(make_tiny_model) -> None:
    c = Checked(make_tiny_model("qwen2"), num_slots=2, max_seq_len=16)
    r = c.runner
    r.forward([0], [list(range(10))], [1])
    with pytest.raises(ConfigError, match="exceeds max_seq_len 16"):
        r.forward([1, 0], [[1], list(range(7))], [1, 1])
    assert r.length(0) == 10 and r.length(1) == 0  # a failed call changes nothing
    r.forward([0], [list(range(6))], [1])  # exactly full is fine
    with pytest.raises(ConfigError, match="num_logits"):
        r.forward([1], [[1, 2]], [3])
    with pytest.raises(ConfigError, match="twice"):
        r.forward([1, 1], [[1], [2]], [1, 1])
    with pytest.raises(ConfigError, match="empty"):
        r.forward([1], [[]], [1])
    with pytest.raises(ConfigError, match="token ids"):
        r.forward([1], [[256]], [1])
    with pytest.raises(ConfigError, match="slot 2 out of range"):
        r.forward([2], [[1]], [1])
    with pytest.raises(ConfigError, match="current length"):
        r.set_length(1, 1)


def test_bf16_runs_without_nan(make_tiny_model) -> None:
    hf = make_tiny_model("mistral")
    model = LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.bfloat16)
    r = ModelRunner(model, num_slots=3, max_seq_len=32)
    out = r.forward([0, 1, 2], [list(range(20)), [5], list(range(3))], [20, 1, 3])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    ref = hf(torch.tensor([list(range(20))])).logits[0]
    assert (out[:20] - ref).abs().max() < 0.1


def test_single_query_steps_attend_in_fp32_on_cpu(make_tiny_model, monkeypatch) -> None:
    """bf16 on the CPU: a step where every row has one query (decode, draft levels) computes attention in fp32,
    any other step in bf16; both give transformers' fp32 logits to bf16's precision."""
    import dsde_core.models.llama as llama

    seen: list[tuple[int, torch.dtype]] = []  # (query rows, dtype) of each attention call
    sdpa = llama.F.scaled_dot_product_attention

    def spy(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        seen.append((q.shape[2], q.dtype))
        return sdpa(q, *args, **kwargs)

    monkeypatch.setattr(llama.F, "scaled_dot_product_attention", spy)
    hf = make_tiny_model("qwen2")
    layers = hf.config.num_hidden_layers

    def dtypes(r: ModelRunner, slots: list[int], tokens: list[list[int]]) -> set[torch.dtype]:
        seen.clear()
        r.forward(slots, tokens, [1] * len(slots))
        assert len(seen) == layers
        return {dt for _, dt in seen}

    bf16 = ModelRunner(LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.bfloat16), 2, 32)
    assert bf16.upcast_single_query
    assert dtypes(bf16, [0, 1], [list(range(9)), list(range(4))]) == {torch.bfloat16}  # ragged prefill
    assert dtypes(bf16, [0, 1], [[9], [4]]) == {torch.float32}  # decode, batched
    assert dtypes(bf16, [0, 1], [[10], [5, 6]]) == {torch.bfloat16}  # one row verifies two tokens
    assert dtypes(bf16, [1], [[7]]) == {torch.float32}  # decode, one sequence
    fp32 = ModelRunner(LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.float32), 1, 32)
    assert not fp32.upcast_single_query

    seq = list(range(12))
    plain = ModelRunner(LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.bfloat16), 1, 32)
    plain.upcast_single_query = False
    ref = hf(torch.tensor([seq])).logits[0, -1]
    for r in (bf16, plain):
        r.reset(0)
        r.forward([0], [seq[:-1]], [1])
        assert (r.forward([0], [seq[-1:]], [1])[0] - ref).abs().max() < 0.1


@pytest.mark.real_models
def test_real_draft_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM

    from dsde_core.models.loader import DEFAULT_DRAFT, load_model

    loaded = load_model(DEFAULT_DRAFT, dtype=torch.float32)
    ids = loaded.tokenizer('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')["input_ids"]
    runner = ModelRunner(loaded.model, num_slots=2, max_seq_len=128)
    # a ragged batch (slot 1 holds a prefix), then a 3-token chunk of slot 0
    first = runner.forward([1, 0], [ids[:5], ids[:-3]], [5, len(ids) - 3])
    ours = torch.cat([first[5:], runner.forward([0], [ids[-3:]], [3])])
    hf = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() < 1e-3  # measured ~3e-5 with logits up to ~23
    assert (first[:5] - ref[:5]).abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
