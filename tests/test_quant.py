"""Weight-only int8 for the draft: close to the bf16/fp32 layer, and speculation stays lossless with it."""

from __future__ import annotations

import torch
from torch import nn

from dsde_core.config import EngineConfig, SamplingParams
from dsde_core.engine import Engine
from dsde_core.models.llama import LlamaModel
from dsde_core.models.quant import Int8Linear, quantize_per_channel
from dsde_core.models.runner import ModelRunner
from dsde_core.policies import make_policy
from dsde_core.workers import DraftWorker, TargetWorker
from tests.tiny import VOCAB, IdTokenizer, random_prompts, tiny_pair, tiny_state


def test_per_channel_quantization_error_is_within_half_a_step() -> None:
    w = torch.randn(64, 48) * torch.linspace(0.1, 3.0, 64)[:, None]  # rows of very different ranges
    q, scale = quantize_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-6).all()


def test_int8_linear_matches_the_float_layer_and_falls_back_for_many_rows() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(96, 80, bias=True)
    layer = Int8Linear(lin, fallback=lin, max_rows=2)
    x = torch.randn(2, 96)
    rel = (layer(x) - lin(x)).norm() / lin(x).norm()
    assert 0 < rel < 0.02  # quantized: close, not identical
    x4 = torch.randn(4, 96)
    assert torch.equal(layer(x4), lin(x4))  # more rows than max_rows: the unquantized path


def test_speculation_with_an_int8_draft_is_lossless() -> None:
    target, _ = tiny_pair()
    config_hf, state = tiny_state()
    draft = LlamaModel.from_hf(config_hf, dict(state), dtype=torch.float32, prepack=False, quantize="int8")
    assert isinstance(draft.lm_head, Int8Linear)
    cfg = EngineConfig(max_batch_size=3, max_seq_len=256, dtype="float32")
    prompts = random_prompts(6, seed=5)

    def run(draft_model, policy):
        dw = DraftWorker.from_config(ModelRunner(draft_model, 3, 256), cfg) if draft_model is not None else None
        eng = Engine(TargetWorker(ModelRunner(target, 3, 256)), dw, make_policy(policy), IdTokenizer(), cfg,
                     vocab_size=VOCAB)
        reqs = [eng.add_request(p, SamplingParams(max_tokens=24)) for p in prompts]
        eng.run()
        return reqs

    ref = [r.output_ids for r in run(None, "off")]
    reqs = run(draft, "static:4")
    assert [r.output_ids for r in reqs] == ref
    # the int8 copy of the target itself agrees with it most of the time
    assert sum(r.stats.accepted for r in reqs) / sum(r.stats.drafted for r in reqs) > 0.5


def test_engine_config_resolves_auto_quantization() -> None:
    assert EngineConfig(dtype="bfloat16").draft_quantize == "int8"
    assert EngineConfig(dtype="float32").draft_quantize is None
    assert EngineConfig(dtype="float32", draft_quant="int8").draft_quantize == "int8"
    assert EngineConfig(draft_quant="none").draft_quantize is None
