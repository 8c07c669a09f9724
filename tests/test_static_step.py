"""The static step (dsde_core/models/static_step.py) against the eager forward, in fp32 logits: ragged batches padded
to their buckets, rollback, sliding windows, calls beyond the buckets; its host syncs; an engine on it."""

from __future__ import annotations

import pytest
import torch

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.engine import Engine
from dsde_core.errors import ConfigError
from dsde_core.models.llama import LlamaModel, fused_ops
from dsde_core.models.runner import ModelRunner
from dsde_core.models.static_step import StaticRunner, StepBuckets
from dsde_core.policies import make_policy
from dsde_core.syncs import SyncCounter
from dsde_core.workers import DraftWorker, TargetWorker
from tests.tiny import VOCAB, IdTokenizer, random_prompts, tiny_pair

TOL = 1e-5


class Pair:
    """The eager runner and a static one on the same weights, fed the same calls; every call's outputs compared."""

    def __init__(self, hf, attention: str = "torch", num_slots: int = 6, max_seq_len: int = 48,
                 max_query: int = 6) -> None:
        model = LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.float32, prepack=False)
        self.eager = ModelRunner(model, num_slots, max_seq_len)
        self.static = StaticRunner(model, num_slots, max_seq_len, max_query, attention=attention)
        self.runs = 0
        run = self.static._run

        def counted(bucket):
            self.runs += 1
            return run(bucket)

        self.static._run = counted

    def forward(self, feed: dict[int, list[int]], num_logits: list[int] | None = None, hidden: bool = False) -> None:
        slots, tokens = list(feed), list(feed.values())
        n = num_logits or [len(t) for t in tokens]
        ref = self.eager.forward(slots, tokens, n, hidden=hidden)
        out = self.static.forward(slots, tokens, n, hidden=hidden)
        assert out.shape == ref.shape
        assert (out - ref).abs().max().item() < TOL
        for s in slots:
            assert self.static.length(s) == self.eager.length(s)

    def rollback(self, slot: int, n: int) -> None:
        self.eager.set_length(slot, n)
        self.static.set_length(slot, n)


def toks(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=g).tolist()


def test_buckets() -> None:
    assert StepBuckets(8, 3).batches == (1, 2, 4, 8)
    assert StepBuckets(40, 3).batches == (1, 2, 4, 8, 16, 32, 40)
    assert StepBuckets(1, 2).batches == (1,)
    assert StepBuckets(64, 5).queries == (1, 2, 3, 4, 5)
    assert StepBuckets(40, 5).fit(17, 3) == (32, 3)
    assert StepBuckets(40, 5).fit(3, 1) == (4, 1)
    assert StepBuckets(40, 5).fit(41, 1) is None and StepBuckets(40, 5).fit(2, 6) is None


def test_static_step_equals_the_eager_forward(arch: str, make_tiny_model) -> None:
    """Ragged decode and verify rows padded to their buckets (3 rows -> 4, 5 -> 8; query lengths mixed), rollback,
    prefills beyond the buckets in between, windows of 6 and 8 passed (qwen2, mistral), hidden states and logits."""
    g = torch.Generator().manual_seed(3)
    p = Pair(make_tiny_model(arch))
    p.forward({0: toks(g, 11), 1: toks(g, 3), 2: toks(g, 17)}, [1, 1, 1])  # prefill: eager (q > 6)
    assert p.runs == 0
    p.forward({2: toks(g, 1), 0: toks(g, 5), 1: toks(g, 2)}, [1, 5, 2])  # bucket (4, 5)
    p.forward({1: toks(g, 6)}, [6], hidden=True)  # bucket (1, 6)
    p.rollback(0, p.eager.length(0) - 4)
    p.rollback(1, p.eager.length(1) - 5)
    p.forward({3: toks(g, 4), 4: toks(g, 2), 5: toks(g, 1)}, [1, 1, 1])  # fresh slots, bucket (4, 4)
    for step in range(6):  # past the windows; ragged verification each step
        feed = {s: toks(g, 1 + (s + step) % 4) for s in (5, 0, 3, 1, 2)}
        p.forward(feed, [len(t) for t in feed.values()], hidden=step % 2 == 1)  # bucket (8, <= 4)
    assert p.runs == 9
    p.static.reset(4)
    p.eager.reset(4)
    p.forward({4: toks(g, 3)}, [2])


def test_static_step_with_the_triton_kernel(make_tiny_model) -> None:
    """The kernel path of the static step (lengths read at run time), under Triton's interpreter, with a window."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(4)
    p = Pair(make_tiny_model("mistral"), attention="triton", num_slots=3, max_seq_len=32, max_query=4)
    p.forward({0: toks(g, 9), 1: toks(g, 5)})
    for step in range(3):
        p.forward({1: toks(g, 1 + step), 0: toks(g, 1)}, [1 + step, 1])
    p.forward({2: toks(g, 2), 0: toks(g, 3), 1: toks(g, 1)}, [2, 3, 1])
    assert p.runs == 4


def test_the_static_forward_reads_nothing_back(make_tiny_model) -> None:
    """Between the packet and the outputs: no host read, no data-dependent op (the eager forward has some)."""
    hf = make_tiny_model("qwen2")
    p = Pair(hf)
    p.forward({0: toks(torch.Generator().manual_seed(0), 8), 1: [3, 4]})
    with SyncCounter() as eager:
        p.eager.forward([0, 1], [[5, 6, 7], [8]], [3, 1])
    with SyncCounter() as static:
        p.static.forward([0, 1], [[5, 6, 7], [8]], [3, 1])
    assert eager.total > 0
    assert static.total == 0, static.syncs


def test_tokens_from_the_device_feed_what_the_lists_do(make_tiny_model) -> None:
    """forward(ids=...): a draft level's tokens given on the device, one a row, in place of the lists' values, give the
    lists' logits on both runners (3 rows padded to a bucket of 4, 2 rows out of slot order, 1 row);
    the static forward still reads nothing back, and ids of the wrong shape are refused."""
    g = torch.Generator().manual_seed(5)
    hf = make_tiny_model("qwen2")
    p, q = Pair(hf), Pair(hf)  # p fed lists, q the same tokens from the device
    for pair in (p, q):
        pair.forward({0: toks(torch.Generator().manual_seed(1), 9), 1: [3, 4], 2: [5]})
    for rows in ([0, 1, 2], [2, 0], [1]):
        feed = [toks(g, 1) for _ in rows]
        ids = torch.tensor([t[0] for t in feed])
        for runner in ("eager", "static"):
            ref = getattr(p, runner).forward(rows, feed, [1] * len(rows))
            with SyncCounter() as c:
                out = getattr(q, runner).forward(rows, [[0]] * len(rows), [1] * len(rows), ids=ids)
            assert torch.equal(out, ref), (rows, runner)
            assert runner == "eager" or c.total == 0, c.syncs
    with pytest.raises(ConfigError, match="one token a row"):
        q.static.forward([0, 1], [[0], [0]], [1, 1], ids=torch.tensor([1]))
    with pytest.raises(ConfigError, match="one token a row"):
        q.eager.forward([0], [[0, 0]], [1], ids=torch.tensor([1]))


def test_bad_calls_are_refused(make_tiny_model) -> None:
    hf = make_tiny_model("llama")
    model = LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.float32, prepack=False)
    runner = StaticRunner(model, 2, 16, 4)
    with pytest.raises(ConfigError, match="slot 2 out of range"):
        runner.forward([2], [[1]], [1])  # the scratch slot is no request's
    with pytest.raises(ConfigError, match="token ids"):
        runner.forward([0], [[1, 999]], [1])
    with pytest.raises(ConfigError, match="twice"):
        runner.forward([0, 0], [[1], [2]], [1, 1])
    with pytest.raises(ConfigError, match="exceeds max_seq_len"):
        StaticRunner(model, 2, 16, 17)
    with pytest.raises(ConfigError, match="CUDA graphs need a CUDA device"):
        StaticRunner(model, 2, 16, 4, graphs=True)
    assert runner.length(0) == 0


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_an_engine_on_static_runners_emits_what_the_eager_one_does(temperature: float) -> None:
    """Speculation on static runners emits the eager runners' tokens (greedy: the target's own; sampled: the same
    draws from the same seeds), over a batch that fills and drains its buckets."""
    outs = []
    for static in (False, True):
        target, draft = tiny_pair()
        config = EngineConfig(max_batch_size=4, max_seq_len=96, dtype="float32", max_sl=4)
        make = (lambda m: StaticRunner(m, 4, 96, 5)) if static else (lambda m: ModelRunner(m, 4, 96))  # 5: 1 + max_sl
        engine = Engine(TargetWorker(make(target)), DraftWorker.from_config(make(draft), config),
                        make_policy("static:3"), IdTokenizer(), config, vocab_size=VOCAB)
        reqs = [engine.add_request(p, SamplingParams(max_tokens=12 + 3 * i, temperature=temperature, seed=i))
                for i, p in enumerate(random_prompts(6, seed=5))]
        engine.run()
        outs.append([r.output_ids for r in reqs])
        if static:  # every decode, draft level and verification ran static; the prefills eager
            calls = engine.target.runner.calls, engine.draft.runner.calls
            assert all(c["static"] > 3 * c["eager"] > 0 for c in calls), calls
    assert outs[0] == outs[1]
    assert all(len(o) > 0 for o in outs[1])


def test_fused_small_ops_equal_the_eager_ones(make_tiny_model) -> None:
    """fuse=True: capture() compiles RMSNorm, the residual add before a norm, RoPE and SiLU-mul (torch.compile), and
    the static step gives the eager forward's logits with them (here on the CPU, where nothing is captured; on CUDA
    the same functions run under the captured graphs)."""
    hf = make_tiny_model("qwen2")
    model = LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.float32, prepack=False)
    ref = ModelRunner(LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.float32, prepack=False), 6, 48)
    static = StaticRunner(model, 6, 48, 6, fuse=True)
    try:
        assert static.capture() == 0.0 and not static.graphs and static.compile_s > 0
        assert all(m.ops is fused_ops() for m in model.modules() if hasattr(m, "ops"))
        for feed, n in (({0: [1, 2, 3], 1: [4, 5]}, [3, 2]), ({0: [6], 1: [7, 8]}, [1, 2])):
            out = static.forward(list(feed), list(feed.values()), n)
            assert (out - ref.forward(list(feed), list(feed.values()), n)).abs().max().item() < TOL
        assert static.calls == {"static": 2, "eager": 0}
    finally:
        model.fuse(False)


def test_a_loaded_model_makes_the_runner_of_its_step(make_tiny_model) -> None:
    """EngineConfig.step reaches the runner: "static" builds the static step (captured at start-up on CUDA), "eager"
    the ModelRunner; llama.cpp runs its own step and refuses "static", naming the field; a bad step is refused."""
    from dsde_core.models.loader import LoadedModel

    hf = make_tiny_model("qwen2")
    model = LlamaModel.from_hf(hf.config, dict(hf.state_dict()), dtype=torch.float32, prepack=False)
    loaded = LoadedModel(model, None, hf.config, "tiny")
    runner = loaded.make_runner(3, 32, step="static", max_query=4)
    assert isinstance(runner, StaticRunner) and runner.buckets == StepBuckets(3, 4)
    assert type(loaded.make_runner(3, 32)) is ModelRunner
    gguf = LoadedModel(None, None, hf.config, "tiny.gguf", "/nowhere/tiny.gguf", backend="llama.cpp")
    with pytest.raises(ConfigError, match="step 'static' runs the torch forward") as e:
        gguf.make_runner(3, 32, step="static", max_query=4)
    assert e.value.field == "step"
    with pytest.raises(ConfigError, match="step must be one of eager, static"):
        EngineConfig(step="graphs")
