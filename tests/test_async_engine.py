"""Streaming through the background step loop: outputs arrive as they are accepted; hanging up frees state."""

from __future__ import annotations

import asyncio

from dsde_core.async_engine import AsyncEngine
from dsde_core.config import SamplingParams
from tests.tiny import random_prompts, tiny_engine

PROMPTS = random_prompts(4, seed=11)


def _reference(max_tokens: int) -> list[list[int]]:
    engine = tiny_engine("off", batch=1, with_draft=False)
    reqs = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in PROMPTS]
    engine.run()
    return [r.output_ids for r in reqs]


async def _collect(aeng: AsyncEngine, prompt: list[int], max_tokens: int, stop_after: int | None = None):
    ids, chunks, last = [], 0, None
    async for out in aeng.generate(prompt, SamplingParams(max_tokens=max_tokens)):
        ids += out.token_ids
        chunks += 1
        last = out
        if stop_after is not None and chunks >= stop_after:
            break
    return ids, chunks, last


def test_concurrent_streams_are_lossless_and_incremental() -> None:
    aeng = AsyncEngine(tiny_engine("dsde", batch=2)).start()
    try:
        async def main():
            return await asyncio.gather(*(_collect(aeng, p, 25) for p in PROMPTS))
        results = asyncio.run(main())
    finally:
        aeng.stop()
    assert [ids for ids, _, _ in results] == _reference(25)
    for _, chunks, last in results:
        assert chunks > 1  # tokens streamed out over several steps, not all at the end
        assert last.finished and last.finish_reason == "length" and last.stats.drafted > 0


def test_hanging_up_cancels_and_frees_everything() -> None:
    engine = tiny_engine("dsde", batch=2)
    aeng = AsyncEngine(engine).start()
    try:
        async def main():
            return await asyncio.gather(*(_collect(aeng, p, 200, stop_after=2) for p in PROMPTS))
        asyncio.run(main())
        for _ in range(200):
            if not engine.has_unfinished():
                break
            asyncio.run(asyncio.sleep(0.01))
    finally:
        aeng.stop()
    assert not engine.has_unfinished() and not engine.requests
    assert engine.policy.num_tracked() == 0 and engine.target.num_open() == 0 and engine.draft.num_open() == 0
    assert sorted(engine.free_slots) == [0, 1]


def test_a_failing_step_ends_requests_with_an_error() -> None:
    engine = tiny_engine("static:2", batch=2)

    def broken(tasks):
        raise RuntimeError("target died")

    engine.target.verify = broken
    aeng = AsyncEngine(engine).start()
    try:
        _, _, last = asyncio.run(_collect(aeng, PROMPTS[0], 10))
    finally:
        aeng.stop()
    assert last.finished and last.finish_reason == "error" and "target died" in last.error
    assert not engine.requests and engine.target.num_open() == 0


def test_a_burst_on_an_idle_engine_starts_as_one_batch() -> None:
    """Requests arriving a few ms apart on an idle engine share the first step (one prefill), given admit_wait_s."""
    engine = tiny_engine("static:2", batch=4)
    aeng = AsyncEngine(engine, admit_wait_s=0.3).start()
    try:
        async def main():
            tasks = []
            for p in PROMPTS:
                tasks.append(asyncio.create_task(_collect(aeng, p, 6)))
                await asyncio.sleep(0.01)  # stragglers: each arrives after the engine has woken up
            return await asyncio.gather(*tasks)
        results = asyncio.run(main())
    finally:
        aeng.stop()
    assert [ids for ids, _, _ in results] == _reference(6)
    first = engine.step_log[0]
    assert first.prefill and first.batch == len(PROMPTS)
