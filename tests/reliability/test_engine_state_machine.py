"""A hypothesis state machine over one EngineCore on the virtual clock, through its public API only
(add_request, abort_requests, call, run_until_idle, stats): whatever the order of arrivals, aborts,
config patches and time, every request the engine received ends exactly once (completed, failed
or aborted), nothing runs after it ended, no KV block is left held, and a prompt a patched
max_model_len leaves no room for fails (it is not "completed" with no tokens)."""

from __future__ import annotations

import asyncio
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllm_vcr.engine.clock import VirtualClock
from vllm_vcr.engine.config import EngineArgs, EngineConfig, FailureType
from vllm_vcr.engine.core import EngineCore
from vllm_vcr.engine.types import EngineCoreRequest, FinishReason, SamplingParams

SHARED = [(7 * i) % 3000 + 1 for i in range(200)]


class EngineMachine(RuleBasedStateMachine):
    @initialize(kv_blocks=st.integers(8, 64), block=st.sampled_from([4, 16]), seqs=st.integers(1, 6),
                budget=st.integers(16, 256), policy=st.sampled_from(["fcfs", "priority"]))
    def start(self, kv_blocks, block, seqs, budget, policy):
        cfg = EngineConfig(inter_token_latency=1, time_to_first_token=2, max_num_seqs=seqs,
                           max_num_batched_tokens=budget, log_requests=False,
                           failure_types=[FailureType.ERROR, FailureType.LENGTH])
        args = EngineArgs(config=cfg, kv_cache_size=kv_blocks, tokens_per_block=block, scheduling_policy=policy,
                          vocab_size=4000).validate()
        self.clock = VirtualClock(0.0)
        self.outputs: list = []
        self.core = EngineCore(args, clock=self.clock, output_sink=lambda c, o: self.outputs.append(o))
        self.loop = asyncio.new_event_loop()
        self.added: dict[str, int] = {}  # id -> max_tokens
        self.ended: Counter[str] = Counter()  # times each id was reported finished
        self.tokens: Counter[str] = Counter()
        self.reasons: dict[str, object] = {}  # id -> its finish_reason, when it had a finish output
        self.no_room: set[str] = set()  # prompts the patched max_model_len leaves no room for
        self.max_model_len = 0
        self.next_id = 0

    def teardown(self) -> None:
        if hasattr(self, "loop"):
            self.core.run_until_idle()
            self._collect()
            self._check_idle()
            self.loop.close()

    # ---- helpers -------------------------------------------------------------------------------
    def _call(self, fn):
        """core.call, answered between two steps (the engine's own way in for reads and patches)."""

        async def go():
            fut = self.core.call(fn)
            self.core.run_until_idle(until=self.clock.now())
            return await fut

        return self.loop.run_until_complete(go())

    def _collect(self) -> None:
        for batch in self.outputs:
            for o in batch.outputs:
                assert self.ended[o.request_id] == 0, f"{o.request_id} produced output after it ended"
                self.tokens[o.request_id] += len(o.new_token_ids)
                if o.finish_reason is not None:
                    self.reasons[o.request_id] = o.finish_reason
            # finished_requests names every request that left the engine, aborted ones included
            for rid in batch.finished_requests or ():
                self.ended[rid] += 1
        self.outputs.clear()

    def _check_idle(self) -> None:
        s = self._call(lambda c: c.current_stats())
        assert s.running == 0 and s.waiting == 0
        assert s.requests_received == len(self.added)
        assert s.requests_received == s.requests_completed + s.requests_failed + s.requests_aborted
        free, total = self._call(lambda c: (c.block_pool.num_free_blocks, c.block_pool.num_blocks))
        assert free == total, f"{total - free} KV blocks leaked"
        assert set(self.ended) == set(self.added) and all(n == 1 for n in self.ended.values())
        for rid in self.no_room:  # failed on arrival (vLLM's context check), never "completed" with 0 tokens
            assert self.reasons.get(rid) == FinishReason.ERROR and self.tokens[rid] == 0, (rid, self.reasons.get(rid))

    # ---- rules ---------------------------------------------------------------------------------
    @rule(plen=st.integers(1, 150), max_tokens=st.integers(1, 40), share=st.booleans(), prio=st.integers(-2, 2))
    def add(self, plen, max_tokens, share, prio):
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = SHARED[:plen] if share else [(self.next_id * 131 + i) % 3000 + 1 for i in range(plen)]
        self.core.add_request(EngineCoreRequest(request_id=rid, prompt_token_ids=prompt, priority=prio,
                                                sampling_params=SamplingParams(max_tokens=max_tokens)))
        self.added[rid] = max_tokens
        if self.max_model_len and plen >= self.max_model_len:
            self.no_room.add(rid)

    @precondition(lambda self: self.added)
    @rule(data=st.data())
    def abort_one(self, data):
        rid = data.draw(st.sampled_from(sorted(self.added)))
        self.core.abort_requests([rid, rid])  # twice: aborts are idempotent

    @rule()
    def abort_unknown(self):
        self.core.abort_requests(["never-added"])

    @rule(dt=st.sampled_from([0.0, 0.001, 0.005, 0.03]))
    def advance(self, dt):
        self.core.run_until_idle(until=self.clock.now() + dt)
        self._collect()

    @rule(seqs=st.integers(1, 8), fail=st.sampled_from([0.0, 0.3]), max_model_len=st.sampled_from([0, 64, 4096]))
    def patch(self, seqs, fail, max_model_len):
        cfg = self._call(lambda c: c.patch_config({"max_num_seqs": seqs, "failure_injection_rate": fail,
                                                   "max_model_len": max_model_len}) or c.config)
        assert cfg.max_num_seqs == seqs
        self.max_model_len = max_model_len

    @rule()
    def drain(self):
        self.core.run_until_idle()
        self._collect()
        self._check_idle()

    @invariant()
    def counters_add_up(self):
        if not hasattr(self, "core"):
            return
        s = self.core.stats
        assert s.requests_received <= len(self.added)
        assert s.requests_completed + s.requests_failed + s.requests_aborted <= s.requests_received
        for rid, n in self.tokens.items():
            assert n <= self.added[rid], f"{rid}: {n} tokens for max_tokens {self.added[rid]}"


EngineMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                           suppress_health_check=list(HealthCheck))
test_engine_state_machine = EngineMachine.TestCase
