"""The scheduler and block manager as tables: plans are pure functions of queue, running set and blocks."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hpcinfer.engine.kvcache.block_manager import BlockManager
from hpcinfer.engine.scheduler import Scheduler
from hpcinfer.engine.sequence import SamplingParams, Sequence, Status


def seqs(*lengths: int) -> list[Sequence]:
    return [Sequence(i, list(range(n)), SamplingParams()) for i, n in enumerate(lengths)]


def shape(plan) -> tuple[list, list, list]:
    """(decode seq ids, prefill (id, start, length), preempted ids)."""
    return (
        [c.seq.seq_id for c in plan.decodes],
        [(c.seq.seq_id, c.start, c.length) for c in plan.prefills],
        [s.seq_id for s in plan.preempted],
    )


def step(sched: Scheduler, token: int = 7):
    plan = sched.schedule()
    sched.update(plan, [token] * sum(c.samples for c in plan.chunks))
    return shape(plan)


@pytest.mark.parametrize(
    ("lengths", "max_seqs", "max_tokens", "expected"),
    [
        # everything fits: all prompts whole in one step
        ((5, 3), 8, 64, ([], [(0, 0, 5), (1, 0, 3)], [])),
        # the budget splits the second prompt (chunked prefill)
        ((5, 6), 8, 8, ([], [(0, 0, 5), (1, 0, 3)], [])),
        # one prompt longer than the budget: a chunk of it
        ((20,), 8, 8, ([], [(0, 0, 8)], [])),
        # --max-num-seqs caps admissions
        ((2, 2, 2), 2, 64, ([], [(0, 0, 2), (1, 0, 2)], [])),
    ],
)
def test_first_step(lengths, max_seqs, max_tokens, expected):
    sched = Scheduler(BlockManager(64, 4), max_seqs, max_tokens)
    for s in seqs(*lengths):
        sched.add(s)
    assert shape(sched.schedule()) == expected


def test_decodes_first_then_chunks_of_the_rest():
    sched = Scheduler(BlockManager(64, 4), 8, 8)
    for s in seqs(4, 4, 20):
        sched.add(s)
    assert step(sched) == ([], [(0, 0, 4), (1, 0, 4)], [])
    # two decodes, then 6 tokens of the long prompt
    assert step(sched) == ([0, 1], [(2, 0, 6)], [])
    assert step(sched) == ([0, 1], [(2, 6, 6)], [])
    assert step(sched) == ([0, 1], [(2, 12, 6)], [])
    # the long prompt's last 2 tokens; its first token is sampled at the end of this chunk
    assert step(sched) == ([0, 1], [(2, 18, 2)], [])
    assert step(sched) == ([0, 1, 2], [], [])


def test_without_chunking_a_long_prompt_waits_for_a_whole_budget():
    sched = Scheduler(BlockManager(64, 4), 8, 8, chunked_prefill=False)
    for s in seqs(4, 6):
        sched.add(s)
    assert step(sched) == ([], [(0, 0, 4)], [])
    assert step(sched) == ([0], [(1, 0, 6)], [])


def test_finish_frees_blocks_and_a_waiting_prompt_takes_the_place_that_step():
    blocks = BlockManager(3, 4)
    sched = Scheduler(blocks, 8, 64)
    a, b = seqs(8, 8)
    sched.add(a)
    sched.add(b)
    assert step(sched) == ([], [(0, 0, 8)], [])  # b needs 2 more blocks: none free
    sched.finish(a, "stop")
    assert blocks.num_free == 3 and a.status is Status.FINISHED and a.block_table == []
    assert step(sched) == ([], [(1, 0, 8)], [])


def test_out_of_blocks_preempts_the_newest_and_recomputes_it():
    blocks = BlockManager(4, 4)  # 16 token slots
    sched = Scheduler(blocks, 8, 64)
    a, b = seqs(7, 7)
    sched.add(a)
    sched.add(b)
    assert step(sched) == ([], [(0, 0, 7), (1, 0, 7)], [])  # 2 blocks each, 8 tokens each now
    assert step(sched) == ([0, 1], [], [])  # token 8 of each fits in block 2
    # token 9 needs a third block each: a (oldest) gets b's, b is preempted
    assert step(sched) == ([0], [], [1])
    assert sched.preemptions == 1 and b.num_computed == 0 and b.status is Status.WAITING
    assert b.num_completion == 2 and b.block_table == [] and sched.waiting[0] is b
    assert blocks.num_free == 1
    sched.finish(a, "length")
    # b comes back as one prompt of its 9 tokens (7 prompt + 2 generated); it samples at the end
    plan = sched.schedule()
    assert shape(plan) == ([], [(1, 0, 9)], []) and plan.prefills[0].samples


def test_preemption_never_takes_a_sequence_already_planned_this_step():
    blocks = BlockManager(3, 2)
    sched = Scheduler(blocks, 8, 3)
    a, b = seqs(2, 3)
    sched.add(a)
    sched.add(b)
    assert step(sched) == ([], [(0, 0, 2), (1, 0, 1)], [])
    # a decodes (needs a new block: the last one); b's next chunk has none and b is the newest
    assert step(sched) == ([0], [], [1])
    assert a.num_computed == 3 and len(a.block_table) == 2


def test_blocks_are_recycled_and_the_peak_recorded():
    blocks = BlockManager(6, 2)
    sched = Scheduler(blocks, 8, 64)
    for s in seqs(3, 3):
        sched.add(s)
    step(sched)
    assert blocks.num_used == 4 and blocks.peak_used == 4
    for s in list(sched.running):
        sched.finish(s, "stop")
    assert blocks.num_free == 6 and blocks.peak_used == 4
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_scheduler_and_block_manager_import_no_torch():
    root = Path(__file__).resolve().parents[2] / "hpcinfer" / "engine"
    for name in ("scheduler.py", "kvcache/block_manager.py", "sequence.py"):
        tree = ast.parse((root / name).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "torch" not in imported and "numpy" not in imported, name


def test_max_loras_passes_over_a_prompt_of_another_adapter_then_stops_behind_it():
    """--max-loras 1: prompts of the running adapter go ahead of one of another adapter, until that one
    has waited LORA_PATIENCE admissions; then nothing more is admitted until it fits."""
    from hpcinfer.engine.scheduler import LORA_PATIENCE

    sched = Scheduler(BlockManager(256, 4), 64, 128, max_loras=1)
    adapters = (1, 2, 1, 0, 1)
    queue = [Sequence(i, [i, 5, 6], SamplingParams(max_tokens=64, lora=a)) for i, a in enumerate(adapters)]
    for s in queue:
        sched.add(s)
    plan = sched.schedule()
    sched.update(plan, [7] * len(plan.prefills))
    assert [c.seq.seq_id for c in plan.prefills] == [0, 2, 3, 4]  # 1 (adapter 2) passed over
    assert queue[1].lora_waits == 1
    for i in range(5, 5 + LORA_PATIENCE):  # adapter 1 keeps arriving; adapter 2's prompt waits
        sched.add(Sequence(i, [i, 5, 6], SamplingParams(max_tokens=64, lora=1)))
        plan = sched.schedule()
        sched.update(plan, [7] * sum(c.samples for c in plan.chunks))
        admitted = [c.seq.seq_id for c in plan.prefills]
        assert admitted == ([i] if queue[1].lora_waits <= LORA_PATIENCE else []), i
        assert {s.params.lora for s in sched.running} - {0} == {1}
    assert queue[1].lora_waits > LORA_PATIENCE and queue[1].status is Status.WAITING
    for seq in [s for s in sched.running if s.params.lora == 1]:  # adapter 1's sequences end
        sched.finish(seq, "stop")
    sched.add(Sequence(99, [1, 5, 6], SamplingParams(lora=1)))
    assert [c.seq.seq_id for c in sched.schedule().prefills] == [1]  # adapter 2 now; 99 waits behind it
