"""Stateful property tests of the block manager and the scheduler (hypothesis).

The block manager is checked against a model of which live table holds which block and
which tokens each computed block holds. The scheduler runs with the NullExecutor's
shadow KV cache, so any wrong block table or prefix hit fails loudly, and every run
ends by draining all requests and comparing their outputs with a run on a huge pool.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)
from sched_helpers import EOS, Transcript, make

from wavecore.engine.sampling_params import SamplingParams
from wavecore.engine.scheduler import (
    BlockManager,
    BlockPoolExhaustedError,
    PromptTooLongError,
)
from wavecore.statemachines import PauseMode
from wavecore.statemachines.request import FinishReason, RequestState

# A tiny alphabet, so that prompts share prefixes and the prefix cache gets hits.
tokens_strategy = st.lists(st.integers(min_value=3, max_value=5), min_size=1, max_size=14)
# Prompts that often start with one of a few shared system prompts.
prompt_strategy = st.builds(
    lambda head, tail: (head + tail)[:14] or [3],
    st.sampled_from([[], [3, 4, 5, 3, 4, 5, 3, 4], [5, 5, 4, 4, 3, 3]]),
    tokens_strategy,
)


class BlockManagerMachine(RuleBasedStateMachine):
    tables = Bundle("tables")

    @initialize(
        num_blocks=st.integers(min_value=1, max_value=12),
        block_size=st.integers(min_value=1, max_value=4),
    )
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.manager = BlockManager(num_blocks=num_blocks, block_size=block_size)
        self.live: dict[int, tuple[list[int], list[int], list[int]]] = {}
        self.next_key = 0
        # What each registered block holds: checked against every prefix hit.
        self.contents: dict[int, tuple[int, ...]] = {}

    @rule(target=tables, tokens=tokens_strategy)
    def allocate(self, tokens: list[int]) -> int:
        manager = self.manager
        hit = manager.lookup_prefix(tokens)
        size = manager.block_size
        assert hit.num_tokens < len(tokens)
        for index, block in enumerate(hit.block_ids):
            assert self.contents[block] == tuple(tokens[index * size : (index + 1) * size])
        free_before = manager.num_free_blocks
        if not manager.can_allocate(hit, len(tokens)):
            try:
                manager.allocate(hit, len(tokens))
            except BlockPoolExhaustedError:
                pass
            else:
                raise AssertionError("allocate succeeded after can_allocate said no")
            assert manager.num_free_blocks == free_before
            return -1
        table = manager.allocate(hit, len(tokens))
        assert table[: len(hit.block_ids)] == list(hit.block_ids)
        assert len(table) == manager.blocks_needed(len(tokens))
        key = self.next_key
        self.next_key += 1
        self.live[key] = (table, list(hit.block_hashes), list(tokens))
        return key

    @rule(key=tables, extra=st.lists(st.integers(min_value=3, max_value=5), max_size=6))
    def append_and_compute(self, key: int, extra: list[int]) -> None:
        if key not in self.live:
            return
        table, hashes, tokens = self.live[key]
        wanted = len(tokens) + len(extra)
        if not self.manager.can_append(table, wanted):
            return
        self.manager.append(table, wanted)
        tokens.extend(extra)
        self.manager.cache_full_blocks(table, hashes, tokens, len(tokens))
        size = self.manager.block_size
        for index in range(len(tokens) // size):
            block = table[index]
            if self.manager.is_cached(block):  # registered by anyone
                # What this table computed into it: a shared block holds the same tokens,
                # and a block the append took from the cache (evicting it) holds these
                # now, though the invariant never saw it uncached in between.
                self.contents[block] = tuple(tokens[index * size : (index + 1) * size])

    @rule(key=consumes(tables), check_reuse=st.booleans())
    def free(self, key: int, check_reuse: bool) -> None:
        if key not in self.live:
            return
        table, _, tokens = self.live.pop(key)
        self.manager.free(table)
        if check_reuse and self.manager.num_cached_blocks:
            # Right after a free nothing was evicted, so the computed prefix still hits.
            registered = 0
            for index in range(len(tokens) // self.manager.block_size):
                if not self.manager.is_cached(table[index]):
                    break
                registered += 1
            expected = min(registered, (len(tokens) - 1) // self.manager.block_size)
            hit = self.manager.lookup_prefix(tokens)
            assert len(hit.block_ids) >= expected

    @rule()
    def reset_prefix_cache(self) -> None:
        self.manager.reset_prefix_cache()
        self.contents.clear()

    @invariant()
    def counts_add_up(self) -> None:
        manager = self.manager
        assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
        held = Counter(block for table, _, _ in self.live.values() for block in table)
        for block in range(manager.num_blocks):
            assert manager.ref_count(block) == held[block]
        for table, _, _ in self.live.values():
            assert len(set(table)) == len(table)
        assert manager.num_used_blocks == len(held)
        # Evicted blocks lose their recorded contents.
        for block in list(self.contents):
            if not manager.is_cached(block):
                del self.contents[block]


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_kv_blocks=st.integers(min_value=3, max_value=10),
        block_size=st.integers(min_value=1, max_value=4),
        budget=st.integers(min_value=1, max_value=24),
        max_num_seqs=st.integers(min_value=1, max_value=5),
        eos_at_output=st.none() | st.integers(min_value=0, max_value=4),
        caching=st.booleans(),
        prefill_interval=st.sampled_from([1, 1, 2]),
    )
    def setup(
        self,
        num_kv_blocks: int,
        block_size: int,
        budget: int,
        max_num_seqs: int,
        eos_at_output: int | None,
        caching: bool,
        prefill_interval: int,
    ) -> None:
        self.limits = dict(
            block_size=block_size,
            max_model_len=24,
            eos_at_output=eos_at_output,
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            enable_prefix_caching=caching,
            prefill_interval=prefill_interval,
        )
        self.scheduler, self.executor = make(num_kv_blocks=num_kv_blocks, **self.limits)
        self.transcript = Transcript()
        self.requests: dict[str, tuple[list[int], SamplingParams]] = {}
        self.cut_short: set[str] = set()  # aborted or stopped from outside
        self.finished_records: list = []
        self.next_id = 0
        self.live: set[str] = set()  # the test's own account of unfinished requests

    # -- rules ---------------------------------------------------------------------

    @rule(
        prompt=prompt_strategy,
        max_tokens=st.integers(min_value=1, max_value=12),
        min_tokens=st.integers(min_value=0, max_value=2),
        ignore_eos=st.booleans(),
    )
    def add(self, prompt: list[int], max_tokens: int, min_tokens: int, ignore_eos: bool) -> None:
        request_id = f"r{self.next_id}"
        self.next_id += 1
        sampling = SamplingParams(
            max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens), ignore_eos=ignore_eos
        )
        if len(prompt) >= self.scheduler.config.max_sequence_len:
            try:
                self.scheduler.add(request_id, prompt, sampling)
            except PromptTooLongError:
                return
            raise AssertionError("an oversized prompt was accepted")
        self.scheduler.add(request_id, prompt, sampling)
        self.requests[request_id] = (list(prompt), sampling)
        self.live.add(request_id)

    @rule(abort_in_flight=st.booleans(), data=st.data())
    def step(self, abort_in_flight: bool, data: st.DataObject) -> None:
        self._run_step(data if abort_in_flight else None)

    @precondition(lambda self: self.scheduler.has_unfinished())
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = sorted(self._live_ids())
        self._abort(data.draw(st.sampled_from(live)))

    @precondition(lambda self: self.scheduler.num_running > 0)
    @rule(data=st.data())
    def stop_string(self, data: st.DataObject) -> None:
        running = sorted(
            request_id
            for request_id in self._live_ids()
            if self.scheduler.get_request(request_id).state is RequestState.RUNNING
        )
        request_id = data.draw(st.sampled_from(running))
        self.finished_records.append(self.scheduler.get_request(request_id))
        assert self.scheduler.finish(request_id, FinishReason.STOP)
        self.cut_short.add(request_id)
        self.live.discard(request_id)

    @rule(mode=st.sampled_from([None, *PauseMode]))
    def pause(self, mode: PauseMode | None) -> None:
        self.scheduler.set_pause(mode)

    @rule()
    def drop_kv_cache(self) -> None:
        self.scheduler.preempt_all()
        self.scheduler.reset_prefix_cache()
        self.executor.reset_kv_cache()

    # -- invariants ----------------------------------------------------------------

    @invariant()
    def queues_and_blocks_are_consistent(self) -> None:
        scheduler = self.scheduler
        manager = scheduler.block_manager
        assert manager.num_free_blocks + manager.num_used_blocks == manager.num_blocks
        running, waiting = scheduler.queues()
        ids = [r.request_id for r in running] + [r.request_id for r in waiting]
        assert len(ids) == len(set(ids)), "a request is in two queues"
        assert set(ids) == self.live
        assert all(scheduler.get_request(request_id) is not None for request_id in ids)
        assert scheduler.has_unfinished() == bool(ids)
        assert all(r.state is RequestState.RUNNING for r in running)
        assert all(r.state in (RequestState.WAITING, RequestState.PREEMPTED) for r in waiting)
        assert all(not r.block_table for r in waiting)
        assert len(running) <= scheduler.config.max_num_seqs
        held = Counter(block for r in running for block in r.block_table)
        for block in range(manager.num_blocks):
            assert manager.ref_count(block) == held[block]
        for record in self.finished_records:
            assert record.state is RequestState.FINISHED and not record.block_table

    # -- the end: drain, then compare with a run that never preempts ----------------

    def teardown(self) -> None:
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        scheduler.set_pause(None)
        for _ in range(2000):
            if not scheduler.has_unfinished():
                break
            self._run_step(None)
        assert not scheduler.has_unfinished(), f"requests never finished: {scheduler.stats()}"
        assert scheduler.block_manager.num_used_blocks == 0

        # A pool so large nothing is ever preempted, with the same length cap.
        limits = {**self.limits, "max_model_len": scheduler.config.max_sequence_len}
        reference, executor = make(num_kv_blocks=4096, **limits)
        reference.set_pause(None)
        for request_id, (prompt, sampling) in self.requests.items():
            reference.add(request_id, prompt, sampling)
        expected = Transcript()
        while reference.has_unfinished():
            output = reference.schedule()
            expected.record(reference.update(output, executor.execute(output.batch)))
        for request_id in self.requests:
            got = self.transcript.tokens.get(request_id, [])
            want = expected.tokens[request_id]
            if request_id in self.cut_short:
                assert got == want[: len(got)], request_id
            else:
                assert got == want, request_id
                assert self.transcript.reasons[request_id] is expected.reasons[request_id]
            if self.transcript.reasons.get(request_id) is FinishReason.STOP:
                assert got and (got[-1] == EOS or request_id in self.cut_short)

    # -- helpers -------------------------------------------------------------------

    def _run_step(self, abort_with: st.DataObject | None) -> None:
        scheduler = self.scheduler
        _, waiting = scheduler.queues()
        output = scheduler.schedule()
        assert output.batch.num_tokens <= scheduler.config.max_num_batched_tokens
        assert output.stats.num_scheduled_tokens == output.batch.num_tokens
        if output.num_preempted:
            event("a step preempted")
        admitted = {id(r) for r in waiting}
        if any(
            c.start_pos and id(r) in admitted
            for c, r in zip(output.batch.chunks, output.requests, strict=True)
        ):
            event("admitted after a prefix-cache hit")
        model_output = self.executor.execute(output.batch)
        if abort_with is not None and output.requests:
            victim = abort_with.draw(st.sampled_from([r.request_id for r in output.requests]))
            self._abort(victim)
            event("aborted a request in flight")
        self._record(scheduler.update(output, model_output))
        self.finished_records.extend(r for r in output.requests if r.state is RequestState.FINISHED)

    def _live_ids(self) -> list[str]:
        running, waiting = self.scheduler.queues()
        return [r.request_id for r in (*running, *waiting)]

    def _abort(self, request_id: str) -> None:
        record = self.scheduler.get_request(request_id)
        if self.scheduler.abort([request_id]):
            self.finished_records.append(record)
            self.cut_short.add(request_id)
            self.live.discard(request_id)

    def _record(self, updates: list) -> None:
        for update in updates:
            if update.finish_reason is not None:
                assert self.scheduler.get_request(update.request_id) is None
                self.live.discard(update.request_id)
        self.transcript.record(updates)


# Each example is cheap, so these machines run twice the profile's examples.
_more = settings(max_examples=settings().max_examples * 2)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = _more
TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = _more
